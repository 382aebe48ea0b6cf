"""The tf.distribute input contract for `HorovodStrategy`: what a global-batch dataset must be.

Under the default `batch_convention="global"` a dataset is batched by the global batch and each
rank takes its part of every batch (see `HorovodExtended._distribute_global_dataset`). These
checks and helpers keep that exact: the batch must divide by the rank count (the chief warns
once when it does not), datasets that tfdist's reader already split per rank are recognised, and
the ranks' shuffles agree.
"""

import logging
import os

import numpy as np
import tensorflow as tf

from tfdist import _compat, collectives
from tfdist.faults import consistency

log = logging.getLogger("tfdist")
MULTI_DEVICE_ITERATOR_ENV = "TFDIST_MULTI_DEVICE_ITERATOR"


def agree_on_tf_seed():
    """Give every rank rank 0's TensorFlow seed where the user set none on that rank.

    With the global-batch convention each rank takes its part of every batch, so the ranks'
    shuffles (e.g. `fit(x, y, shuffle=True)`) must agree, or an epoch would show some examples
    twice and others never (MWMS asks its users to seed every worker alike for this). A seed the
    user set is kept.
    """
    if collectives.size() == 1:
        return
    own = _compat.global_seed()
    candidate = own if own is not None else int(np.random.SeedSequence().generate_state(1)[0] >> 1)
    agreed = int(collectives.broadcast(tf.constant(candidate, tf.int64), 0, name="tfdist.seed").numpy())
    if own is None:
        tf.random.set_seed(agreed)


def check_global_batch(dataset, size):
    """Raise if `dataset` cannot be split across `size` ranks; return a warning text, or None.

    Elements with no batch dimension cannot be split. A global batch that `size` does not divide
    can (TensorFlow gives the ranks parts that differ by one, as MWMS does), and Keras makes such
    batches itself for arrays shorter than `batch_size`. Evaluation and prediction stay exact;
    in training, Keras' 1/num_replicas loss scaling then weights the ranks' examples unequally.
    """
    batch = _static_batch(dataset, size)
    return uneven_batch_text(batch, size) if batch > 0 and batch % size else None


def _static_batch(dataset, size):
    """The global batch of `dataset` as tf.distribute infers it (-1: unknown before it runs)."""
    specs = [s for s in tf.nest.flatten(dataset.element_spec) if isinstance(s, tf.TensorSpec)]
    if specs and all(s.shape.rank == 0 for s in specs):
        raise ValueError(
            f"HorovodStrategy cannot split this dataset across {size} ranks: its elements have no "
            f"batch dimension (element_spec {dataset.element_spec}). Batch it by the global batch "
            "size, e.g. dataset.batch(per_rank_batch * strategy.num_replicas_in_sync).")
    return int(_compat.compute_batch_size(dataset))


def uneven_batch_text(batch, size):
    """The warning for a global batch of `batch` split across `size` ranks that it does not divide."""
    return (f"a global batch of {batch} does not divide evenly across {size} ranks: ranks get "
            f"parts that differ by one example, and training then weights examples unequally "
            f"(as MWMS does). Use a global batch divisible by {size} for exact training steps.")


def warn_uneven_global_batch(dataset, size, noted):
    """Check `dataset` as `check_global_batch` does, warn on the chief; return what to distribute.

    The warning goes to the `tfdist` logger on rank 0 only, once per batch size and job
    (`noted`: the texts warned already). Where the batch size is known statically (e.g.
    `dataset.batch(15)`) it is warned here; where it is not (the datasets Keras 3 and tf-keras
    build from arrays and tensors make their batches inside a `flat_map`), rank 0's dataset is
    returned with a watch on the size of the first batch of each pass, which warns when that
    batch is produced. Other ranks get `dataset` back unchanged.
    """
    batch = _static_batch(dataset, size)  # raises on every rank for unbatched elements
    if collectives.rank() != 0:
        return dataset
    if batch <= 0:
        return _watch_first_batch(dataset, size, noted)
    if batch % size:
        _warn_once(uneven_batch_text(batch, size), noted)
    return dataset


def _warn_once(text, noted):
    if text not in noted:
        noted.add(text)
        log.warning("tfdist: rank %d: %s", collectives.rank(), text)


def _watch_first_batch(dataset, size, noted):
    """`dataset` with a check of each pass's first batch: a host call warns if `size` does not divide it."""
    flat = tf.nest.flatten(dataset.element_spec)
    dense = [i for i, s in enumerate(flat) if isinstance(s, tf.TensorSpec) and (s.shape.rank or 0) >= 1]
    if not dense:
        return dataset

    def warn(batch):
        _warn_once(uneven_batch_text(int(batch), size), noted)
        return np.int64(0)

    def observe(index, element):
        batch = tf.shape(tf.nest.flatten(element)[dense[0]], out_type=tf.int64)[0]
        uneven = tf.logical_and(tf.equal(index, 0), tf.not_equal(batch % size, 0))
        # stateful=False: a logging side effect only, so iterators of the dataset stay checkpointable
        done = tf.cond(uneven, lambda: tf.numpy_function(warn, [batch], tf.int64, stateful=False),
                       lambda: tf.constant(0, tf.int64))
        with tf.control_dependencies([done]):
            element = tf.nest.map_structure(tf.identity, element, expand_composites=True)
        return index + 1, element

    return dataset.scan(tf.constant(0, tf.int64), observe)


def is_per_rank(dataset):
    """Whether tfdist's own reader built this dataset for one rank (`read_dataset(input_context=)`)."""
    return consistency.find_dataset_attribute(dataset, "tfdist_per_rank") is not None


_UNREAD = object()  # a `graph` argument not given: read it here


def dataset_graph(dataset):
    """The dataset's serialized graph (bytes), or None where it cannot be read (too large, an unknown kind)."""
    try:
        return _compat.dataset_graph_def(dataset)
    except Exception:  # noqa: BLE001 - callers treat an unreadable graph as the cautious case
        return None


def is_sharded(dataset, graph=_UNREAD):
    """Whether a shard() appears anywhere in the dataset's graph (best effort: an unreadable graph counts).

    `graph` is `dataset_graph(dataset)` where the caller has read it already.
    """
    graph = dataset_graph(dataset) if graph is _UNREAD else graph
    return graph is None or b"ShardDataset" in graph


# The file readers TF's auto-shard looks for (tensorflow/core/grappler/optimizers/data/auto_shard.cc):
# under AUTO, a dataset without one is sharded by DATA.
_FILE_READERS = (b"ArrayRecordDataset", b"FixedLengthRecordDataset", b"RecordIODataset", b"SSTableDataset",
                 b"TextLineDataset", b"TFRecordDataset")


def ranks_end_together(dataset, graph=_UNREAD):
    """Whether every rank surely gets as many batches of `dataset` as every other.

    Sharded by DATA after the split, each rank takes one part (perhaps empty) of every global
    batch, so all ranks reach the end at the same step, and TensorFlow's partial-batch check (one
    allreduce before every step, in case one rank's shard ended first) has nothing to find. DATA
    applies where the dataset asks for it, or asks for AUTO and reads no files. A dataset that
    calls `shard()` itself may differ in length per rank, and so may any dataset whose graph
    cannot be read: those keep the check. The answer depends only on the dataset's graph and
    options, which every rank builds alike, so every rank decides alike. `graph` is
    `dataset_graph(dataset)` where the caller has read it already.
    """
    policy = dataset.options().experimental_distribute.auto_shard_policy
    if policy not in (tf.data.experimental.AutoShardPolicy.DATA, tf.data.experimental.AutoShardPolicy.AUTO):
        return False
    graph = dataset_graph(dataset) if graph is _UNREAD else graph
    if is_sharded(dataset, graph):
        return False
    return policy == tf.data.experimental.AutoShardPolicy.DATA or not any(r in graph for r in _FILE_READERS)


def iterator_options(options, device):
    """The `tf.distribute.InputOptions` a rank's distributed dataset is built with.

    TensorFlow's default (`PER_WORKER`) hands every batch through a `MultiDeviceIterator`, a
    generator that copies each batch to the replica's device. Where that device is the CPU, the
    batch is there already, and the generator only adds a function call and a hop between threads
    to every step, on the core the step runs on. A CPU rank therefore reads its dataset through a
    plain `tf.data` iterator: what `PER_REPLICA` without fetching gives with one replica per
    worker. Splitting, sharding, batching and partial batches are the same either way. A GPU rank,
    options that set `PER_REPLICA` themselves, and `TFDIST_MULTI_DEVICE_ITERATOR=1` in the
    environment (TensorFlow's way, for comparisons) keep `options` as given.

    ```python
    options = iterator_options(None, "/cpu:0")
    assert options.experimental_replication_mode == tf.distribute.InputReplicationMode.PER_REPLICA
    assert iterator_options(None, "/gpu:0") is None
    ```
    """
    asked = options or tf.distribute.InputOptions()
    if (os.environ.get(MULTI_DEVICE_ITERATOR_ENV) == "1"
            or tf.DeviceSpec.from_string(device).device_type not in ("CPU", None)
            or asked.experimental_replication_mode != tf.distribute.InputReplicationMode.PER_WORKER):
        return options
    return tf.distribute.InputOptions(
        experimental_fetch_to_device=False,
        experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA,
        experimental_place_dataset_on_device=False,
        experimental_per_replica_buffer_size=asked.experimental_per_replica_buffer_size,
    )


def prefetched(dataset, options):
    """`dataset` with the buffer the `MultiDeviceIterator` kept (it reads ahead on its own thread)."""
    return dataset.prefetch(options.experimental_per_replica_buffer_size)
