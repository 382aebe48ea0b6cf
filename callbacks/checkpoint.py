"""Checkpoint and resume: the chief saves atomically every N epochs; every rank resumes from it.

```python
import tfdist
from tfdist.callbacks import Checkpointer
from tfdist.pipelines import read_dataset

strategy = tfdist.HorovodStrategy()
checkpointer = Checkpointer("/scratch/run1/checkpoints", save_every_epochs=1, keep=2)
start = checkpointer.initial_epoch()          # 0, or the epoch after the latest good checkpoint
ds, plan = read_dataset("/scratch/ds", 64, training=True, seed=1, initial_epoch=start)
model.fit(ds, epochs=90, steps_per_epoch=plan.steps_per_epoch, callbacks=[checkpointer])
```

Run the same command again after a crash: `fit` restores the model weights, the optimizer
variables (its step counter, hence any learning-rate schedule's position, and its slots) and
continues with the epoch after the checkpoint, like Keras' `BackupAndRestore`.

A checkpoint is a directory `ckpt-<epoch>` holding `state.npz` (every model and optimizer
variable, by position) and `complete.json` (epoch, optimizer step, ranks, time, the state file's
size and SHA-256). The chief writes it into a `.tmp-*` directory beside it, fsyncs, writes the
marker last and renames the directory into place, so a crash while saving leaves only a `.tmp-*`
directory and the previous checkpoint stays the latest good one. A `ckpt-*` directory whose
marker is missing or corrupt, or whose state file does not match the marker, is skipped (a
warning names it) in favour of the next older one.

With gradient compression (`HorovodStrategy(compression="powersgd:4")`, ...) the checkpoint also
holds every rank's error-feedback state (`rank_state_*`, stacked by rank, gathered to the chief),
and each rank gets its own back, so a resumed run continues exactly.

Only the chief (rank 0) touches the directory: it picks the checkpoint, reads it and broadcasts
every value, so the other ranks need not see the files (multi-host jobs without a shared file
system) and all ranks end up bit-identical to the file. A restarted job needs rank 0 on a host
that can read the directory.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from tfdist.callbacks._keras import Callback
from tfdist import _compat, _compat_state, collectives, rank_variables
from tfdist.keras import sharded_saves
from tfdist.launch import recovery

if TYPE_CHECKING:
    import keras

    from tfdist.strategy import HorovodStrategy

log = logging.getLogger("tfdist")

from tfdist.callbacks.checkpoint_files import (  # noqa: F401  (this module's names since 0.1)
    MARKER_FILE,
    RANK_STATE,
    STATE_FILE,
    CheckpointError,
    checkpoint_problem,
    latest_checkpoint,
    prune_checkpoints,
    write_checkpoint,
)


# --- the model's state ------------------------------------------------------------------------

def training_variables(model: keras.Model) -> list[Any]:
    """Every variable a checkpoint holds, in a fixed order: the model's, then the optimizer's.

    The optimizer's include its step counter and slots (momentum, ...); tf-keras keeps a float
    learning rate outside `variables()`, so it is added (LearningRateWarmup changes it). A slot
    that `shard_optimizer_state=True` splits across ranks is seen whole (`sharded_saves.WholeSlot`).

    Args:
        model: the model (compiled, for its optimizer).

    Returns:
        The model's and optimizer's variables (Keras or `tf.Variable`s).
    """
    variables = list(model.weights)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        owned = optimizer.variables
        owned = list(owned() if callable(owned) else owned)
        rate = _compat.optimizer_learning_rate(optimizer)
        if isinstance(rate, tf.Variable) and not any(rate is v for v in owned):
            owned.append(rate)
        variables += [sharded_saves.whole_view(v) for v in owned]
    return variables


def _build_optimizer(model):
    """Create the optimizer's slots now (Keras builds them lazily), so they can be restored."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or _compat.optimizer_built(optimizer):
        return
    strategy = getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()
    with strategy.scope():
        optimizer.build(model.trainable_variables)


def _describe(value):
    return f"{np.dtype(value.dtype).name}{list(value.shape)}"


def _placeholder(variable):
    """Zeros of `variable`'s (whole) shape and dtype, read without a collective."""
    dtype = getattr(variable.dtype, "as_numpy_dtype", variable.dtype)
    return np.zeros(tuple(variable.shape), np.dtype(dtype))


def _incompatibility(variables, arrays, path):
    if len(variables) != len(arrays):
        return (f"checkpoint {path} holds {len(arrays)} variables, the model and optimizer have "
                f"{len(variables)}: it was saved from a different model or optimizer")
    for i, (variable, saved) in enumerate(zip(variables, arrays)):
        mine = _placeholder(variable)
        if mine.shape != saved.shape or mine.dtype != saved.dtype:
            return (f"checkpoint {path}: variable #{i} ({getattr(variable, 'path', variable.name)}) "
                    f"is {_describe(mine)} here but {_describe(saved)} in the checkpoint")
    return None


# --- ranks --------------------------------------------------------------------------------------

def _topology(strategy):
    if strategy is not None:
        return strategy.rank, strategy.size
    return collectives.process_rank(), collectives.process_size()


# --- the callback -------------------------------------------------------------------------------

class Checkpointer(Callback):
    """Save on the chief every `save_every_epochs` epochs (and after the last); resume on every rank.

    Every rank must call `initial_epoch()` (if at all) and `fit` together: restoring is a
    collective. Put `LearningRateWarmup` before this callback in the list, so it reads its
    target rate before the checkpoint's (mid-warmup) rate is restored.

    Args:
        directory: where checkpoints go (`ckpt-<epoch>` directories); the chief creates it.
        strategy: a `tfdist.HorovodStrategy` for the rank and size; default: Horovod's own
            (if initialised), else one process.
        save_every_epochs: save after every N-th epoch (and after the last epoch of `fit`).
        keep: how many finished checkpoints to keep (older ones are deleted after a save).

    Raises:
        ValueError: `save_every_epochs` or `keep` is below 1.

    Example:
        ```python
        from tfdist.callbacks import Checkpointer
        checkpointer = Checkpointer("/scratch/run1/checkpoints", save_every_epochs=1, keep=2)
        model.fit(ds, epochs=90, callbacks=[checkpointer])   # run again after a crash: it resumes
        ```
    """

    def __init__(self, directory: str | os.PathLike[str], strategy: HorovodStrategy | None = None,
                 save_every_epochs: int = 1, keep: int = 2):
        super().__init__()
        if save_every_epochs < 1 or keep < 1:
            raise ValueError(f"save_every_epochs={save_every_epochs}, keep={keep}: both must be >= 1")
        self.directory = os.fspath(directory)
        self.save_every_epochs = int(save_every_epochs)
        self.keep = int(keep)
        self.strategy = strategy
        self.restored_from = None  # the checkpoint the last fit resumed from (chief: path)
        self._choice = None
        self._arrays = None
        self._rank_arrays = []
        self._saved_at = None  # (epoch, batches done, chief: path) of this callback's last save, every rank

    @property
    def _rank_size(self):
        return _topology(self.strategy)

    def initial_epoch(self) -> int:
        """The epoch `fit` will start at: 0, or the one after the latest good checkpoint.

        The chief decides and tells the other ranks, so all agree. Pass it to the input
        pipeline (`read_dataset(..., initial_epoch=...)`) so the resumed epochs read what they
        would have read without the interruption.

        Returns:
            The number of epochs the latest good checkpoint finished (0 without one).

        Raises:
            CheckpointError: the chief could not read the checkpoints (on every rank).
        """
        return self._choose()["epoch"]

    def _choose(self):
        if self._choice is None:
            rank, size = self._rank_size
            choice = {"epoch": 0, "path": None, "error": None}
            if rank == 0:
                try:
                    found = latest_checkpoint(self.directory)
                    if found is not None:
                        path, marker = found
                        with np.load(os.path.join(path, STATE_FILE)) as state:
                            keys = sorted(state.files)
                            self._arrays = [state[k] for k in keys if not k.startswith(RANK_STATE)]
                            self._rank_arrays = [state[k] for k in keys if k.startswith(RANK_STATE)]
                        choice.update(epoch=int(marker["epoch"]), path=path, step=marker.get("step"),
                                      batches_done=int(marker.get("batches_done", 0)))
                except Exception as e:  # noqa: BLE001 - every rank must learn of it, not hang
                    choice["error"] = f"reading checkpoints in {self.directory} failed: {type(e).__name__}: {e}"
            self._choice = collectives.broadcast_object(choice, name="tfdist.ckpt.choice")
        if self._choice["error"]:
            raise CheckpointError(self._choice["error"])
        return self._choice

    def on_train_begin(self, logs=None):
        choice, arrays = self._choose(), self._arrays
        self._choice = self._arrays = None  # a later fit decides afresh
        self.restored_from = choice["path"]
        if choice["path"] is None:
            log.info("tfdist checkpoint: none in %s; starting from scratch", self.directory)
            return
        rank, size = self._rank_size
        _build_optimizer(self.model)
        variables = training_variables(self.model)
        problem = _incompatibility(variables, arrays, choice["path"]) if rank == 0 else None
        problem = collectives.broadcast_object(problem, name="tfdist.ckpt.check")
        if problem:
            raise CheckpointError(problem)
        for i, variable in enumerate(variables):
            value = arrays[i] if rank == 0 else _placeholder(variable)
            if size > 1:
                value = collectives.broadcast(tf.constant(value), 0, name=f"tfdist.ckpt.{i}")
            variable.assign(value)
        self._restore_rank_state(choice["path"])
        batches_done = choice.get("batches_done", 0)
        _compat_state.set_resume_epoch(self.model, choice["epoch"], batches_done)
        if rank == 0:  # every rank holds the same state now: one line for the job
            log.warning("tfdist checkpoint: resumed %d rank(s) from %s (optimizer step %s); continuing at epoch %d%s",
                        size, choice["path"], choice.get("step"), choice["epoch"],
                        f", after its first {batches_done} batches" if batches_done else "")

    def on_epoch_end(self, epoch, logs=None):
        done = epoch + 1
        if done % self.save_every_epochs and done != self.params.get("epochs"):
            return
        loss = (logs or {}).get("loss")
        if loss is not None and not np.all(np.isfinite(loss)):
            # e.g. StopOnNonFiniteLoss ended the epoch: keep the last good checkpoint the latest
            if self._rank_size[0] == 0:  # the loss is global: the same on every rank
                log.warning("tfdist checkpoint: epoch %d ended with loss %s; not saved", done, loss)
            return
        with sharded_saves.gathered_for_save(self.model):  # collectives, every rank: before the chief-only save
            rank_state = self._gathered_rank_state()
            path = self.save(done, rank_state) if self._rank_size[0] == 0 else None
        self._saved_at = (done, 0, path)  # on every rank: save_on_preemption's choice must agree

    def save_on_preemption(self, epoch: int, batches_done: int) -> str | None:
        """Save now, mid-epoch, for a graceful stop (`tfdist.keras.preemption`); every rank calls it.

        Args:
            epoch: the epoch in progress (0-based), which is also the number of finished epochs.
            batches_done: its batches already trained; a resumed `fit` skips their data.

        Returns:
            The checkpoint's path on the chief, None on the other ranks.
        """
        if self._saved_at and self._saved_at[:2] == (epoch, batches_done):
            return self._saved_at[2]  # an epoch's end this callback has just saved itself
        with sharded_saves.gathered_for_save(self.model):
            rank_state = self._gathered_rank_state()
            path = self.save(epoch, rank_state, batches_done) if self._rank_size[0] == 0 else None
        self._saved_at = (epoch, batches_done, path)
        return path

    def save(self, epoch: int, rank_state: dict[str, np.ndarray] | None = None, batches_done: int = 0) -> str:
        """Write checkpoint `ckpt-<epoch>` (`epoch` epochs finished) now, then prune; chief only.

        Args:
            epoch: the number of finished epochs.
            rank_state: every rank's gradient-compression state, as `on_epoch_end` gathers it.
            batches_done: batches of epoch `epoch` already trained (`ckpt-<epoch>-<batches_done>`).

        Returns:
            The checkpoint's path.
        """
        variables = training_variables(self.model)
        with rank_variables.local_reads():  # chief only: no collective (on-read state: its own value)
            arrays = {f"v{i:05d}": np.asarray(v) for i, v in enumerate(variables)}
        arrays.update(rank_state or {})
        optimizer = getattr(self.model, "optimizer", None)
        step = int(np.asarray(optimizer.iterations)) if optimizer is not None else None
        path = write_checkpoint(self.directory, epoch, arrays,
                                {"step": step, "ranks": self._rank_size[1], "variables": len(variables)},
                                batches_done)
        prune_checkpoints(self.directory, self.keep)
        recovery.report_progress(epoch, path, step)  # for tfdist-run --max-restarts; no-op otherwise
        log.info("tfdist checkpoint: saved %s", path)
        return path

    def _compressor(self):
        strategy = self.strategy or getattr(self.model, "distribute_strategy", None)
        return getattr(strategy, "compressor", None)

    def _gathered_rank_state(self):
        """{key: every rank's value stacked} of the gradient compressor's state; every rank calls it."""
        compressor = self._compressor()
        if compressor is None:
            return {}
        size = self._rank_size[1]
        gathered = {}
        for i, variable in enumerate(compressor.state_variables()):
            value = tf.convert_to_tensor(variable)[None]
            if size > 1:
                value = collectives.allgather(value, name=f"tfdist.ckpt.rank_state.{i}")
            gathered[f"{RANK_STATE}{i:05d}"] = value.numpy()
        return gathered

    def _restore_rank_state(self, path):
        """Give each rank its own part of the checkpoint's compression state (chief broadcasts)."""
        compressor = self._compressor()
        if compressor is None:
            return
        rank, size = self._rank_size
        layout = [(list(a.shape), a.dtype.str) for a in self._rank_arrays] if rank == 0 else None
        layout = collectives.broadcast_object(layout, name="tfdist.ckpt.rank_state")
        saved_ranks = {shape[0] for shape, _ in layout}
        if saved_ranks and saved_ranks != {size}:
            if rank == 0:
                log.warning("tfdist checkpoint: %s holds gradient-compression state of %s rank(s), this job has %d: "
                            "the error-feedback memories start empty", path, sorted(saved_ranks)[0], size)
            return
        mine, arrays, self._rank_arrays = [], self._rank_arrays, []
        for i, (shape, dtype) in enumerate(layout):
            value = arrays[i] if rank == 0 else np.zeros(shape, dtype)
            if size > 1:
                value = collectives.broadcast(tf.constant(value), 0, name=f"tfdist.ckpt.rank_state.{i}").numpy()
            mine.append(value[rank])
        try:
            compressor.restore(mine)
        except ValueError as e:
            raise CheckpointError(f"checkpoint {path}: {e}") from None

    def on_train_end(self, logs=None):
        # Resuming applies to the fit that restored; a later fit on this model starts as asked.
        _compat_state.clear_resume_epoch(self.model, restored=self.restored_from is not None)
