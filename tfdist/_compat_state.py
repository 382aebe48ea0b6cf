"""Keras' private training state that tfdist reads and sets: where `fit` resumes, what BackupAndRestore records.

Part of `tfdist._compat` (every private TensorFlow, Keras and Horovod internal in one place),
apart for its size; checked against the same versions (`_compat.CHECKED_AGAINST`). Used by
`callbacks.Checkpointer` and `tfdist.keras.preemption`; the strategy a Keras 3 model runs under and
the one a distributed dataset comes from, by `tfdist.keras.adopted_strategy`:

```python
from tfdist import _compat_state
_compat_state.set_resume_epoch(model, 2, batches_done=11)   # in on_train_begin: fit continues there
```
"""

import json
import os


class _ResumeCounters:
    """What tf-keras' fit asks for the epoch and step to start at (BackupAndRestore's hook)."""

    def __init__(self, epoch, step=0):
        self.epoch, self.step = epoch, step

    def maybe_load_initial_counters_from_ckpt(self, steps_per_epoch, initial_epoch, mode=None):
        return self.epoch, self.step


RESUME_BATCHES = "_tfdist_resume_batches"  # model attribute: batches of the first epoch already trained


def set_resume_epoch(model, epoch, batches_done=0):
    """Make the running `fit` of `model` continue at `epoch`, after `batches_done` of its batches
    (called from on_train_begin; `tfdist.keras.preemption` skips those batches' data)."""
    if hasattr(model, "_maybe_load_initial_counters_from_ckpt"):  # tf-keras: its loop starts at that step
        model._training_state = _ResumeCounters(epoch, batches_done)
    else:  # Keras 3: every step runs; the first ones only read their data
        model._initial_epoch = epoch
    setattr(model, RESUME_BATCHES, int(batches_done))


def loop_starts_at_resume_step(model):
    """Whether `fit`'s loop itself starts at the resumed step (tf-keras) rather than at 0 (Keras 3)."""
    return isinstance(getattr(model, "_training_state", None), _ResumeCounters)


def clear_resume_epoch(model, restored):
    """Undo `set_resume_epoch` at the end of that fit (`restored`: whether it was called)."""
    if isinstance(getattr(model, "_training_state", None), _ResumeCounters):
        model._training_state = None
    elif restored and hasattr(model, "_initial_epoch"):
        model._initial_epoch = None


BACKUP_BATCHES_KEY = "tfdist_batches_done"  # added to Keras 3 BackupAndRestore's metadata by tfdist


def add_backup_metadata(callback, entries):
    """Add `entries` to a Keras 3 BackupAndRestore's training_metadata.json (rewritten whole)."""
    path = callback._training_metadata_path
    with open(path) as f:
        metadata = {**json.load(f), **entries}
    with open(path + ".tmp", "w") as f:
        json.dump(metadata, f)
    os.replace(path + ".tmp", path)


def set_tf_keras_backup_position(callback, epoch, batch):
    """What a tf-keras BackupAndRestore's next save records: `epoch` and its last `batch` done."""
    callback._training_state._ckpt_saved_epoch.assign(epoch)
    callback._training_state._ckpt_saved_batch.assign(batch)


def backup_position(callback, steps_per_epoch):
    """(epoch, batches done of it) that a restored BackupAndRestore holds, or None (an epoch's
    start, or nothing saved)."""
    if hasattr(callback, "_training_metadata_path"):  # Keras 3
        try:
            with open(callback._training_metadata_path) as f:
                metadata = json.load(f)
            return int(metadata["epoch"]), int(metadata[BACKUP_BATCHES_KEY])
        except (OSError, ValueError, KeyError, TypeError):
            return None
    state = getattr(callback, "_training_state", None)  # tf-keras, after its on_train_begin restored
    if state is None or not steps_per_epoch:
        return None
    epoch, batch = int(state._ckpt_saved_epoch.numpy()), int(state._ckpt_saved_batch.numpy())
    return (epoch, batch + 1) if epoch >= 0 and 0 <= batch < steps_per_epoch - 1 else None


def epoch_iterator_batch_spec(epoch_iterator, hook):
    """The `tf.TypeSpec`s of one replica's batch from a Keras 3 `TFEpochIterator`, without reading it."""
    import tensorflow as tf

    from tfdist._compat import hook_error

    dataset = getattr(epoch_iterator, "_distributed_dataset", None)
    if dataset is None:
        raise hook_error(hook, "Keras' TFEpochIterator has no _distributed_dataset")
    # A PerReplicaSpec holds one spec per local replica: HorovodStrategy has one.
    return tf.nest.map_structure(lambda spec: getattr(spec, "_value_specs", (spec,))[0], dataset.element_spec)


def distributed_dataset_strategy(value):
    """The strategy that distributed `value` (a `tf.distribute.DistributedDataset`), else None."""
    import tensorflow as tf

    if isinstance(value, tf.distribute.DistributedDataset):
        return getattr(value, "_strategy", None)
    return None


def keras3_model_strategy_unset(model):
    """Whether a Keras 3 model was built outside every strategy's scope (it runs under the one in scope)."""
    return hasattr(model, "_distribute_strategy") and model._distribute_strategy is None


def keras3_tracked_variables(model):
    """Every `keras.Variable` of a Keras 3 model: its layers', its metrics' and its optimizer's."""
    found, seen = [], set()
    optimizer = getattr(model, "optimizer", None)
    groups = [model.variables, getattr(model, "metrics_variables", []),
              getattr(optimizer, "variables", []) if optimizer is not None else []]
    for variable in (v for group in groups for v in group):
        if id(variable) not in seen and hasattr(variable, "_value"):
            seen.add(id(variable))
            found.append(variable)
    return found


def recreate_keras3_variable(variable):
    """Give a Keras 3 `keras.Variable` a new TensorFlow variable holding its value, created in
    the strategy scope the caller has entered (as if the layer had been built there)."""
    import tensorflow as tf

    old = variable._value
    if old is None:
        return  # not initialised yet: it is created where it is first built
    variable._initialize(tf.convert_to_tensor(old))


def set_keras3_model_strategy(model, strategy):
    """Make a Keras 3 model (and its optimizer, built under TF's default strategy) run under
    `strategy` from now on, as if built in its scope; the step functions Keras traced under
    another strategy are dropped, to be traced again."""
    from tfdist import _compat

    default = _compat.distribute_lib._get_default_strategy()
    model._distribute_strategy = strategy
    optimizer = getattr(model, "optimizer", None)
    for each in (optimizer, getattr(optimizer, "inner_optimizer", None)):  # Keras' TF optimizer's own copy
        if getattr(each, "_distribution_strategy", None) is default:
            each._distribution_strategy = strategy
    for name in ("train_function", "test_function", "predict_function"):
        if getattr(model, name, None) is not None:
            setattr(model, name, None)


def horovod_ctypes_library():
    """Horovod's TensorFlow library as ctypes sees it (its C API: `horovod_set_cycle_time_ms`, ...)."""
    from tfdist import collectives

    return collectives.horovod().mpi_ops._basics.MPI_LIB_CTYPES
