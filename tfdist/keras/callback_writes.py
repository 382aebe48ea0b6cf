"""Chief-only writes for Keras 3's file-writing callbacks under `HorovodStrategy`.

tf-keras already routes `ModelCheckpoint`, `BackupAndRestore` and `TensorBoard` writes of
non-chief workers to throw-away directories (through `strategy.extended.should_checkpoint` and
`_task_id`, which `HorovodStrategy` provides); its `BackupAndRestore` only needs to be told that
`HorovodStrategy` is one of the strategies it supports. Keras 3's callbacks know nothing of strategies, so
every rank would write the same files at the same time. Installed by `HorovodStrategy()`, this
gives Keras 3, on ranks other than 0:

- `TensorBoard` and `CSVLogger` write under a private temporary directory of the rank (every
  rank sees the same global logs; N ranks appending to one CSV wrote each line N times);
- `BackupAndRestore` restores from the shared backup on every rank (so all ranks resume alike)
  but only the chief writes or deletes it;
- `ModelCheckpoint` saves through `Model.save` / `save_weights`, which `tfdist.keras.chief_saves`
  handles as every save: the chief's path is written by the chief alone (another rank writes its
  copy under its temporary directory), a path of the rank's own (a per-process temporary
  directory, as Keras' own tests write) is written as asked and can be loaded right after.
  Its folder is made before Keras looks for it: Keras makes it when `exists()` says it is
  missing, and with every rank looking at once one of them lost that race (`FileExistsError`)
  and left the fit alone while the others waited for it.

`EarlyStopping` and the other callbacks need nothing: they see the same global logs on every
rank, so they take the same decisions. Models under other strategies are untouched.
"""

import functools
import os

from tfdist import _compat
from tfdist.keras import recognise, sharded_saves
from tfdist.keras.chief_saves import chief_only_saves
from tfdist.keras.recognise import non_chief_rank, scratch_dir  # noqa: F401  (used by the wrappers)

HOOK = "chief-only callback writes"

_installed = []
_scratch = {}


def install():
    """Wrap the Keras 3 callbacks; raises `KerasHookError` if Keras moved them (never silent)."""
    if _installed:
        return
    ModelCheckpoint, BackupAndRestore, TensorBoard, CSVLogger = _compat.keras3_callback_classes(HOOK)
    save_model = _compat.KERAS3_SAVE_MODEL
    for cls, methods in ((ModelCheckpoint, [save_model, _compat.KERAS3_CHECKPOINT_PATH]),
                         (BackupAndRestore, [save_model, "on_train_end"]), (TensorBoard, ["set_model"]),
                         (CSVLogger, ["on_train_begin"])):
        _compat.require_methods(cls, methods, HOOK)  # all checked before any is patched
    if _compat.tf_keras_in_use():
        tf_keras_backup = _compat.tf_keras_callback_class("BackupAndRestore", HOOK)
        tf_keras_csv = _compat.tf_keras_callback_class("CSVLogger", HOOK)
        _compat.require_methods(tf_keras_backup, ["on_train_begin"], HOOK, "tf_keras")
        _compat.require_methods(tf_keras_csv, ["on_train_begin"], HOOK, "tf_keras")
    _compat.patch_method(ModelCheckpoint, save_model, _folder_first, HOOK)
    _compat.patch_method(BackupAndRestore, save_model, lambda m: _gathered_first(_chief_only(m)), HOOK)
    _compat.patch_method(BackupAndRestore, "on_train_end", _chief_only, HOOK)
    _compat.patch_method(TensorBoard, "set_model", lambda m: _before(m, _log_to_scratch, model_arg=True), HOOK)
    _compat.patch_method(CSVLogger, "on_train_begin", lambda m: _before(m, _csv_to_scratch), HOOK)
    if _compat.tf_keras_in_use():
        _compat.patch_method(tf_keras_backup, "on_train_begin", _allow_horovod_strategy, HOOK, "tf_keras")
        _compat.patch_method(tf_keras_csv, "on_train_begin", lambda m: _before(m, _csv_to_scratch), HOOK, "tf_keras")
    _installed.append(True)


def _allow_horovod_strategy(original):
    # tf-keras' BackupAndRestore refuses strategies it does not know: add HorovodStrategy.
    @functools.wraps(original)
    def on_train_begin(self, logs=None):
        supported = getattr(self, _compat.TF_KERAS_SUPPORTED_STRATEGIES, None)
        if supported is None:
            raise _compat.hook_error(HOOK, f"tf-keras BackupAndRestore has no {_compat.TF_KERAS_SUPPORTED_STRATEGIES}; "
                                     "cannot allow HorovodStrategy", "tf_keras")
        missing = tuple(c for c in recognise.strategy_classes() if c not in supported)
        if missing:
            setattr(self, _compat.TF_KERAS_SUPPORTED_STRATEGIES, tuple(supported) + missing)
        return original(self, logs)

    return on_train_begin


def _log_to_scratch(callback, model):
    callback.log_dir = os.path.join(scratch_dir(), "tensorboard")


def _csv_to_scratch(callback, model):
    callback.filename = os.path.join(scratch_dir(), "csv", os.path.basename(callback.filename) or "log.csv")
    os.makedirs(os.path.dirname(callback.filename), exist_ok=True)


def _before(method, redirect, model_arg=False):
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        model = args[0] if model_arg else self.model
        if non_chief_rank(model) is not None:
            redirect(self, model)
        return method(self, *args, **kwargs)

    return wrapped


def _gathered_first(method):
    # Every rank gathers sharded optimizer state (a collective) before the chief saves it whole.
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        with sharded_saves.gathered_for_save(self.model):
            return method(self, *args, **kwargs)

    return wrapped


def _folder_first(method):
    @functools.wraps(method)
    def wrapped(self, epoch, batch=None, logs=None):
        if recognise.multi_rank_strategy_of(self.model) is not None:
            try:
                path = getattr(self, _compat.KERAS3_CHECKPOINT_PATH)(epoch, batch, logs or {})
            except Exception:  # noqa: BLE001  (Keras raises its own error for a bad path)
                path = None
            folder = os.path.dirname(path) if isinstance(path, str) and "://" not in path else ""
            if folder:
                os.makedirs(folder, exist_ok=True)
        return method(self, epoch=epoch, batch=batch, logs=logs)

    return wrapped


def _chief_only(method):
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        if non_chief_rank(self.model) is not None:
            return None
        with chief_only_saves():  # the others make no such save: it must not shift their numbering
            return method(self, *args, **kwargs)

    return wrapped
