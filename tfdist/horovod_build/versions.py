"""The TensorFlow and Python versions tfdist declares and tests: TensorFlow 2.16 to 2.21 on Python 3.10 to 3.13.

TensorFlow 2.16 is the first whose `keras` is Keras 3; 2.21 is the newest tested (and the pinned
default of scripts/bootstrap.sh). setup.cfg's extras accept exactly this range
(tests/test_install_horovod.py compares them), `tfdist-install-horovod` says when it builds for a
TensorFlow outside it, `HorovodStrategy()` refuses Keras 2 (TensorFlow 2.15 and older) and Keras 3
before 3.5 before anything starts, and scripts/version_matrix.py runs the 2-rank checks on every cell
(docs/INSTALL.md, "Versions").

Standard library only: `tfdist/horovod_build/install.py` imports it by path, before TensorFlow or tfdist
is importable.

```python
from tfdist.horovod_build import versions
versions.tf_in_range("2.18.1")   # True
versions.RANGE_TEXT              # 'TensorFlow 2.16 to 2.21 (with the tf-keras of the same minor version)'
versions.keras_refusal("2.15.1", "2.15.0")  # the message HorovodStrategy() raises there
```
"""

import re

TF_OLDEST = (2, 16)  # the first TensorFlow whose `keras` is Keras 3
TF_NEWEST = (2, 21)
PINNED_TF = "2.21.0"  # scripts/bootstrap.sh's default
PYTHON_OLDEST, PYTHON_NEWEST = (3, 10), (3, 13)
KERAS_OLDEST = (3, 5)  # the first Keras 3 with every method tfdist's hooks patch (setup.cfg requires it)
RANGE_TEXT = (f"TensorFlow {TF_OLDEST[0]}.{TF_OLDEST[1]} to {TF_NEWEST[0]}.{TF_NEWEST[1]} "
              "(with the tf-keras of the same minor version)")


def minor(version):
    """(major, minor) of a version string such as "2.18.1" or "2.21.0rc1"; None if it has none."""
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def tf_in_range(version):
    """Whether TensorFlow `version` is within the declared range."""
    found = minor(version)
    return found is not None and TF_OLDEST <= found <= TF_NEWEST


def keras_refusal(tf_version, keras_version):
    """Why `HorovodStrategy()` refuses this `keras`, naming the versions and the range; None if it can run.

    Keras 2 (TensorFlow 2.15 and older) has none of the Keras 3 hooks tfdist installs, and Keras 3
    before 3.5 lacks one (its TensorFlow trainer has no `_maybe_symbolic_build`): either would fail
    with a KerasHookError after Horovod has started."""
    found = minor(keras_version)
    if found is None or found >= KERAS_OLDEST:
        return None
    oldest = f"{KERAS_OLDEST[0]}.{KERAS_OLDEST[1]}"
    if found[0] < 3:
        return (f"tfdist needs Keras {oldest} or newer as `keras`; this environment has TensorFlow {tf_version} "
                f"with keras {keras_version} (Keras 2, as TensorFlow 2.15 and older ship). tfdist supports "
                f"{RANGE_TEXT}: install one, e.g. `pip install '<tfdist checkout or wheel>[cpu]'`, which takes "
                f"the newest (docs/INSTALL.md, Versions)")
    return (f"tfdist needs Keras {oldest} or newer as `keras`; this environment has TensorFlow {tf_version} with "
            f"keras {keras_version}, whose TensorFlow trainer lacks a method tfdist patches. Upgrade Keras: "
            f"`pip install 'keras>={oldest}'` (docs/INSTALL.md, Versions)")
