"""How `shard_optimizer_state=True` cuts a variable across ranks: a flat slice of every variable.

Pure Python (no TensorFlow), shared by the sharded exchange (`tfdist.exchange.sharded`) and
`tfdist-predict`.

```python
from tfdist.exchange import shard_plan
print(shard_plan.slice_length(10, 4))        # 3: each of 4 ranks owns 3 of the 10 elements
print(shard_plan.owned_range(10, 4, 3))      # (9, 10): rank 3 owns element 9 (and 2 of padding)
```

A variable of n elements is read flat and cut into `ranks` slices of k = ceil(n / ranks)
elements; rank r owns elements [r k, (r + 1) k), and the last slices are padded with zeros up to
k * ranks. A reduce-scatter of the padded flat gradient gives rank r exactly its slice (Horovod
splits the first dimension evenly, rank order), and an allgather of the slices gives the padded
flat variable back.

A variable of many rows (an embedding table, a wide kernel: at least `ROWS_PER_RANK` rows a rank)
is cut between rows instead: k is a whole number of rows, ceil(rows / ranks) of them, so each
slice is rows [r k', (r + 1) k') and keeps the variable's row shape. A sparse gradient's rows then
stay rows on the slice, as the optimizer's sparse update sees them in one process (a flat slice
would split each looked-up row into its elements). The padding is under `ranks` rows, at most
1/`ROWS_PER_RANK` of the variable.

```python
print(row_elements([200_000, 64], 3))        # 64: cut between rows
print(slice_length(200_000 * 64, 3, 64))     # 4266688: 66667 rows of 64
```
"""

from __future__ import annotations

ROWS_PER_RANK = 16


def row_elements(shape, ranks: int) -> int:
    """The elements of one row when a variable of `shape` is cut between rows, else 1 (flat)."""
    dims = [int(d) for d in shape]
    if len(dims) < 2 or dims[0] < ROWS_PER_RANK * ranks:
        return 1
    row = 1
    for d in dims[1:]:
        row *= d
    return max(row, 1)


def slice_shape(shape, ranks: int) -> list[int]:
    """The shape of a rank's slice of a variable of `shape`: [k] flat, or [k rows, *row shape]."""
    dims = [int(d) for d in shape]
    elements = 1
    for d in dims:
        elements *= d
    row = row_elements(dims, ranks)
    length = slice_length(elements, ranks, row)
    return [length] if row == 1 else [length // row, *dims[1:]]


def slice_length(elements: int, ranks: int, row: int = 1) -> int:
    """k: the elements of a variable of `elements` each of `ranks` ranks owns (at least 1), a
    whole number of rows of `row` elements."""
    if ranks < 1:
        raise ValueError(f"ranks={ranks}: expected at least 1")
    rows = -(-int(elements) // row)
    return max(1, -(-rows // ranks)) * row


def padded_length(elements: int, ranks: int, row: int = 1) -> int:
    """The flat length every rank's slices add up to: k * ranks (>= elements)."""
    return slice_length(elements, ranks, row) * ranks


def owned_range(elements: int, ranks: int, rank: int, row: int = 1) -> tuple[int, int]:
    """[start, stop) of the elements `rank` owns (stop - start may be less than k, or 0)."""
    k = slice_length(elements, ranks, row)
    return min(rank * k, elements), min((rank + 1) * k, elements)


def sharded_state_bytes(variable_elements: list[int], ranks: int, slots: int, dtype_bytes: int = 4) -> int:
    """Bytes of `slots` per-variable slots on one rank when each holds a slice (padding included)."""
    return sum(slice_length(n, ranks) for n in variable_elements) * slots * dtype_bytes


def wire_bytes_per_rank(gradient_bytes: float, ranks: int) -> float:
    """Bytes one rank sends per step: a ring reduce-scatter plus a ring allgather, each
    (N-1)/N of the gradient, as a ring allreduce (2 (N-1)/N): the same bytes."""
    return 2 * (ranks - 1) / ranks * gradient_bytes if ranks > 1 else 0.0
