"""How HorovodStrategy exchanges gradients: one collective, buckets in backprop order, or Adasum.

```python
from tfdist import gradient_exchange
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
statistics, so `install_adasum_marker()` marks the optimizer's call.
"""

import threading

import tensorflow as tf

from tfdist import _compat, collectives
from tfdist.keras_flavour import legacy_requested

ADASUM_HOOK = "adasum gradient exchange"
_marked = threading.local()  # .gradients: inside Keras 3's optimizer gradient all-reduce


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


def exchange(values, op, compression=None, bucket_bytes=0, adasum=False):
    """Reduce `values` across ranks: Adasum if `adasum`, else `op`; in buckets if `bucket_bytes`."""
    def reduce(part):
        if adasum:
            return collectives.adasum(part, collectives.size(), compression=compression)
        return collectives.allreduce(part, op=op, compression=compression)

    if not bucket_bytes:
        return reduce(values)
    reduced = [None] * len(values)
    for bucket in buckets(values, bucket_bytes):
        for i, r in zip(bucket, reduce([values[i] for i in bucket])):
            reduced[i] = r
    return reduced


def is_gradient_sum(reduce_op, value_destination_pairs):
    """Whether this reduction is the optimizer's gradient sum (what op='adasum' replaces).

    `strategy.reduce`, metric sums and synchronized BatchNormalization are not.
    """
    if reduce_op != tf.distribute.ReduceOp.SUM:
        return False
    return getattr(_marked, "gradients", False) or all(
        isinstance(d, tf.Variable) for _, d in value_destination_pairs)


def install_adasum_marker():
    """Mark Keras 3's gradient all-reduce, so that op='adasum' replaces that sum and no other."""
    if legacy_requested():
        return  # tf-keras' exchange is recognised by its variable destinations
    cls = _compat.keras3_tf_optimizer_class(ADASUM_HOOK)
    if _compat.hook_of(vars(cls).get("_all_reduce_sum_gradients")) == ADASUM_HOOK:
        return

    def wrap(original):
        def _all_reduce_sum_gradients(self, grads_and_vars):
            outer, _marked.gradients = getattr(_marked, "gradients", False), True
            try:
                return original(self, grads_and_vars)
            finally:
                _marked.gradients = outer
        return _all_reduce_sum_gradients

    _compat.patch_method(cls, "_all_reduce_sum_gradients", wrap, ADASUM_HOOK)
