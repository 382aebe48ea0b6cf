"""Sharded optimizer state (`HorovodStrategy(shard_optimizer_state=True)`): what each rank owns and the exchange.

Each rank owns a flat slice of every trainable variable (`tfdist.exchange.shard_plan`) and keeps
the optimizer's state for that slice only. One step: the gradients are reduce-scattered (each
as backprop produces it, or in buckets, as `bucket_mb` schedules allreduces), clipped with norms
summed over every rank's slice, applied to this rank's working copy of its slices by the
optimizer's own update, and the updated slices are all-gathered into the whole variables.

```python
from tfdist.exchange import sharded
state = sharded.state_of(optimizer)            # None: this optimizer's state is whole
print(state.slice_of(variable_key).length)     # the elements of that variable this rank owns
```

The Keras hooks that route an optimizer through this live in `tfdist.keras.sharded_optimizer`;
saving whole state in `tfdist.keras.sharded_saves`.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import numpy as np
import tensorflow as tf

from tfdist import _compat, collectives
from tfdist.exchange import gradients as gradient_exchange
from tfdist.exchange import shard_plan
from tfdist.keras.flavour import legacy_requested

_local = threading.local()  # .scattered: gradients already reduce-scattered; .norms: {id(copy): norms}
_states = weakref.WeakKeyDictionary()  # optimizer -> ShardedState


class VariableSlice:
    """One trainable variable as this rank shards it: its shape, slice length and working copy."""

    def __init__(self, variable, ranks, rank):
        self.variable = variable
        self.shape = tf.TensorShape(variable.shape)
        self.dtype = tf.as_dtype(variable.dtype)
        self.elements = self.shape.num_elements()
        self.row = shard_plan.row_elements(self.shape.as_list(), ranks)
        self.length = shard_plan.slice_length(self.elements, ranks, self.row)
        self.slice_shape = shard_plan.slice_shape(self.shape.as_list(), ranks)  # [length], or rows
        self.ranks, self.rank = ranks, rank
        self.path = getattr(variable, "path", None) or variable.name
        self.copy = None  # this rank's slice of the variable, which the optimizer updates

    def owned_range(self):
        """[start, stop) of the flat elements this rank owns."""
        return shard_plan.owned_range(self.elements, self.ranks, self.rank, self.row)

    def take(self, whole):
        """This rank's slice (padded with zeros) of `whole`, a tensor or array of the variable's shape."""
        flat = tf.reshape(tf.convert_to_tensor(whole), [-1])
        start, stop = self.owned_range()
        mine = flat[start:stop]
        if stop - start < self.length:  # the padding of the last slices
            mine = tf.concat([mine, tf.zeros([self.length - (stop - start)], flat.dtype)], 0)
        return tf.reshape(mine, self.slice_shape)

    def whole(self, gathered):
        """The variable's value from every rank's slices in rank order (padding dropped)."""
        return tf.reshape(tf.reshape(gathered, [-1])[:self.elements], self.shape)


class ShardedState:
    """What one optimizer shards on this rank: its variables' slices, slots and working copies."""

    def __init__(self, ranks, rank):
        self.ranks, self.rank = ranks, rank
        self.slices = {}  # the optimizer's key of a variable -> VariableSlice
        self.copy_keys = {}  # id(working copy) -> its variable's key
        self.slot_slices = {}  # id(slot) -> (slot, VariableSlice): slots of shape [length]

    def slice_of(self, key, variable=None):
        """The VariableSlice of the variable with optimizer key `key` (made from `variable` if new)."""
        if key not in self.slices:
            if variable is None:
                raise KeyError(key)
            self.slices[key] = VariableSlice(variable, self.ranks, self.rank)
        return self.slices[key]

    def add_slot(self, slot, variable_slice):
        self.slot_slices[id(slot)] = (slot, variable_slice)

    def slot_slice(self, slot):
        """The VariableSlice a sharded slot belongs to, or None for a whole variable."""
        found = self.slot_slices.get(id(slot))
        return found[1] if found is not None and found[0] is slot else None

    def working_copy(self, key):
        """This rank's slice of variable `key` as a variable of its own (made on first use)."""
        variable_slice = self.slices[key]
        if variable_slice.copy is None:
            name = variable_slice.path.replace(":", "_") + "_slice"
            zeros = np.zeros(variable_slice.slice_shape, variable_slice.dtype.as_numpy_dtype)
            copy = _compat.rank_local_variable(zeros, name)
            copy.path = variable_slice.path  # what optimizers match exclusion patterns against
            variable_slice.copy = copy
            self.copy_keys[id(copy)] = key
        return variable_slice.copy

    def key_of_copy(self, variable):
        """The variable key a working copy stands for, or None if `variable` is no working copy."""
        key = self.copy_keys.get(id(variable))
        return key if key is not None and self.slices[key].copy is variable else None


def start(optimizer, ranks, rank):
    """Shard `optimizer`'s state across `ranks` ranks from now on; returns its ShardedState."""
    state = _states.get(optimizer)
    if state is None:
        state = _states[optimizer] = ShardedState(ranks, rank)
    return state


def state_of(optimizer):
    """`optimizer`'s ShardedState, or None when its state is whole."""
    try:
        return _states.get(optimizer)
    except TypeError:  # not weakly referenceable: never sharded
        return None


def all_states():
    """Every live optimizer's ShardedState, in the order the optimizers were sharded."""
    return list(_states.items())


@contextlib.contextmanager
def scattered_already():
    """Inside, gradients reaching a sharded update are this rank's slices already (the loss
    scaling hook reduce-scatters before its finite check)."""
    outer, _local.scattered = getattr(_local, "scattered", False), True
    try:
        yield
    finally:
        _local.scattered = outer


def is_scattered_already():
    return getattr(_local, "scattered", False)


def reduce_scatter(grads, variables, bucket_bytes=None, compression=None):
    """Each gradient summed across ranks, as this rank's flat slice ([length], padded).

    `variables`: one per gradient, whose shape a gradient takes where its own static shape is
    partly unknown (a Dense kernel's gradient from a 3-D input is (None, units)).
    `bucket_bytes` as the allreduce schedule's: None issues each gradient's reduce-scatter the
    moment it exists, 0 one grouped collective per dtype, else buckets (last layers first).
    A `tf.IndexedSlices` gradient stays sparse: every rank's rows are gathered (as Horovod sums
    them) and this rank keeps the entries of its slice, as a `tf.IndexedSlices` over the slice's
    flat positions with each looked-up row's entries apart, so that the optimizer's own sparse
    update (Adam's per-entry squares) sees what it sees in one process.
    """
    ranks = collectives.size()
    dense, dense_at, sparse = [], [], []
    for i, (g, variable) in enumerate(zip(grads, variables, strict=True)):
        if isinstance(g, tf.IndexedSlices):
            sparse.append(i)
            continue
        dense_at.append(i)
        g = tf.convert_to_tensor(g)
        if not g.shape.is_fully_defined():
            g = tf.reshape(g, variable.shape)
        n = g.shape.num_elements()
        padding = shard_plan.padded_length(n, ranks, shard_plan.row_elements(variable.shape, ranks)) - n
        g = tf.reshape(g, [-1])
        dense.append(tf.concat([g, tf.zeros([padding], g.dtype)], 0) if padding else g)
    out = [None] * len(grads)
    scattered = _grouped(dense, bucket_bytes, lambda part: collectives.reducescatter(
        part, compression=compression, scope="tfdist_sharded_reducescatter"))
    for i, value in zip(dense_at, scattered):
        out[i] = tf.reshape(value, shard_plan.slice_shape(variables[i].shape, ranks))
    if sparse:
        gathered = collectives.allreduce([grads[i] for i in sparse], op="sum", scope="tfdist_sharded_sparse_gather")
        for i, summed in zip(sparse, gathered):
            out[i] = owned_entries(summed, variables[i].shape, ranks, collectives.rank())
    return out


def row_width(shape):
    """The elements of one row (the first dimension's step) of a variable of `shape`."""
    return shape[1:].num_elements() if shape.rank > 1 else 1


def owned_entries(slices, shape, ranks, rank):
    """The entries of `slices` (row-sparse, of a variable of `shape`) that fall in `rank`'s
    slice, as a `tf.IndexedSlices` over the slice (duplicate rows kept apart): its rows where the
    plan cuts between rows, else each entry at its flat position."""
    shape = tf.TensorShape(shape)
    row = row_width(shape)
    elements = shape.num_elements()
    plan_row = shard_plan.row_elements(shape.as_list(), ranks)
    start, stop = shard_plan.owned_range(elements, ranks, rank, plan_row)
    length = shard_plan.slice_length(elements, ranks, plan_row)
    if plan_row > 1:
        ids = tf.cast(slices.indices, tf.int64)
        mine = tf.where((ids >= start // row) & (ids < stop // row))[:, 0]
        return tf.IndexedSlices(tf.gather(slices.values, mine), tf.gather(ids, mine) - start // row,
                                dense_shape=tf.constant([length // row, *shape.as_list()[1:]], tf.int64))
    first = tf.cast(slices.indices, tf.int64) * row
    rows = tf.where((first < stop) & (first + row > start))[:, 0]  # the rows touching this slice
    flat = tf.reshape(tf.gather(first, rows)[:, None] + tf.range(row, dtype=tf.int64)[None, :], [-1])
    values = tf.reshape(tf.gather(slices.values, rows), [-1])
    keep = (flat >= start) & (flat < stop)
    return tf.IndexedSlices(tf.boolean_mask(values, keep), tf.boolean_mask(flat, keep) - start,
                            dense_shape=tf.constant([length], tf.int64))


def entries(g):
    """The entries a gradient's norm sums: a `tf.IndexedSlices`' values (each looked-up row apart,
    as Keras' and TensorFlow's clipping square them), else the tensor."""
    return g.values if isinstance(g, tf.IndexedSlices) else tf.convert_to_tensor(g)


def allgather(copies, bucket_bytes=None):
    """Every rank's slices of each variable, concatenated in rank order (flat, padded)."""
    values = [tf.convert_to_tensor(c) for c in copies]
    return _grouped(values, bucket_bytes, lambda part: collectives.grouped_allgather(
        part, scope="tfdist_sharded_allgather"))


def _grouped(values, bucket_bytes, collective):
    if bucket_bytes is None:
        parts = [[i] for i in reversed(range(len(values)))]
    elif bucket_bytes:
        parts = gradient_exchange.buckets(values, bucket_bytes)
    else:
        parts = [list(range(len(values)))]
    out = [None] * len(values)
    for part in parts:
        by_dtype = {}
        for i in part:
            by_dtype.setdefault(values[i].dtype, []).append(i)
        for indices in by_dtype.values():
            for i, result in zip(indices, collective([values[i] for i in indices])):
                out[i] = result
    return out


def sums_of_squares(tensors, scope="tfdist_sharded_norms"):
    """Each tensor's sum of squares over every rank's slice: one small allreduce per dtype."""
    local = [tf.reduce_sum(tf.square(entries(t))) for t in tensors]
    return collectives.allreduce(local, op="sum", scope=scope) if collectives.size() > 1 else local


def clip(slices, clipnorm=None, global_clipnorm=None, clipvalue=None):
    """Keras' gradient clipping of the whole gradients, applied to this rank's `slices` of them.

    The norms span every rank's slice; the formulas are Keras' own (`clip_by_norm`,
    `clip_by_global_norm`), so the result is what one process clips. A `tf.IndexedSlices` slice
    is clipped as one process clips one: its entries (each looked-up row apart) are squared for
    the norms and scaled or clipped, and it stays sparse, except under Keras 3's
    `global_clipnorm`, whose `gradient * scale` makes it dense.
    """
    if clipnorm and clipnorm > 0:
        out = []
        for g, l2sum in zip(slices, sums_of_squares(slices)):
            positive = l2sum > 0
            l2norm = tf.where(positive, tf.sqrt(tf.where(positive, l2sum, tf.ones_like(l2sum))), l2sum)
            clip_norm = tf.cast(clipnorm, g.dtype)
            out.append(_on_entries(g, lambda v: v * clip_norm / tf.maximum(l2norm, clip_norm)))
        return out
    if global_clipnorm and global_clipnorm > 0:
        squares = sums_of_squares(slices)
        use_norm = tf.sqrt(tf.add_n([tf.cast(s, tf.float32) for s in squares]))
        scale = global_clipnorm * tf.minimum(1.0 / use_norm, 1.0 / global_clipnorm) + (use_norm - use_norm)
        return [_on_entries(g, lambda v: v * tf.cast(scale, v.dtype), keep_sparse=legacy_requested()) for g in slices]
    if clipvalue and clipvalue > 0:
        return [_on_entries(g, lambda v: tf.clip_by_value(v, -tf.cast(clipvalue, v.dtype), tf.cast(clipvalue, v.dtype)))
                for g in slices]
    return slices


def _on_entries(g, fn, keep_sparse=True):
    if not isinstance(g, tf.IndexedSlices):
        return fn(g)
    clipped = tf.IndexedSlices(fn(g.values), g.indices, g.dense_shape)
    return clipped if keep_sparse else tf.convert_to_tensor(clipped)


@contextlib.contextmanager
def whole_norms_known(copies, slices):
    """Inside, `whole_norms(copy, w, g)` returns the norms of each whole variable and its whole
    gradient (summed over the ranks' slices in one allreduce), for updates that read them
    (LARS and LARC's trust ratio)."""
    squares = sums_of_squares([*copies, *[tf.convert_to_tensor(g) for g in slices]])  # ||g|| of the summed rows
    count = len(copies)
    outer = getattr(_local, "norms", None)
    _local.norms = {id(c): (tf.sqrt(squares[i]), tf.sqrt(squares[count + i])) for i, c in enumerate(copies)}
    try:
        yield
    finally:
        _local.norms = outer


def whole_norms(variable, w, g):
    """(||w||, ||g||) of the whole variable and gradient: summed over the ranks' slices inside a
    sharded update of `variable` (a working copy), else those of `w` and `g` themselves."""
    known = (getattr(_local, "norms", None) or {}).get(id(variable))
    if known is not None:
        return tf.cast(known[0], w.dtype), tf.cast(known[1], w.dtype)
    return tf.norm(w), tf.norm(g)
