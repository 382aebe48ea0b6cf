"""Graceful preemption in Keras `fit`: every rank stops after one agreed step, saves, exits 75.

Installed by `HorovodStrategy()`, in every `fit` of a model under it (`tfdist.keras.fit_callbacks`):

- a SIGTERM or SIGUSR1 to any rank (or to all, as `srun` and `scancel` send it) stops every rank
  after the same step (`tfdist.faults.preemption.StepAgreement`), never after an epoch's last step (the
  epoch's end, validation and epoch-end saves run first);
- there the job's own checkpointing saves: Keras' `BackupAndRestore` (any `save_freq`, both
  flavours), `tfdist.callbacks.Checkpointer`, `ModelCheckpoint` (by its own rules), and any
  callback with a `save_on_preemption(epoch, batches_done)` method; with none of them one line
  says that nothing could be saved;
- every rank exits with code 75 ("preempted, resumable").

Run again, `fit` continues where it stopped: the restored epoch's first batches are read but not
trained (so the data order is the uninterrupted run's), on Keras 3 and tf-keras, and the
callbacks see only the batches trained, with their indices in the epoch (as tf-keras' own loop,
which starts at the resumed step):

```python
backup = keras.callbacks.BackupAndRestore("/scratch/run1/backup")   # save_freq="epoch" is enough
model.fit(ds, epochs=90, callbacks=[backup])   # SIGTERM: stops at a step, saves it, exits 75
```

BackupAndRestore's own backup records the position: Keras 3's `training_metadata.json` gets
`tfdist_batches_done` beside its epoch, tf-keras' checkpoint its epoch and last batch.
"""

from __future__ import annotations

import logging
import math

from tfdist import _compat, _compat_state, collectives
from tfdist.faults import preemption
from tfdist.keras import fit_callbacks

log = logging.getLogger("tfdist")

HOOK = "preemption checkpoints"
READ_ONLY_BATCHES = "_tfdist_read_only_batches"  # model attribute: the resumed epoch's batches only read

_installed = []


def install():
    """Add the preemption callbacks to every tfdist fit; wrap BackupAndRestore's saves to record
    their position. Raises `KerasHookError` if Keras moved what is wrapped."""
    if _installed:
        return
    _, backup, *_ = _compat.keras3_callback_classes(HOOK)
    _compat.patch_method(backup, _compat.KERAS3_SAVE_MODEL, _recording_position, HOOK)
    callback_list = _keras3_callback_list()
    for method in ("on_train_batch_begin", "on_train_batch_end"):
        _compat.patch_method(callback_list, method, _hiding_read_only_batches, HOOK)
    if _compat.tf_keras_in_use():
        legacy_backup = _compat.tf_keras_callback_class("BackupAndRestore", HOOK)
        _compat.patch_method(legacy_backup, _compat.TF_KERAS_BACKUP, _recording_position, HOOK, "tf_keras")
    fit_callbacks.register("first", lambda model: _Position())
    fit_callbacks.register("last", lambda model: _Stop())
    _installed.append(True)


def _keras3_callback_list():
    import keras

    return keras.callbacks.CallbackList


def _hiding_read_only_batches(method):
    """Keras 3's CallbackList: a resumed epoch's first batches, read and not trained, reach no callback."""

    def wrapped(self, batch, logs=None):
        if batch < getattr(getattr(self, "_model", None), READ_ONLY_BATCHES, 0):
            return None
        return method(self, batch, logs)

    return wrapped


def _base():
    from tfdist.keras.flavour import keras_module

    return keras_module().callbacks.Callback


def _position_of(model):
    return getattr(model, "_tfdist_position", None)


class _PositionTracker:
    """Where the running fit is: epoch, batches of it trained, train_function calls in all (the
    same on every rank: the step count the ranks agree on)."""

    def on_train_begin(self, logs=None):
        self.epoch, self.batches_done, self.calls = 0, 0, 0
        self.model._tfdist_position = self
        setattr(self.model, READ_ONLY_BATCHES, 0)  # a fit that raised while reading left it set

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch, self.batches_done = epoch, 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches_done = batch + 1  # the last batch of this call (steps_per_execution)
        self.calls += 1

    def on_epoch_end(self, epoch, logs=None):
        self.epoch, self.batches_done = epoch + 1, 0

    def on_train_end(self, logs=None):
        if getattr(self.model, "_tfdist_position", None) is self:
            del self.model._tfdist_position


def _Position():
    return type("TfdistFitPosition", (_PositionTracker, _base()), {})()


class _StopAtAgreedStep:
    """Resumes mid-epoch, agrees on the stop step across ranks, saves there and exits."""

    fit_callbacks = ()  # every callback of this fit (set by tfdist.keras.fit_callbacks)

    def on_train_begin(self, logs=None):
        self._skip = _resume_position(self.model, self.fit_callbacks, (self.params or {}).get("steps"))
        if self._skip:
            _skip_trained_batches(self.model, self._skip)
        self.agreement = preemption.StepAgreement()
        self._stop_at_epoch_end = False

    def on_train_batch_end(self, batch, logs=None):
        position = _position_of(self.model)
        if position is None or not self.agreement.stop_after(position.calls, self._ends_epoch):
            return
        if self.agreement.at_epoch_end:
            self._stop_at_epoch_end = True  # the epoch's end (validation, its saves) runs first
            return
        self._stop(position, logs, f"after epoch {position.epoch + 1}, batch {position.batches_done}")

    def on_epoch_end(self, epoch, logs=None):
        position = _position_of(self.model)
        if self._stop_at_epoch_end and position is not None:
            self._stop(position, logs, f"at the end of epoch {epoch + 1}")

    def _stop(self, position, logs, where):
        # the signals stay caught while every rank saves; exit_preempted then ignores them to the end
        saved = _save_everything(self.model, self.fit_callbacks, position, logs)
        if saved:
            what = f"saved {where} by {'; '.join(saved)}"
        else:
            what = (f"nothing could be saved {where}: this fit has no BackupAndRestore, ModelCheckpoint "
                    "or tfdist Checkpointer, so a new run starts from the beginning")
        preemption.exit_preempted(what, saved=bool(saved))

    def _ends_epoch(self, calls):
        """Whether train_function call number `calls` (of this fit) ends an epoch."""
        position = _position_of(self.model)
        steps = (self.params or {}).get("steps")
        if position is None or not steps:
            return False
        per_call = max(int(getattr(self.model, "steps_per_execution", 1) or 1), 1)
        calls_per_epoch = math.ceil(steps / per_call)
        in_epoch = math.ceil(position.batches_done / per_call) + (calls - position.calls)
        return in_epoch > 0 and in_epoch % calls_per_epoch == 0

    def after_fit(self):
        agreement = getattr(self, "agreement", None)
        if agreement is not None:
            agreement.close()  # the signals' own handlers back, also after a fit that raised

    def on_train_end(self, logs=None):
        self.agreement.close()


def _Stop():
    return type("TfdistPreemptionStop", (_StopAtAgreedStep, _base()), {})()


# --- saving at the stop --------------------------------------------------------------------------

def _backup_classes():
    classes = [_compat.keras3_callback_classes(HOOK)[1]]
    if _compat.tf_keras_in_use():
        classes.append(_compat.tf_keras_callback_class("BackupAndRestore", HOOK))
    return tuple(classes)


def _checkpoint_classes():
    classes = [_compat.keras3_callback_classes(HOOK)[0]]
    if _compat.tf_keras_in_use():
        classes.append(_compat.tf_keras_callback_class("ModelCheckpoint", HOOK))
    return tuple(classes)


def _save_everything(model, callbacks, position, logs):
    """Every checkpointing callback of the fit saves the state after this step; what each wrote."""
    saved = []
    for callback in callbacks:
        if isinstance(callback, _backup_classes()):
            if hasattr(callback, _compat.TF_KERAS_BACKUP):  # tf-keras
                getattr(callback, _compat.TF_KERAS_BACKUP)(epoch=position.epoch, batch=position.batches_done - 1)
            else:
                getattr(callback, _compat.KERAS3_SAVE_MODEL)()
            saved.append(f"BackupAndRestore ({callback.backup_dir})")
        elif isinstance(callback, _checkpoint_classes()):
            at_epoch_end = position.batches_done == 0  # as Keras saves at an epoch's end
            getattr(callback, _compat.KERAS3_SAVE_MODEL)(
                epoch=position.epoch - 1 if at_epoch_end else position.epoch,
                batch=None if at_epoch_end else position.batches_done - 1, logs=dict(logs or {}))
            saved.append(f"ModelCheckpoint ({callback.filepath})")
        elif callable(getattr(callback, "save_on_preemption", None)):
            path = callback.save_on_preemption(position.epoch, position.batches_done)
            saved.append(f"{type(callback).__name__} ({path or getattr(callback, 'directory', '')})")
    return saved


def _recording_position(method):
    """BackupAndRestore's save with the fit's position in Keras' own backup: Keras 3's metadata
    gets the epoch in progress (it kept 0 after a resume) and the batches done of it; tf-keras'
    checkpoint the epoch and last batch (its step count at the start of a call is wrong with
    steps_per_execution). No save while a resumed epoch's first batches are only read."""

    def save(self, *args, **kwargs):
        position = _position_of(self.model)
        if position is None:
            return method(self, *args, **kwargs)
        if getattr(self.model, _compat_state.RESUME_BATCHES, 0) > position.batches_done and position.batches_done:
            return None  # the restored weights are those after RESUME_BATCHES batches
        if hasattr(self, "_training_metadata_path"):  # Keras 3
            self._current_epoch = position.epoch
            result = method(self, *args, **kwargs)
            if collectives.process_rank() == 0:
                _compat_state.add_backup_metadata(self, {_compat_state.BACKUP_BATCHES_KEY: position.batches_done})
            return result
        steps = (self.params or {}).get("steps")
        if position.batches_done or steps:  # tf-keras: an epoch's end is its last batch
            _compat_state.set_tf_keras_backup_position(
                self, position.epoch if position.batches_done else position.epoch - 1,
                position.batches_done - 1 if position.batches_done else steps - 1)
        return method(self, *args, **kwargs)

    save.__name__ = method.__name__
    return save


# --- resuming --------------------------------------------------------------------------------------

def _resume_position(model, callbacks, steps):
    """Batches of the first epoch to skip: a Checkpointer's (already set on the model), or the
    position a restored BackupAndRestore holds; 0 when this fit starts at an epoch's start."""
    backups = [c for c in callbacks if isinstance(c, _backup_classes())]
    position = _compat_state.backup_position(backups[0], steps) if backups else None
    if position and position[1]:
        _compat_state.set_resume_epoch(model, *position)
        if collectives.process_rank() == 0:
            log.warning("%s resuming at epoch %d after its first %d batches (%s)", preemption.MARK,
                        position[0] + 1, position[1], backups[0].backup_dir)
    return int(getattr(model, _compat_state.RESUME_BATCHES, 0) or 0)


def _skip_trained_batches(model, count):
    """Make the resumed epoch read, without training, the data of its first `count` batches."""
    original = model.train_function
    per_call = max(int(getattr(model, "steps_per_execution", 1) or 1), 1)
    legacy = _compat_state.loop_starts_at_resume_step(model)
    remaining = [count]
    if not legacy:  # Keras 3 calls the callbacks for these batches too: they are hidden from them
        setattr(model, READ_ONLY_BATCHES, count)

    def read_only(iterator):
        if legacy:  # tf-keras starts its step count at `count`: read them all, then train
            for _ in range(remaining[0]):
                next(iterator)
            remaining[0] = 0
        if remaining[0] <= 0:
            model.train_function = original
            setattr(model, _compat_state.RESUME_BATCHES, 0)
            setattr(model, READ_ONLY_BATCHES, 0)
            return original(iterator)
        for _ in range(min(per_call, remaining[0])):
            next(iterator)
        remaining[0] -= per_call
        return {}

    model.train_function = read_only
