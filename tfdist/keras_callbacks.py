"""Chief-only writes for Keras 3's file-writing callbacks under `HorovodStrategy`.

tf-keras already routes `ModelCheckpoint`, `BackupAndRestore` and `TensorBoard` writes of
non-chief workers to throw-away directories (through `strategy.extended.should_checkpoint` and
`_task_id`, which `HorovodStrategy` provides); its `BackupAndRestore` only needs to be told that
`HorovodStrategy` is one of the strategies it supports. Keras 3's callbacks know nothing of strategies, so
every rank would write the same files at the same time. Installed by `HorovodStrategy()`, this
gives Keras 3 the tf-keras behaviour on ranks other than 0:

- `ModelCheckpoint` and `TensorBoard` write under a private temporary directory of the rank;
- `BackupAndRestore` restores from the shared backup on every rank (so all ranks resume alike)
  but only the chief writes or deletes it.

`EarlyStopping` and the other callbacks need nothing: they see the same global logs on every
rank, so they take the same decisions. Models under other strategies are untouched.
"""

import functools
import os
import sys
import tempfile

from tfdist import collectives
from tfdist.errors import TfdistError
from tfdist.keras_flavour import legacy_requested

_installed = []
_scratch = {}


def install():
    """Wrap the Keras 3 callbacks; raises `TfdistError` if Keras moved them (never silent)."""
    if _installed:
        return
    try:
        from keras.src.callbacks.backup_and_restore import BackupAndRestore
        from keras.src.callbacks.model_checkpoint import ModelCheckpoint
        from keras.src.callbacks.tensorboard import TensorBoard
    except ImportError as e:
        import keras

        raise TfdistError(
            f"tfdist cannot install chief-only writes for Keras {keras.__version__}'s callbacks "
            f"({e}); without them every rank would write the same checkpoint files. tfdist "
            "supports the Keras 3 shipped with TensorFlow 2.21.") from e
    for cls, method in ((ModelCheckpoint, "_save_model"), (BackupAndRestore, "_save_model"),
                        (BackupAndRestore, "on_train_end"), (TensorBoard, "set_model")):
        if not callable(getattr(cls, method, None)):
            raise TfdistError(f"tfdist: Keras {cls.__name__} has no {method}(); cannot make its "
                              "writes chief-only under HorovodStrategy")
    ModelCheckpoint._save_model = _before(ModelCheckpoint._save_model, _checkpoint_to_scratch)
    BackupAndRestore._save_model = _chief_only(BackupAndRestore._save_model)
    BackupAndRestore.on_train_end = _chief_only(BackupAndRestore.on_train_end)
    TensorBoard.set_model = _before(TensorBoard.set_model, _log_to_scratch, model_arg=True)
    if "tf_keras" in sys.modules or legacy_requested():
        _install_tf_keras()
    _installed.append(True)


def _install_tf_keras():
    from tf_keras.src.callbacks import BackupAndRestore

    original = BackupAndRestore.on_train_begin

    @functools.wraps(original)
    def on_train_begin(self, logs=None):
        from tfdist.strategy import HorovodStrategy

        supported = getattr(self, "_supported_strategies", None)
        if supported is None:
            raise TfdistError("tfdist: tf-keras BackupAndRestore has no _supported_strategies; "
                              "cannot allow HorovodStrategy")
        if HorovodStrategy not in supported:
            self._supported_strategies = tuple(supported) + (HorovodStrategy,)
        return original(self, logs)

    BackupAndRestore.on_train_begin = on_train_begin


def non_chief_rank(model):
    """This rank's number if `model` trains under a multi-rank HorovodStrategy and it is not the chief."""
    from tfdist.strategy import HorovodStrategy

    strategy = getattr(model, "distribute_strategy", None)
    if isinstance(strategy, HorovodStrategy) and collectives.size() > 1 and collectives.rank() != 0:
        return collectives.rank()
    return None


def scratch_dir():
    """A private directory of this process, for files nobody will read."""
    if "dir" not in _scratch:
        _scratch["dir"] = tempfile.mkdtemp(prefix=f"tfdist-rank{collectives.rank()}-")
    return _scratch["dir"]


def _checkpoint_to_scratch(callback, model):
    if not getattr(callback, "_tfdist_redirected", False):
        callback.filepath = os.path.join(scratch_dir(), "checkpoint", os.path.basename(callback.filepath))
        callback._tfdist_redirected = True


def _log_to_scratch(callback, model):
    callback.log_dir = os.path.join(scratch_dir(), "tensorboard")


def _before(method, redirect, model_arg=False):
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        model = args[0] if model_arg else self.model
        if non_chief_rank(model) is not None:
            redirect(self, model)
        return method(self, *args, **kwargs)

    return wrapped


def _chief_only(method):
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        if non_chief_rank(self.model) is not None:
            return None
        return method(self, *args, **kwargs)

    return wrapped
