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
"""

from __future__ import annotations


def slice_length(elements: int, ranks: int) -> int:
    """k: the elements of a variable of `elements` each of `ranks` ranks owns (at least 1)."""
    if ranks < 1:
        raise ValueError(f"ranks={ranks}: expected at least 1")
    return max(1, -(-int(elements) // ranks))


def padded_length(elements: int, ranks: int) -> int:
    """The flat length every rank's slices add up to: k * ranks (>= elements)."""
    return slice_length(elements, ranks) * ranks


def owned_range(elements: int, ranks: int, rank: int) -> tuple[int, int]:
    """[start, stop) of the elements `rank` owns (stop - start may be less than k, or 0)."""
    k = slice_length(elements, ranks)
    return min(rank * k, elements), min((rank + 1) * k, elements)


def sharded_state_bytes(variable_elements: list[int], ranks: int, slots: int, dtype_bytes: int = 4) -> int:
    """Bytes of `slots` per-variable slots on one rank when each holds a slice (padding included)."""
    return sum(slice_length(n, ranks) for n in variable_elements) * slots * dtype_bytes


def wire_bytes_per_rank(gradient_bytes: float, ranks: int) -> float:
    """Bytes one rank sends per step: a ring reduce-scatter plus a ring allgather, each
    (N-1)/N of the gradient, as a ring allreduce (2 (N-1)/N): the same bytes."""
    return 2 * (ranks - 1) / ranks * gradient_bytes if ranks > 1 else 0.0
