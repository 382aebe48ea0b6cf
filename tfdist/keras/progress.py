"""One voice: under a multi-rank `HorovodStrategy` only the chief (rank 0) prints Keras' progress.

Every rank runs the same `fit`, so every rank would print the same progress bar or epoch line,
and launchers interleave them (`[1]<stdout>:[0]<stdout>:...`). Installed by `HorovodStrategy()`,
this makes ranks other than 0 run `fit`, `evaluate` and `predict` with `verbose=0`, whatever
`verbose` the call passes ("auto", 1 or 2), on Keras 3 and tf-keras. The chief's output is Keras'
own at the verbosity asked for, and the logs it prints are global (`tfdist.keras.metrics`):

```python
model.fit(ds, epochs=3)                 # rank 0 prints the progress bar; the others print nothing
model.fit(ds, epochs=3, verbose=2)      # rank 0 prints one line an epoch; the others print nothing
```

The same ranks also ignore Keras' Python `UserWarning`s (e.g. "`shuffle=True` was passed, but
will be ignored ..."): every rank runs the same code and would print the same warning.

`TFDIST_QUIET_RANKS=0` turns all of this off (and leaves ranks other than 0 at TensorFlow's own
C++ log level, as rank 0, where `tfdist.tuning.startup` otherwise quiets them; TensorFlow's
start-up lines stay off every rank unless `TFDIST_TF_STARTUP_LINES=1`). Models under other
strategies, and one-process jobs, are untouched.
"""

import functools
import inspect
import logging
import warnings

from tfdist import _compat, collectives
from tfdist.errors import KerasHookError
from tfdist.tuning import startup

log = logging.getLogger("tfdist")

HOOK = "chief-only progress bars"
METHODS = ("fit", "evaluate", "predict")
# Keras' warnings, by the module they are attributed to (Keras' own code, not the user's).
KERAS_WARNING_MODULES = r"(keras|tf_keras)(\.|$)"

_installed = set()
_skipped = set()  # classes whose methods another library's wrapper hides (warned once)
_filtered = []


def install():
    """Wrap `fit`/`evaluate`/`predict` of Keras 3 and (if used) tf-keras models; on ranks other
    than 0, ignore Keras' UserWarnings. Only output depends on it: where it cannot be installed
    (Keras moved a method, another library's wrapper hides its arguments) it warns once, naming
    the cause, and the job goes on."""
    for model_class, flavour in _compat.model_classes(HOOK):
        try:
            _patch(model_class, flavour)
        except KerasHookError as e:  # only output is at stake: say so once, train on
            if model_class not in _skipped:
                _skipped.add(model_class)
                log.warning("%s Every rank prints Keras' progress for this class's models; training is not "
                            "affected.", e)
    if not _filtered and quieted():
        warnings.filterwarnings("ignore", category=UserWarning, module=KERAS_WARNING_MODULES)
        _filtered.append(True)


def quieted():
    """Whether this process is a rank other than 0 of a multi-rank job, and quiet ranks are on."""
    return startup.quiet_ranks() and collectives.size() > 1 and collectives.rank() != 0


def _patch(model_class, flavour):
    if model_class in _installed:
        return
    _compat.require_methods(model_class, METHODS, HOOK, flavour)  # all checked before any is patched
    for name in METHODS:
        method = getattr(model_class, name)
        if "verbose" not in inspect.signature(method).parameters:
            raise _compat.hook_error(HOOK, f"{model_class.__name__}.{name}() takes no verbose argument", flavour,
                                     method)
    for name in METHODS:
        _compat.patch_method(model_class, name, _chief_only_progress, HOOK, flavour)
    _installed.add(model_class)


def _chief_only_progress(method):
    signature = inspect.signature(method)

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        if not _quiet_model(self):
            return method(self, *args, **kwargs)
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:
            return method(self, *args, **kwargs)  # Keras' own error for the wrong arguments
        bound.arguments["verbose"] = 0
        return method(*bound.args, **bound.kwargs)

    return wrapped


def _quiet_model(model):
    from tfdist.keras.recognise import multi_rank_strategy_of

    return multi_rank_strategy_of(model) is not None and quieted()
