"""numpy's answer to every bfloat16 allreduce of tests/multirank/bf16_checks.py, checked bit for bit.

Horovod's bfloat16 allreduce (tfdist's patch 0008) promises, on Gloo and on MPI: each value is the
float32 sum of the ranks' bfloat16 values in rank order, cast to bfloat16 once (to nearest even);
MIN and MAX keep `std::min` / `std::max`'s rule in rank order; AVERAGE scales that sum by 1/size
in float32. `check_exchange(ranks)` recomputes each result from all ranks' inputs with
ml_dtypes.bfloat16 and asserts that every rank returned exactly it.
"""

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16


def values(bits):
    return np.asarray(bits, np.uint16).view(BF16)


def fold(inputs, step):
    """Rank 0's values in float32, then `step(acc, next rank's float32 values)` in rank order."""
    acc = values(inputs[0]).astype(np.float32)
    for bits in inputs[1:]:
        acc = step(acc, values(bits).astype(np.float32))
    return acc


def reference(op, inputs):
    """The bfloat16 result of Horovod's `op` over the ranks' bfloat16 `inputs` (bits, rank order)."""
    with np.errstate(over="ignore", invalid="ignore"):
        if op in ("sum", "average", "sum_alone"):
            acc = fold(inputs, np.add)
            summed = acc.astype(BF16)
            if op == "average":
                summed = (summed.astype(np.float32) * np.float32(1.0 / len(inputs))).astype(BF16)
            return summed
        if op == "min":  # std::min(acc, x): x if x < acc, else acc (a NaN compares false)
            return fold(inputs, lambda acc, x: np.where(x < acc, x, acc)).astype(BF16)
        if op == "max":  # std::max(acc, x): x if acc < x, else acc
            return fold(inputs, lambda acc, x: np.where(acc < x, x, acc)).astype(BF16)
    raise ValueError(op)


def assert_same_bits(got, want, what):
    got, want = values(got), np.asarray(want, BF16).ravel()
    assert got.shape == want.shape, what
    nan = np.isnan(want.astype(np.float32))
    assert np.array_equal(np.isnan(got.astype(np.float32)), nan), f"{what}: NaN where numpy has none, or not"
    mismatch = np.flatnonzero(got.view(np.uint16)[~nan] != want.view(np.uint16)[~nan])
    assert mismatch.size == 0, (f"{what}: {mismatch.size} of {(~nan).sum()} values differ from numpy's, first "
                                f"{got[~nan][mismatch[:3]]} against {want[~nan][mismatch[:3]]}")


def check_exchange(ranks):
    """Every bfloat16 result of every rank equals numpy's. `ranks`: {rank: exchange_checks() dict}."""
    size = len(ranks)
    runs = [ranks[r] for r in range(size)]
    assert all(run["bfloat16_built"] and run["size"] == size for run in runs)
    names = sorted(runs[0]["inputs"])
    for op in ("sum", "average", "min", "max", "sum_alone"):
        for name in names:
            want = reference(op, [run["inputs"][name] for run in runs])
            for rank, run in enumerate(runs):
                assert_same_bits(run[op][name], want, f"{op} of {name!r}, rank {rank} of {size}")
    for name in runs[0]["compressed"]:
        sent = [np.asarray(run["compressed_inputs"][name], np.float32).astype(BF16).view(np.uint16) for run in runs]
        want = reference("sum", sent).astype(np.float32).view(np.uint32)
        for run in runs:
            assert run["compressed"][name] == want.ravel().tolist(), f"float32 {name!r} through Compression.bf16"
            assert run["compressed_dtype"] == ["float32", "float32"]
    gathered = np.concatenate([values(run["inputs"]["three"]) for run in runs])
    root = values(runs[-1]["inputs"]["matrix"])
    for run in runs:
        assert_same_bits(run["allgather"], gathered, "allgather")
        assert_same_bits(run["broadcast"], root, "broadcast")


def once_beats_pairwise(ranks):
    """On 4 ranks: the 'once' input's first value is 1 + 3 * 2**-9. Rounded once it is 1 + 2**-7;
    rounding each partial sum from rank 0 on (1 + 2**-9 -> 1, three times) would give 1."""
    got = values(ranks[0]["sum"]["once"]).astype(np.float32)[0]
    pairwise = np.float32(1.0)
    for _ in range(len(ranks) - 1):
        pairwise = np.float32(np.float32(pairwise + np.float32(2.0 ** -9)).astype(BF16))
    return float(got), float(pairwise)
