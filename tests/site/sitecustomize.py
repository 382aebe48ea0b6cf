"""What the suite's Python processes do differently from a user's (tests/conftest.py's make_job_env
puts this folder on PYTHONPATH for every process a test starts). Test processes only: nothing here
is part of tfdist, and neither changes what a test checks.

- No last garbage collection at exit. With TensorFlow and Keras loaded, Python's final collection
  takes about a second per process on an idle 2-core machine (8-11 s under load, against 0.7-1.5 s
  with it skipped), horovodrun waits for its slowest rank, and the suite starts a few hundred such
  processes. What a test checks is written before exit (rank<R>.json, logs, checkpoints); tfdist's
  own preempted exit skips the same collection (tfdist.faults.preemption).
- Keras' optional imports of scikit-learn and matplotlib find nothing (`_KerasOptionalExtras`):
  1.3 to 2 s of CPU less per process (`import tensorflow, keras`, Zen 3, 2026-11-28).
- `TFDIST_TEST_UNINSTALLED=tf_keras,...`: those packages find nothing, as where they are not
  installed (`_Uninstalled`), for the tests of what a user without them sees, in real processes
  (Ray's workers among them: they inherit the variable).
"""

import atexit
import gc
import os
import sys

atexit.register(gc.freeze)


class _KerasOptionalExtras:
    """Keras imports scikit-learn and matplotlib.pyplot at `import keras` when they are installed,
    for its scikit-learn wrappers and plotting helpers: about 2 s of CPU per process here, and no
    test process uses either through Keras. Those two imports, made by Keras' own modules, find
    nothing (Keras then defines its fallbacks, as where they are not installed); everyone else's
    import of them (the digits loaders, the scaling plot) is untouched."""

    BLOCKED = ("sklearn", "matplotlib")
    IMPORTERS = ("keras.src.wrappers", "keras.src.visualization")

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in self.BLOCKED:
            return None
        frame = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__", "").startswith(("importlib", "_frozen_importlib")):
            frame = frame.f_back
        importer = frame.f_globals.get("__name__", "") if frame is not None else ""
        if importer.startswith(self.IMPORTERS):
            raise ModuleNotFoundError(f"{name}: not for Keras in tfdist's test processes (tests/site)", name=name)
        return None


sys.meta_path.insert(0, _KerasOptionalExtras())


class _Uninstalled:
    """The top-level packages named in TFDIST_TEST_UNINSTALLED find nothing."""

    def __init__(self, names):
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


if os.environ.get("TFDIST_TEST_UNINSTALLED"):
    sys.meta_path.insert(0, _Uninstalled(set(os.environ["TFDIST_TEST_UNINSTALLED"].split(","))))
