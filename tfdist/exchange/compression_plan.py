"""Which gradients a compressor compresses, and what it sends: pure Python, shared by
`tfdist.exchange.compression` (which runs it) and `tfdist-predict` (which models it, without TensorFlow).

```python
from tfdist.exchange import compression_plan
compression_plan.parse("powersgd:4")                     # ("powersgd", 4)
compression_plan.powersgd_plan([3, 3, 64, 128], rank=4)  # (576, 128, 4): rows, cols, rank
compression_plan.wire_bytes([[3072, 2048], [2048]], "topk:0.01", ranks=2)
```
"""

import math

DEFAULTS = {"powersgd": 4, "topk": 0.01}


def parse(spec):
    """"powersgd[:rank]" / "topk[:density]" / "fp16" / "bf16" / "none" -> (kind, parameter or None).

    Raises ValueError naming the spec for anything else.
    """
    kind, _, arg = str(spec).partition(":")
    if kind in ("none", "fp16", "bf16") and not arg:
        return kind, None
    try:
        if kind == "powersgd":
            value = int(arg) if arg else DEFAULTS[kind]
            if value >= 1:
                return kind, value
        elif kind == "topk":
            value = float(arg) if arg else DEFAULTS[kind]
            if 0 < value < 0.5:
                return kind, value
    except ValueError:
        pass
    raise ValueError(f"compression={spec!r}: expected 'none', 'fp16', 'bf16', 'powersgd[:rank]' (rank >= 1) or "
                     "'topk[:density]' (0 < density < 0.5: values and indices both travel)")


def powersgd_plan(shape, rank, min_compression_rate=2.0):
    """(rows, cols, rank) if PowerSGD compresses a gradient of `shape`, else None.

    A tensor of 2+ axes is a matrix of rows = all but the last axis, cols = the last; it is
    compressed if it sends `min_compression_rate` times fewer numbers: rows*cols >= rate*(rows+cols)*r.
    """
    if len(shape) < 2:
        return None
    rows, cols = math.prod(shape[:-1]), int(shape[-1])
    rank = min(rank, rows, cols)
    if rows * cols < min_compression_rate * (rows + cols) * rank:
        return None
    return rows, cols, rank


def topk_plan(shape, density, min_entries=1024):
    """Entries a rank sends (k) if top-k compresses a gradient of `shape`, else None."""
    entries = math.prod(shape) if shape else 1
    if entries < min_entries:
        return None
    return max(1, int(round(entries * density)))


def wire_bytes(shapes, spec, ranks, dtype_bytes=4):
    """(allreduce-equivalent bytes, flops) of one step's gradient exchange of float32 `shapes`.

    "Allreduce-equivalent": the bytes a ring allreduce would carry in the same time, so a cost
    model of allreduces applies. Top-k's allgather of k values and k indices from each of N ranks
    moves (N-1)*8k bytes into every rank, what a ring allreduce of 4Nk bytes moves: top-k's cost
    grows with the rank count, PowerSGD's (an allreduce of P, then of Q) does not. Flops: PowerSGD
    ~ 6*rows*cols*rank per matrix (M Q, M^T P, P Q^T); top-k ~ entries*(log2 k + 4) (selection,
    scatter, memory update).
    """
    kind, param = parse(spec)
    total, flops = 0.0, 0.0
    for shape in shapes:
        entries = math.prod(shape) if shape else 1
        dense = entries * dtype_bytes
        if kind in ("fp16", "bf16"):
            total += dense / 2
            continue
        if kind == "powersgd" and (plan := powersgd_plan(shape, param)):
            rows, cols, rank = plan
            total += (rows + cols) * rank * dtype_bytes
            flops += 6 * rows * cols * rank
            continue
        if kind == "topk" and (k := topk_plan(shape, param)):
            total += ranks * k * (dtype_bytes + 4) / 2
            flops += entries * (math.log2(max(k, 2)) + 4)
            continue
        total += dense
    return total, flops
