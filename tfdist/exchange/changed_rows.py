"""A sharded table's changed rows: what travels in place of its whole slices after an update.

Under `shard_optimizer_state=True` each rank updates its slice of every variable, and the slices
are all-gathered into the whole variables (`tfdist.exchange.sharded`). Where the optimizer changes
only the rows a gradient holds (`row_local`: plain SGD, Adagrad), a variable with a sparse
gradient (an embedding table's) instead sends the rows of its slice whose bits changed in the
update, with their ids, in one allgather; every rank writes what it receives into its copy of the
variable. A row that no rank changed is equal on every rank already, so the result is the whole
gather's, bit for bit, whatever the optimizer. Momentum and Adam keep changing every row they ever
touched (their slots decay), so over a long run most rows would travel, with their ids, and the
copies around them: there the whole slices are faster (`scripts/benchmarks/changed_rows.py`).

```python
sent = changed(before, after, variable_slice)      # this rank's changed rows, ids coded with its rank
received = gathered([sent])[0]                     # every rank's, in rank order
write(variable, received, variable_slice)          # the rows, then the split ones' elements
```

A row split between two ranks' slices (a variable of few rows is cut flat, `shard_plan`) is sent
by each with its own elements; each rank's are written element by element where it owns them.
"""

from __future__ import annotations

import tensorflow as tf

from tfdist import collectives
from tfdist.exchange import sparse_rows
from tfdist.exchange.sharded import row_width

_BITS = {tf.float16: tf.int16, tf.bfloat16: tf.int16, tf.float32: tf.int32, tf.float64: tf.int64}
KERAS_MODULES = ("keras.src.optimizers.", "tf_keras.src.optimizers.")


def row_local(optimizer):
    """Whether `optimizer` changes only the rows a step's gradient holds, so that sending changed
    rows beats gathering whole slices: Keras' plain SGD (no momentum) and Adagrad, or a class that
    says so with `tfdist_row_local = True`. (Either way is exact; this picks the faster one.)"""
    declared = getattr(type(optimizer), "tfdist_row_local", None)
    if declared is not None:
        return bool(declared)
    name, module = type(optimizer).__name__, type(optimizer).__module__
    if not module.startswith(KERAS_MODULES):
        return False
    return name == "Adagrad" or (name == "SGD" and not getattr(optimizer, "momentum", 0))


def supported(variable_slice):
    """Whether `variable_slice`'s variable can travel as changed rows (a float dtype)."""
    return variable_slice.dtype in _BITS and variable_slice.shape.rank >= 1


def changed(before, after, variable_slice):
    """The rows holding an element of this rank's slice whose bits differ between `before` and
    `after` (its values before and after the update, in the slice's shape): a `tf.IndexedSlices` of [rows, row width] values (this rank's elements,
    zeros where another rank's) indexed by row * ranks + rank."""
    s = variable_slice
    width = row_width(s.shape)
    start, stop = s.owned_range()
    owned = stop - start
    bits = _BITS[s.dtype]
    after, before = (tf.reshape(x, [-1]) for x in (after, before))
    if owned < s.length:  # the padding of the last slices
        after, before = after[:owned], before[:owned]
    differs = tf.not_equal(tf.bitcast(before, bits), tf.bitcast(after, bits))
    first = start // width
    front = start - first * width
    rows = -(-(front + owned) // width)
    padding = [[front, rows * width - front - owned]]
    local = tf.where(tf.reduce_any(_as_rows(differs, padding, width), 1))[:, 0]
    values = tf.gather(_as_rows(after, padding, width), local)
    codes = (local + first) * s.ranks + s.rank
    return tf.IndexedSlices(values, codes, tf.constant([rows, width], tf.int64))


def _as_rows(flat, padding, width):
    """`flat` padded (where its slice starts or ends within a row) and cut into rows of `width`."""
    return tf.reshape(tf.pad(flat, padding) if padding != [[0, 0]] else flat, [-1, width])


def gathered(sent):
    """Every rank's `changed` rows of each variable, in rank order: one grouped allgather, each
    row's id riding in its last columns (`tfdist.exchange.sparse_rows`)."""
    return sparse_rows.gathered(sent, lambda packed: collectives.grouped_allgather(
        packed, scope="tfdist_sharded_rows_allgather"))


def write(variable, received, variable_slice):
    """`variable` with every rank's changed rows (`gathered`) written in: whole rows where one rank
    owns the row, else each element from the rank that owns it. One assign of the whole value
    (a scatter into the variable would make TensorFlow copy it on every later read)."""
    s = variable_slice
    current = tf.convert_to_tensor(variable)
    ranks = tf.constant(s.ranks, tf.int64)
    row = received.indices // ranks
    shape = [-1, *s.shape.as_list()[1:]]
    width = row_width(s.shape)
    if s.row > 1 or width == 1:  # cut between rows: every row is its sender's alone
        return variable.assign(tf.tensor_scatter_nd_update(current, row[:, None], tf.reshape(received.values, shape)))
    flat = row[:, None] * width + tf.range(width, dtype=tf.int64)[None, :]
    start = (received.indices % ranks)[:, None] * s.length
    owns = (flat >= start) & (flat < tf.minimum(start + s.length, s.elements))
    whole = tf.reduce_all(owns, 1)
    value = tf.tensor_scatter_nd_update(current, tf.boolean_mask(row, whole)[:, None],
                                        tf.reshape(tf.boolean_mask(received.values, whole), shape))
    split = owns & ~whole[:, None]
    value = tf.tensor_scatter_nd_update(value, _positions(tf.boolean_mask(flat, split), s.shape),
                                        tf.boolean_mask(received.values, split))
    return variable.assign(value)


def _positions(flat, shape):
    """[n, rank] positions of flat (row-major) element numbers in a variable of `shape`
    (`tf.unravel_index` refuses an empty list)."""
    positions = []
    for size in reversed(shape.as_list()[1:]):
        positions.append(flat % size)
        flat = flat // size
    return tf.stack([flat, *reversed(positions)], 1)
