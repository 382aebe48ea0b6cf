"""The tf.distribute input contract for `HorovodStrategy`: what a global-batch dataset must be.

Under the default `batch_convention="global"` a dataset is batched by the global batch and each
rank takes its part of every batch (see `HorovodExtended._distribute_global_dataset`). These
checks and helpers keep that exact: the batch must divide by the rank count, datasets that
tfdist's reader already split per rank are recognised, and the ranks' shuffles agree.
"""

import numpy as np
import tensorflow as tf

from tfdist import _compat, collectives, consistency


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
    specs = [s for s in tf.nest.flatten(dataset.element_spec) if isinstance(s, tf.TensorSpec)]
    if specs and all(s.shape.rank == 0 for s in specs):
        raise ValueError(
            f"HorovodStrategy cannot split this dataset across {size} ranks: its elements have no "
            f"batch dimension (element_spec {dataset.element_spec}). Batch it by the global batch "
            "size, e.g. dataset.batch(per_rank_batch * strategy.num_replicas_in_sync).")
    batch = int(_compat.compute_batch_size(dataset))
    if batch > 0 and batch % size:
        return (f"a global batch of {batch} does not divide evenly across {size} ranks: ranks get "
                f"parts that differ by one example, and training then weights examples unequally "
                f"(as MWMS does). Use a global batch divisible by {size} for exact training steps.")
    return None


def is_per_rank(dataset):
    """Whether tfdist's own reader built this dataset for one rank (`read_dataset(input_context=)`)."""
    return consistency.find_dataset_attribute(dataset, "tfdist_per_rank") is not None


def is_sharded(dataset):
    """Whether a shard() appears anywhere in the dataset's graph (best effort)."""
    try:
        graph_def = _compat.dataset_graph_def(dataset)
    except Exception:  # noqa: BLE001 - an unknown dataset type: do not warn
        return True
    return b"ShardDataset" in graph_def
