"""How HorovodStrategy exchanges gradients: each as it is ready, buckets, one collective, Adasum, compressed.

```python
from tfdist.exchange import gradients as gradient_exchange
grads = [tf.zeros([1000, 1000]), tf.zeros([1000]), tf.zeros([10, 1000])]   # layer order
print(gradient_exchange.buckets(grads, 1 << 20))      # [[2, 1], [0]]: 1 MiB buckets, last first
```

`exchange()` is what `HorovodExtended._batch_reduce_to` runs. With `bucket_bytes`, each bucket is
one grouped allreduce that depends only on its own gradients, so inside the step graph it starts
as soon as backprop has produced them (last layers first) and overlaps the rest of the backward
pass. Horovod negotiates tensors by name, so buckets finishing in different orders on different
ranks cannot deadlock.

Adasum (`op="adasum"`) replaces the optimizer's gradient sum only: tf-keras calls
`batch_reduce_to(SUM, grads_and_vars)` with the variables as destinations; Keras 3 sums gradients
with `ReplicaContext.all_reduce(SUM, ...)` like synchronized BatchNormalization does its
statistics, so `install_gradient_marker()` marks the optimizer's call. Compression
(`tfdist.exchange.compression`) replaces the same sum, and only it. Keras 3 clips gradients
before that sum; `install_clipping_after_sum()` moves the clip after it.
"""

import contextlib
import threading

import tensorflow as tf

from tfdist import _compat, collectives
from tfdist.keras import recognise
from tfdist.keras.flavour import legacy_requested

GRADIENT_HOOK = "gradient-sum marker"
CLIP_HOOK = "clipping after the gradient sum"
CLIP_SETTINGS = ("clipnorm", "global_clipnorm", "clipvalue")
_marked = threading.local()  # .gradients: inside Keras 3's optimizer gradient all-reduce
_unpatched_clip = []  # Keras 3's own _clip_gradients, once install_clipping_after_sum ran


def buckets(values, bucket_bytes):
    """Indices of `values` grouped into buckets of about `bucket_bytes`, last value first: Keras
    lists gradients in layer order and backprop produces the last layers' first."""
    groups, current, filled = [], [], 0
    for i in reversed(range(len(values))):
        value = values[i]
        dense = not isinstance(value, tf.IndexedSlices) and value.shape.is_fully_defined()
        nbytes = value.shape.num_elements() * value.dtype.size if dense else bucket_bytes
        if current and filled + nbytes > bucket_bytes:
            groups.append(current)
            current, filled = [], 0
        current.append(i)
        filled += nbytes
    return groups + [current] if current else groups


def merge_repeated_rows(value):
    """A `tf.IndexedSlices` with each repeated row index once, its rows summed (the same dense
    value), in a row count that stays steady from batch to batch; anything else unchanged.

    The merged count changes with every batch, and Horovod's response cache keeps one shape per
    tensor: a new shape on any rank sends the step through a full negotiation (two_tower at 1 ms
    round trip: 1.25x slower). So the merged rows are padded with zero rows at an index they
    already hold, up to the next power of two and at most the unmerged count. The shape then
    changes only where the count crosses a power of two; the dense value, the rows touched and
    the sum a consumer makes of repeated rows stay the same, and at most twice the merged rows
    (never more than the unmerged) travel.
    """
    if not isinstance(value, tf.IndexedSlices):
        return value
    indices, positions = tf.unique(value.indices)
    count = tf.size(indices, out_type=positions.dtype)
    rows = tf.math.unsorted_segment_sum(value.values, positions, count)
    padding = tf.minimum(_power_of_two_at_least(count), tf.size(value.indices, out_type=count.dtype)) - count
    rows = tf.concat([rows, tf.zeros(tf.concat([[padding], tf.shape(rows, out_type=count.dtype)[1:]], 0),
                                     rows.dtype)], 0)
    indices = tf.concat([indices, tf.repeat(indices[:1], padding)], 0)
    return tf.IndexedSlices(rows, indices, value.dense_shape)


def _power_of_two_at_least(n):
    """The least power of two >= n (an int32 or int64 tensor; 0 for 0)."""
    n = n - 1
    for shift in (1, 2, 4, 8, 16) + ((32,) if n.dtype == tf.int64 else ()):
        n = tf.bitwise.bitwise_or(n, tf.bitwise.right_shift(n, tf.cast(shift, n.dtype)))
    return n + 1


def exchange(values, op, compression=None, bucket_bytes=0, adasum=False, compressor=None, variables=None,
             merge_sparse=False):
    """Reduce `values` across ranks: Adasum if `adasum`, else `op`.

    `merge_sparse`: send each `tf.IndexedSlices` with its repeated rows merged (horovod/horovod#3328),
    for consumers that sum repeated rows anyway (tf-keras' optimizers do, before any update; Keras
    3's square each looked-up row apart, so their sparse gradients go as they are).

    `bucket_bytes`: None sends each value as an allreduce of its own the moment it exists
    (Horovod fuses whatever is ready each cycle), 0 one grouped allreduce, else buckets of about
    that size. `compressor` (a `tfdist.exchange.compression.Compressor`, gradient sums only) exchanges
    each part compressed, with `variables` (one per value) keying its per-rank state.
    """
    def reduce(indices):
        part = [values[i] for i in indices]
        if adasum:
            return collectives.adasum(part, collectives.size(), compression=compression)
        if compressor is not None:
            return compressor.reduce(part, [variables[i] for i in indices])
        return collectives.allreduce(part, op=op, compression=compression)

    if merge_sparse and not adasum:
        values = [merge_repeated_rows(v) for v in values]
    if bucket_bytes is None:
        parts = [[i] for i in reversed(range(len(values)))]
    elif bucket_bytes:
        parts = buckets(values, bucket_bytes)
    else:
        parts = [list(range(len(values)))]
    reduced = [None] * len(values)
    for part in parts:
        for i, r in zip(part, reduce(part)):
            reduced[i] = r
    return reduced


def is_gradient_sum(reduce_op, value_destination_pairs):
    """Whether this reduction is the optimizer's gradient sum (what op='adasum' and the
    compressors replace). `strategy.reduce`, metric sums and synchronized BatchNormalization are
    not."""
    if reduce_op != tf.distribute.ReduceOp.SUM:
        return False
    return getattr(_marked, "gradients", False) or all(
        isinstance(d, tf.Variable) for _, d in value_destination_pairs)


def gradient_variables(value_destination_pairs):
    """The variable of each gradient in a gradient sum (tf-keras: the destinations; Keras 3:
    what the marked optimizer call holds), or None where they are not known."""
    marked = getattr(_marked, "variables", None)
    if marked is not None and len(marked) == len(value_destination_pairs):
        return marked
    destinations = [d for _, d in value_destination_pairs]
    return destinations if all(isinstance(d, tf.Variable) for d in destinations) else None


@contextlib.contextmanager
def reduced_already():
    """Inside, Keras 3 optimizers take their gradients as already summed across ranks (tfdist's
    LossScaleOptimizer hook reduces before its finite check, as tf-keras does)."""
    outer, _marked.reduced = getattr(_marked, "reduced", False), True
    try:
        yield
    finally:
        _marked.reduced = outer


def is_reduced_already():
    return getattr(_marked, "reduced", False)


def install_gradient_marker():
    """Mark Keras 3's gradient all-reduce, so that op='adasum' and compression replace that sum
    and no other, and skip it for gradients `reduced_already`."""
    if legacy_requested():
        return  # tf-keras' exchange is recognised by its variable destinations
    cls = _compat.keras3_tf_optimizer_class(GRADIENT_HOOK)
    if _compat.has_hook(vars(cls).get("_all_reduce_sum_gradients"), GRADIENT_HOOK):
        return

    def wrap(original):
        def _all_reduce_sum_gradients(self, grads_and_vars):
            grads_and_vars = list(grads_and_vars)
            if getattr(_marked, "reduced", False):
                return grads_and_vars
            outer = getattr(_marked, "gradients", False), getattr(_marked, "variables", None)
            _marked.gradients = True
            _marked.variables = [v if isinstance(v, tf.Variable) else v.value for g, v in grads_and_vars
                                 if g is not None]
            try:
                summed = original(self, grads_and_vars)
            finally:
                _marked.gradients, _marked.variables = outer
            if getattr(_marked, "clip_after_sum", None) is self:
                _marked.clip_after_sum = None
                clipped = _unpatched_clip[0](self, [g for g, _ in summed])
                summed = [(g, v) for g, (_, v) in zip(clipped, summed)]
            return summed
        return _all_reduce_sum_gradients

    _compat.patch_method(cls, "_all_reduce_sum_gradients", wrap, GRADIENT_HOOK)


def install_clipping_after_sum():
    """Make Keras 3 optimizers clip the summed gradient, not each rank's part of it.

    Keras 3 clips (`clipnorm`, `global_clipnorm`, `clipvalue`) before its gradient all-reduce, so
    on several ranks each rank's local gradient was clipped and the answer changed with the rank
    count. Under a multi-rank tfdist strategy the clip now waits for the sum (the gradient-sum
    marker applies it right after), as in one process and in tf-keras. It covers what goes
    through that sum: Keras' own gradient accumulation, compression and Adasum (their result is
    clipped). Gradients already summed (the LossScaleOptimizer hook) are clipped where Keras does.
    """
    if legacy_requested():
        return  # tf-keras clips after its aggregation already
    cls = _compat.keras3_tf_optimizer_class(CLIP_HOOK)
    if _compat.has_hook(vars(cls).get("_clip_gradients"), CLIP_HOOK):
        return

    def wrap(original):
        _unpatched_clip.append(original)

        def _clip_gradients(self, grads):
            if any(getattr(self, name, None) for name in CLIP_SETTINGS) and _summed_afterwards():
                _marked.clip_after_sum = self
                return grads
            return original(self, grads)
        return _clip_gradients

    _compat.patch_method(cls, "_clip_gradients", wrap, CLIP_HOOK)


def _summed_afterwards():
    """Whether the optimizer's next step all-reduces these gradients across several ranks."""
    return (not is_reduced_already() and collectives.process_size() > 1
            and tf.distribute.get_replica_context() is not None
            and recognise.is_tfdist_strategy(tf.distribute.get_strategy()))
