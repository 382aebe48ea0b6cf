"""Variables that aggregate across ranks, as MultiWorkerMirroredStrategy's do.

`HorovodStrategy` creates its variables as MultiWorkerMirroredStrategy does with one replica per
worker: TensorFlow's own distributed variable classes with one component (this rank's), starting
from rank 0's value:

- `synchronization=ON_WRITE` or `AUTO` (weights, optimizer slots): a `MirroredVariable`, whose
  `synchronization` reads ON_WRITE. The ranks keep it identical by applying the same all-reduced
  updates; with `aggregation=SUM` or `MEAN` an update made inside `strategy.run`
  (`v.assign_add(x)`) is all-reduced first, with NONE or ONLY_FIRST_REPLICA each rank applies its
  own (as each MWMS worker does with one replica).
- `synchronization=ON_READ` (Keras metrics, tf-keras BatchNormalization's moving statistics):
  each rank updates its own copy; a read in cross-replica context (outside `strategy.run`, e.g.
  `metric.result()` in a custom loop) returns the aggregate over ranks by the variable's
  aggregation (SUM, MEAN, ONLY_FIRST_REPLICA), one Horovod collective, so every rank must read.

`synchronization=NONE` (which MWMS refuses) and the variables a save creates stay plain.

Saving never needs a collective: inside `local_reads()` (which tfdist's save hooks enter) an
on-read variable reads this rank's own value, so the chief can save alone.
"""

import contextlib
import threading

_state = threading.local()


def reading_locally():
    """Whether on-read variables read this rank's own value now (inside `local_reads()`)."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def local_reads():
    """Within this block, cross-replica reads of on-read variables return the rank's own value."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def own(variable):
    """This rank's own `tf.Variable` behind `variable` (itself when it is not distributed)."""
    values = getattr(variable, "values", None)
    if isinstance(values, tuple) and len(values) == 1 and hasattr(variable, "_primary"):
        return values[0]
    return variable


def is_distributed_kind(synchronization, colocate_with=None):
    """Whether a variable created with these arguments is a distributed variable (see module):
    all but `synchronization=NONE` and those placed beside a dataset's values (numpy inputs)."""
    import tensorflow as tf

    from tfdist import _compat

    if isinstance(colocate_with, _compat.numpy_dataset.SingleDevice):
        return False
    return synchronization != tf.VariableSynchronization.NONE


def create(strategy, create_component, **kwargs):
    """A one-component `SyncOnReadVariable` (ON_READ) or `MirroredVariable` (ON_WRITE, AUTO).

    `create_component(**kwargs)` makes the rank's own variable, as the strategy places it.
    """
    import tensorflow as tf

    from tfdist import _compat

    classes = {
        tf.VariableSynchronization.ON_WRITE: _mirrored_class(),
        tf.VariableSynchronization.ON_READ: _sync_on_read_class(),
    }
    return _compat.distribute_utils.create_mirrored_variable(
        strategy, lambda **kw: [create_component(**kw)], classes, {}, **kwargs)


_classes = {}


def _mirrored_class():
    if "mirrored" not in _classes:
        _classes["mirrored"] = _define_mirrored_class()
    return _classes["mirrored"]


def _define_mirrored_class():
    import numpy as np

    from tfdist import _compat

    class RankMirroredVariable(_compat.distributed_values.MirroredVariable):
        """A mirrored variable that converts to Python and numpy values as a plain one does.

        TensorFlow's `MirroredVariable` refuses `int(v)` and `float(v)`, and `np.asarray(v)` of an
        integer scalar inside `strategy.scope()` (an optimizer's step counter in a callback);
        code that ran with tfdist's plain variables before, or in one process, keeps working.
        """

        def __array__(self, dtype=None, copy=None):
            return np.asarray(self.read_value().numpy(), dtype=dtype)

        def __int__(self):
            return int(self.read_value())

        def __float__(self):
            return float(self.read_value())

        def __index__(self):
            return int(self.read_value())

        def __bool__(self):
            return bool(self.read_value())

        def sparse_read(self, indices, name=None):
            # tf.gather reads a variable's rows through this (tf-keras' sparse optimizers gather
            # their slots' rows so): the rank's own component gathers them (ResourceGather).
            # Without it a MirroredVariable is read whole first, and once a sparse update has
            # touched a variable TensorFlow copies it whole on every such read.
            return self._get_on_device_or_primary().sparse_read(indices, name=name)

        def _gather_saveables_for_checkpoint(self):
            # A tf-keras optimizer slot that holds this rank's slice (shard_optimizer_state=True)
            # is saved whole and restored as the slice.
            from tfdist.keras import sharded_saves

            return sharded_saves.saveable_factories(self) or super()._gather_saveables_for_checkpoint()

    return RankMirroredVariable


def _sync_on_read_class():
    if "sync_on_read" not in _classes:
        _classes["sync_on_read"] = _define_sync_on_read_class()
    return _classes["sync_on_read"]


def _define_sync_on_read_class():
    import tensorflow as tf

    from tfdist import _compat, collectives

    values = _compat.distributed_values
    values_util = _compat.distributed_values_util
    saveable_object = _compat.saveable_object
    ops = {tf.VariableAggregation.SUM: "sum", tf.VariableAggregation.MEAN: "average"}

    class RankValueSaveable(saveable_object.SaveableObject):
        """Saves this rank's own value (no collective: the chief may save alone); restores as
        TensorFlow restores a sync-on-read variable (a SUM is spread over the replicas)."""

        def __init__(self, variable, name):
            self._variable = variable
            primary = variable._primary
            spec = saveable_object.SaveSpec(tensor=primary.read_value, slice_spec="", name=name,
                                            dtype=variable.dtype, device=primary.device)
            super().__init__(primary.read_value, [spec], name)

        def restore(self, restored_tensors, restored_shapes):
            tensor, = restored_tensors
            return values_util.get_on_read_restore_ops(self._variable, tensor, self._variable.aggregation)

    class RankSyncOnReadVariable(values.SyncOnReadVariable):
        """A sync-on-read variable whose cross-replica reads combine every rank's value (Horovod)."""

        def _get_cross_replica(self):
            if self._aggregation not in ops or collectives.size() == 1 or reading_locally():
                return self._primary  # ONLY_FIRST_REPLICA: the first local replica, as MWMS reads it
            return collectives.allreduce([self._primary.read_value()], op=ops[self._aggregation],
                                         scope="tfdist_sync_on_read")[0]

        def __getattr__(self, name):
            # TensorFlow delegates unknown attributes to the variable's value, which in
            # cross-replica context would be a collective (checkpointing looks attributes up):
            # delegate to this rank's own variable instead.
            if name.startswith("_self_") or name in ("_values", "_use_resource_variables",
                                                     "_attribute_sentinel", "_distributed_container"):
                return super().__getattr__(name)
            return getattr(self._get_on_device_or_primary(), name)

        def _gather_saveables_for_checkpoint(self):
            return {"VARIABLE_VALUE": lambda name=self._common_name: RankValueSaveable(self, name)}

    return RankSyncOnReadVariable
