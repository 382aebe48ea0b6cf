"""Saving and loading sharded optimizer state whole, so any rank count (or one process) reads it.

Under `HorovodStrategy(shard_optimizer_state=True)` each rank holds a slice of every optimizer
slot. A save first all-gathers every slot on every rank (`gathered_for_save()`: the saving
wrappers of `tfdist.keras.chief_saves`, `BackupAndRestore` and `callbacks.Checkpointer` open it
on every rank, before the chief writes), and what Keras or TensorFlow then writes is each
slot's whole value (`whole_value`), in an unsharded job's format. Loading gives each rank its
slice of the whole value (`slice_for_load`).

```python
from tfdist.keras import sharded_saves
with sharded_saves.gathered_for_save(model):   # every rank: a collective
    if strategy.is_chief:
        model.save("model.keras")          # the whole optimizer state
```

A save that holds sharded state is therefore a collective: every rank must make it (as
`ModelCheckpoint`, `BackupAndRestore`, `Checkpointer` and preemption do). A save only the chief
makes waits in the gather until the hang detector names it (`allgather
'tfdist.sharded_state_save...'`); inside `chief_only_saves()` it raises `ShardedStateError`.
"""

from __future__ import annotations

import contextlib

import numpy as np
import tensorflow as tf

from tfdist import collectives
from tfdist.errors import ShardedStateError
from tfdist.exchange import sharded

_cache = {}  # id(slot) -> (slot, whole value as numpy), while gathered_for_save() is open
_depth = [0]


@contextlib.contextmanager
def gathered_for_save(*roots, gather=True):
    """Inside, the whole value of every sharded slot of the optimizers `roots` reach (models,
    optimizers, `tf.train.Checkpoint`s, `CheckpointManager`s) is known: an allgather per slot,
    on every rank, in the same order (what the roots reach is the same on every rank). With
    `gather=False` (a save the chief makes alone) nothing is gathered, and a sharded slot's
    whole value is asked for in vain (`whole_value` raises)."""
    states = [] if _depth[0] or not gather else _states_in(roots)
    _depth[0] += 1
    try:
        slots = [pair for state in states for pair in state.slot_slices.values()]
        if slots:
            _check_same_slots(slots)
        for i, (slot, variable_slice) in enumerate(slots):
            gathered = collectives.allgather(tf.convert_to_tensor(slot), name=f"tfdist.sharded_state_save.{i}",
                                             scope="tfdist_sharded_save")
            _cache[id(slot)] = (slot, variable_slice.whole(gathered).numpy())
        yield
    finally:
        _depth[0] -= 1
        if not _depth[0]:
            _cache.clear()


def refuse_hdf5(roots):
    """Raise `ShardedStateError` when a legacy HDF5 model file would hold sharded optimizer state
    (Keras writes its slots there as they are in memory: this rank's slices)."""
    if any(state.slot_slices for state in _states_in(roots)):
        raise ShardedStateError(
            "tfdist: an HDF5 model file (.h5) holds the optimizer's variables as each rank keeps them, and "
            "with HorovodStrategy(shard_optimizer_state=True) those are slices. Save the model as .keras "
            "(or its weights as .weights.h5 or a TensorFlow checkpoint), which hold the whole state, or "
            "pass include_optimizer=False.")


def _states_in(roots):
    """The ShardedStates of the optimizers reachable from `roots`, in a fixed order, each once."""
    found, seen = [], set()

    def visit(obj, depth):
        if obj is None or id(obj) in seen or depth > 4:
            return
        seen.add(id(obj))
        state = sharded.state_of(obj)
        if state is not None:
            found.append(state)
        children = [getattr(obj, name, None) for name in ("optimizer", "inner_optimizer", "checkpoint", "model")]
        if isinstance(obj, tf.train.Checkpoint):  # its keyword arguments are its attributes
            children += [value for name, value in vars(obj).items() if not name.startswith("_")]
        for child in children:
            visit(child, depth + 1)

    for root in roots:
        visit(root, 0)
    return found


def _check_same_slots(slots):
    """Every rank is about to gather the same slots (else the gathers would pair different ones)."""
    mine = [len(slots), sum(s.elements for _, s in slots)]
    rows = collectives.allgather(tf.constant([mine], tf.int64), name="tfdist.sharded_state_save.check",
                                 scope="tfdist_sharded_save").numpy()
    if not (rows == rows[0]).all():
        raise ShardedStateError(
            f"tfdist: ranks save different sharded optimizer state (slots, elements per rank: "
            f"{rows.tolist()}): every rank must save the same model and optimizer together")


def slice_of(variable):
    """The `sharded.VariableSlice` a sharded optimizer slot holds a slice of, or None."""
    for _, state in sharded.all_states():
        found = state.slot_slice(variable)
        if found is not None:
            return found
    return None


def whole_value(variable, required=None):
    """The whole value of a sharded slot (numpy) for a save, or None when `variable` is whole.

    Raises `ShardedStateError` when the slot is sharded and a save is in progress
    (`gathered_for_save`) that did not gather it; outside a save (TensorFlow restoring asks for
    the tensors too) returns None. `required`: True or False instead of "in a save".
    """
    if slice_of(variable) is None:
        return None
    cached = _cache.get(id(variable))
    if (cached is None or cached[0] is not variable) and not (_depth[0] > 0 if required is None else required):
        return None
    if cached is None or cached[0] is not variable:
        raise ShardedStateError(
            f"tfdist: rank {collectives.rank()}: this save holds optimizer state that "
            "HorovodStrategy(shard_optimizer_state=True) spreads over the ranks, and it was made without "
            "the other ranks: every rank must make a save that holds the optimizer (model.save, "
            "save_weights, tf.train.Checkpoint), as ModelCheckpoint, BackupAndRestore and "
            "tfdist.callbacks.Checkpointer do. Call it on every rank (the chief writes the file), not "
            "under `if rank == 0` or chief_only_saves(); or save the model without its optimizer.")
    return cached[1]


def slice_for_load(variable, value):
    """What a sharded slot loads from a saved whole `value`: this rank's slice; None when whole."""
    variable_slice = slice_of(variable)
    if variable_slice is None:
        return None
    value = np.asarray(value)
    if value.size != variable_slice.elements:
        raise ShardedStateError(
            f"tfdist: the saved optimizer value for {variable_slice.path!r} has shape {list(value.shape)}, "
            f"the variable {variable_slice.shape.as_list()}: it was saved from another model")
    return variable_slice.take(value.astype(variable_slice.dtype.as_numpy_dtype)).numpy()


def saveable_factories(variable):
    """TensorFlow checkpoint saveables for a sharded slot that is a `tf.Variable` (tf-keras): the
    whole value saved, this rank's slice restored. None for any other variable."""
    variable_slice = slice_of(variable)
    if variable_slice is None:
        return None
    from tfdist import _compat

    class WholeValueSaveable(_compat.saveable_object.SaveableObject):
        def __init__(self, name):
            whole = whole_value(variable)
            tensor = tf.convert_to_tensor(variable if whole is None else whole)
            super().__init__(tensor, [_compat.saveable_object.SaveSpec(tensor, "", name)], name)

        def restore(self, restored_tensors, restored_shapes):
            return _compat.distributed_values_util.get_on_write_restore_ops(
                variable, variable_slice.take(restored_tensors[0]))

    return {"VARIABLE_VALUE": WholeValueSaveable}


class WholeSlot:
    """A sharded slot seen whole (for `callbacks.Checkpointer`): its whole shape and dtype, its whole
    value inside `gathered_for_save()`, and `assign(whole)` that keeps this rank's slice."""

    def __init__(self, slot, variable_slice):
        self.slot, self.slice = slot, variable_slice
        self.shape = tuple(variable_slice.shape.as_list())
        self.dtype = variable_slice.dtype
        self.path = self.name = getattr(slot, "path", None) or slot.name

    def __array__(self, dtype=None, copy=None):
        value = whole_value(self.slot, required=True)
        return value if dtype is None else value.astype(dtype)

    def assign(self, value):
        self.slot.assign(self.slice.take(value))


def whole_view(variable):
    """`variable` itself, or a `WholeSlot` of it when it is a sharded optimizer slot."""
    variable_slice = slice_of(variable)
    return variable if variable_slice is None else WholeSlot(variable, variable_slice)
