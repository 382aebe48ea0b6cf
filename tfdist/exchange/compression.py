"""Gradient compression with error feedback: PowerSGD (low rank) and top-k (sparse).

```python
import tfdist
strategy = tfdist.HorovodStrategy(compression="powersgd:4")   # rank 4; or "topk:0.01" (1% density)
strategy = tfdist.HorovodStrategy(compression=tfdist.exchange.compression.PowerSGD(rank=2))
```

Both replace only the optimizer's gradient sum (`fit`, `optimizer.apply_gradients`), as
`op="adasum"` does; `strategy.reduce`, metrics and synchronized BatchNormalization stay exact.
Each rank adds its error-feedback memory (what earlier steps' compression left out) to its
gradient before compressing and keeps what is left out this time, so nothing is lost, only
delayed. Every rank computes the same update from the same exchanged bytes, so weights stay
identical across ranks.

- `PowerSGD(rank)` (Vogels et al., 2019): each gradient of 2 or more dimensions, seen as a
  matrix M (rows = all but the last axis), is replaced by P Q^T: P = sum_ranks(M Q) is
  all-reduced and orthonormalized, then Q = sum_ranks(M^T P) is all-reduced. Q is kept as the
  next step's starting point (warm start). Biases, BatchNorm and other small tensors, where
  (rows + cols) * rank * `min_compression_rate` > rows * cols, go uncompressed.
- `TopK(density)`: each rank sends the `density` fraction of its gradient entries largest in
  magnitude, values and indices, by allgather; every rank adds all ranks' entries up in rank
  order. Tensors too small to gain go uncompressed.

The state (per rank: error memories, PowerSGD's Q) is kept in variables created on the first
step; `callbacks.Checkpointer` saves and restores it for every rank (`state_variables`,
`restore`). A step whose compressed result is not finite (a loss-scale overflow) leaves the
state as it was. With loss scaling the memories are in loss-scaled units (as PyTorch's
communication hooks under AMP).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tfdist import _compat, collectives
from tfdist.exchange import casts, compression_plan


class Compressor:
    """Base class: per-rank state in creation order, and the gradient-sum exchange.

    Subclasses implement `plan(shape)` (how a gradient of that shape is compressed, or None:
    sent whole) and `reduce(values, variables)`: the sum over ranks of each value (one per
    variable), computed from compressed messages.
    """

    name = "compressor"

    def __init__(self):
        self._state = {}  # variable ref -> this compressor's state variables for it
        self._order = []  # every state variable, in creation order (the same on every rank)
        self._pending = []  # arrays from a checkpoint, for state created after the restore

    def state_variables(self) -> list[tf.Variable]:
        """This rank's state variables, in creation order (what a checkpoint stores per rank)."""
        return list(self._order)

    def restore(self, arrays: Iterable[np.ndarray]) -> None:
        """Load this rank's state from `arrays` (numpy, in `state_variables` order).

        State not created yet (the first step has not run) is loaded when it is created.

        Args:
            arrays: this rank's state, as `state_variables` held it when saved.

        Raises:
            ValueError: an array's shape differs from its variable's (named).
        """
        arrays = [np.asarray(a) for a in arrays]
        existing = self._order[:len(arrays)]
        for variable, array in zip(existing, arrays):
            self._check_shape(variable.name, variable.shape, array)
            variable.assign(array)
        self._pending = arrays[len(existing):]

    def describe(self) -> str:
        """The compression setting as `HorovodStrategy(compression=...)` takes it, e.g. "powersgd:4"."""
        return self.name

    def reduce(self, values: Sequence[tf.Tensor], variables: Sequence[Any]) -> list[tf.Tensor]:
        """The sum over ranks of each gradient in `values` (one per variable in `variables`).

        Args:
            values: this rank's gradients.
            variables: the variables they belong to (keys of the error-feedback state).

        Returns:
            The approximate sums (exact for the tensors sent whole), in `values`' shapes and dtypes.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement reduce()")

    def _sum_uncompressed(self, values):
        """(out, plans, compressed): `plan` of each value (None: sent whole), `out` holding the exact
        sums of those sent whole (one grouped allreduce) and None elsewhere, the indices to compress."""
        out = [None] * len(values)
        plans = [self.plan(v.shape.as_list()) if _is_dense_float(v) else None for v in values]
        plain = [i for i, p in enumerate(plans) if p is None]
        if plain:
            summed = collectives.allreduce([values[i] for i in plain], op="sum", scope=f"tfdist_{self.name}_uncompressed")
            for i, r in zip(plain, summed):
                out[i] = r
        return out, plans, [i for i, p in enumerate(plans) if p is not None]

    def _state_for(self, variable, initial_values):
        key = variable.ref() if isinstance(variable, tf.Variable) else id(variable)
        if key not in self._state:
            made = []
            for kind, value in initial_values:
                name = f"tfdist_{self.name}_{kind}_{len(self._order)}"
                if self._pending:
                    array = self._pending.pop(0)
                    self._check_shape(name, value.shape, array)
                    value = array.astype(value.dtype)
                made.append(_compat.rank_local_variable(value, name))
                self._order.append(made[-1])
            self._state[key] = tuple(made)
        return self._state[key]

    @staticmethod
    def _check_shape(name, shape, array):
        if tuple(shape) != tuple(array.shape):
            raise ValueError(f"gradient compression state {name}: the checkpoint holds shape {tuple(array.shape)}, "
                             f"this model needs {tuple(shape)} (a different model or compression setting)")


def _is_dense_float(value):
    return (not isinstance(value, tf.IndexedSlices) and value.dtype.is_floating
            and value.shape.is_fully_defined())


def _keep_if_finite(finite, updates):
    """Assign each (variable, new value) if `finite` (a scalar, the same on every rank); else keep
    the old state (a loss-scale overflow step, which every rank skips)."""
    def assign():
        return tf.group([variable.assign(new) for variable, new in updates])

    return tf.cond(finite, assign, tf.no_op)


def _all_finite(tensors):
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(t)) for t in tensors])


class PowerSGD(Compressor):
    """Rank-`rank` PowerSGD with error feedback and warm-started Q.

    Args:
        rank: the rank of each gradient matrix's approximation (4 is a common start; higher is
            closer to exact and sends more).
        min_compression_rate: compress a rows x cols matrix only if it sends at least this many
            times fewer numbers: rows * cols >= rate * (rows + cols) * rank. 0 compresses every
            matrix (a rank-full approximation is then exact).
        seed: the seed of Q's first value (the same on every rank).

    Raises:
        ValueError: `rank` is below 1.

    Example:
        ```python
        import tfdist
        from tfdist.exchange import PowerSGD
        strategy = tfdist.HorovodStrategy(compression=PowerSGD(rank=4))
        ```
    """

    name = "powersgd"

    def __init__(self, rank: int = 4, min_compression_rate: float = 2.0, seed: int = 0):
        super().__init__()
        if int(rank) < 1:
            raise ValueError(f"PowerSGD rank={rank}: expected an integer >= 1")
        self.rank, self.min_compression_rate, self.seed = int(rank), float(min_compression_rate), int(seed)

    def describe(self) -> str:
        """`"powersgd:<rank>"`."""
        return f"powersgd:{self.rank}"

    def plan(self, shape: Sequence[int]) -> tuple[int, int, int] | None:
        """(rows, cols, rank) if a gradient of `shape` is compressed, else None.

        Args:
            shape: the gradient's shape.

        Returns:
            The matrix it is seen as and the approximation's rank, or None: sent whole.
        """
        return compression_plan.powersgd_plan(shape, self.rank, self.min_compression_rate)

    @tf.autograph.experimental.do_not_convert  # Python loops over tensors and ranks, unrolled
    def reduce(self, values: Sequence[tf.Tensor], variables: Sequence[Any]) -> list[tf.Tensor]:
        """PowerSGD's sum over ranks of each gradient (see `Compressor.reduce`)."""
        out, plans, low = self._sum_uncompressed(values)
        if not low:
            return out
        matrices, states = [], []
        for i in low:
            rows, cols, rank = plans[i]
            q0 = np.random.RandomState(self.seed + len(self._order)).standard_normal((cols, rank)).astype(np.float32)
            error, q = self._state_for(variables[i], [("error", np.zeros((rows, cols), np.float32)), ("q", q0)])
            matrices.append(tf.reshape(tf.cast(values[i], tf.float32), [rows, cols]) + error.read_value())
            states.append((error, q))
        ps = collectives.allreduce([tf.matmul(m, q.read_value()) for m, (_, q) in zip(matrices, states)], op="sum",
                                   scope="tfdist_powersgd_p")
        ps = [tf.linalg.qr(p).q for p in ps]
        qs = collectives.allreduce([tf.matmul(m, p, transpose_a=True) for m, p in zip(matrices, ps)], op="sum",
                                   scope="tfdist_powersgd_q")
        size = float(collectives.size())
        # Any inf/nan in a rank's matrix reaches every rank's summed Q: one decision for all ranks.
        finite = _all_finite(qs)
        updates = []
        for i, m, p, q, (error, q_var) in zip(low, matrices, ps, qs, states):
            total = tf.matmul(p, q, transpose_b=True)
            # This rank's memory: what its matrix holds beyond its share of the approximation.
            updates += [(error, m - total / size), (q_var, q)]
            out[i] = tf.cast(tf.reshape(total, values[i].shape), values[i].dtype)
        _keep_if_finite(finite, updates)
        return out


class TopK(Compressor):
    """Top-k sparsification with error feedback; values and indices travel by allgather.

    Args:
        density: the fraction of each gradient's entries a rank sends (0 < density < 0.5).
        min_entries: tensors with fewer entries go uncompressed.

    Raises:
        ValueError: `density` is not between 0 and 0.5.

    Example:
        ```python
        import tfdist
        from tfdist.exchange import TopK
        strategy = tfdist.HorovodStrategy(compression=TopK(density=0.01))
        ```
    """

    name = "topk"

    def __init__(self, density: float = 0.01, min_entries: int = 1024):
        super().__init__()
        if not 0 < float(density) < 0.5:
            raise ValueError(f"TopK density={density}: expected 0 < density < 0.5 (values and indices "
                             "both travel, so 0.5 or more sends more than the dense gradient)")
        self.density, self.min_entries = float(density), int(min_entries)

    def describe(self) -> str:
        """`"topk:<density>"`."""
        return f"topk:{self.density:g}"

    def plan(self, shape: Sequence[int]) -> int | None:
        """Entries sent (k) if a gradient of `shape` is compressed, else None.

        Args:
            shape: the gradient's shape.

        Returns:
            The entries each rank sends, or None: sent whole.
        """
        return compression_plan.topk_plan(shape, self.density, self.min_entries)

    @tf.autograph.experimental.do_not_convert  # Python loops over tensors and ranks, unrolled
    def reduce(self, values: Sequence[tf.Tensor], variables: Sequence[Any]) -> list[tf.Tensor]:
        """Top-k's sum over ranks of each gradient (see `Compressor.reduce`)."""
        out, plans, sparse = self._sum_uncompressed(values)
        if not sparse:
            return out
        flats, picks, states = [], [], []
        for i in sparse:
            entries = values[i].shape.num_elements()
            (error,) = self._state_for(variables[i], [("error", np.zeros((entries,), np.float32))])
            flat = tf.reshape(tf.cast(values[i], tf.float32), [-1]) + error.read_value()
            _, indices = tf.math.top_k(tf.abs(flat), plans[i], sorted=True)
            flats.append(flat)
            picks.append((tf.gather(flat, indices), indices))
            states.append(error)
        size = collectives.size()
        total_k = sum(plans[i] for i in sparse)
        all_values = tf.reshape(collectives.allgather(tf.concat([v for v, _ in picks], 0), scope="tfdist_topk_values"),
                                [size, total_k])
        all_indices = tf.reshape(collectives.allgather(tf.concat([ix for _, ix in picks], 0),
                                                       scope="tfdist_topk_indices"), [size, total_k])
        # An inf/nan a rank sends reaches every rank: one decision for all ranks.
        finite, updates, start = _all_finite([all_values]), [], 0
        for i, flat, (mine, indices), error in zip(sparse, flats, picks, states):
            k, entries = plans[i], flat.shape[0]
            total = tf.zeros([entries], tf.float32)
            for r in range(size):  # rank order, one scatter per rank (unique indices): deterministic
                total += tf.scatter_nd(all_indices[r, start:start + k, None], all_values[r, start:start + k], [entries])
            start += k
            updates.append((error, tf.tensor_scatter_nd_update(flat, indices[:, None], tf.zeros_like(mine))))
            out[i] = tf.cast(tf.reshape(total, values[i].shape), values[i].dtype)
        _keep_if_finite(finite, updates)
        return out


def parse(value: str | Compressor | Any | None) -> tuple[Any, Compressor | None]:
    """(Horovod compression or None, Compressor or None) from `HorovodStrategy(compression=...)`.

    Args:
        value: None, "none", "fp16", "bf16", "powersgd", "powersgd:<rank>", "topk",
            "topk:<density>", a `Compressor` or a `horovod.tensorflow.Compression`.

    Returns:
        The Horovod compression (None with a `Compressor`), and the `Compressor` (or None).

    Raises:
        ValueError: an unknown setting, or "bf16" where this Horovod build lacks bfloat16
            (`tfdist.exchange.casts.bf16_refusal`).
    """
    if isinstance(value, Compressor):
        return None, value
    if isinstance(value, str):
        kind, param = compression_plan.parse(value)
        if kind == "powersgd":
            return None, PowerSGD(rank=param)
        if kind == "topk":
            return None, TopK(density=param)
    return casts.horovod_compression(value), None
