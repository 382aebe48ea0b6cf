"""A sparse gradient's rows and ids in one tensor, so that one allgather carries both.

Horovod sums a `tf.IndexedSlices` across ranks by gathering it: one allgather of the rows and
another of the ids, in two dtypes that its fusion cannot merge. Each is a round of the network
of its own, after the negotiation and beside the dense gradients' allreduce. Packed, each id's
bytes ride as the last columns of its row (a bitcast, which copies bits and changes none), and
the step makes one round fewer.

```python
value = tf.IndexedSlices(tf.ones([3, 2]), tf.constant([4, 0, 4]), tf.constant([5, 2]))
rows = pack(value)                                   # float32 [3, 3]: 2 values, then the id's bits
again = unpack(rows, value)
assert again.indices.numpy().tolist() == [4, 0, 4] and again.values.shape == (3, 2)
```
"""

import tensorflow as tf


def _id_dtype(value):
    """The integer type the ids travel as: theirs, or int64 where their size is not a whole
    number of value elements (int32 ids beside float64 rows)."""
    ids, size = value.indices.dtype, value.values.dtype.size
    return ids if ids.size % size == 0 else tf.int64


def gathered(values, grouped_allgather, divisor=None):
    """Every rank's `values` (`tf.IndexedSlices`) put together, as Horovod sums them, through one
    `grouped_allgather` (tensors in; each one's every-rank concatenation out) of packed rows;
    their values / `divisor` if given (an average)."""
    return [unpack(g, v, divisor) for g, v in zip(grouped_allgather([pack(v) for v in values]), values)]


def pack(value):
    """`value`'s rows, flattened, each followed by its id's bytes in the rows' dtype: [rows, width + k]."""
    values = value.values
    count = tf.shape(values, out_type=tf.int64)[0]
    ids = tf.cast(value.indices, _id_dtype(value))
    id_columns = tf.reshape(tf.bitcast(ids, values.dtype), [count, -1])
    return tf.concat([tf.reshape(values, [count, -1]), id_columns], 1)


def unpack(rows, like, divisor=None):
    """The `tf.IndexedSlices` of gathered `rows` (each rank's `pack(like)`), values / `divisor` if given."""
    values = like.values
    ids = _id_dtype(like)
    id_width = ids.size // values.dtype.size
    width = tf.shape(rows, out_type=tf.int64)[1] - id_width
    indices = tf.cast(tf.reshape(tf.bitcast(rows[:, width:], ids), [-1]), like.indices.dtype)
    shape = tf.concat([[-1], tf.shape(values, out_type=tf.int64)[1:]], 0)
    every_rank = tf.ensure_shape(tf.reshape(rows[:, :width], shape), [None] + values.shape[1:].as_list())
    if divisor is not None:
        every_rank = every_rank / tf.cast(divisor, every_rank.dtype)
    return tf.IndexedSlices(every_rank, indices, like.dense_shape)
