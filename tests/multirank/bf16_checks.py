"""bfloat16 allreduce on real ranks (Horovod's Gloo or MPI CPU sums, tfdist's patch 0008).

    mpirun ... -np 4 python tests/multirank/bf16_checks.py --out DIR
    horovodrun -np 4 --gloo python tests/multirank/bf16_checks.py --out DIR

`exchange_checks()` also runs inside the compression (Gloo, 2 ranks), clipping (Gloo, 2 and 4
ranks) and MPI (2 ranks) launches; the suite runs this file itself on 4 MPI ranks. Each rank
allreduces bfloat16 tensors of its own (sum, average, min, max; fused in one grouped allreduce and
alone; fewer values than ranks; rounding ties; overflow, inf, nan, subnormals) and float32 ones
through `hvd.Compression.bf16`, and writes its inputs and results as raw bits; tests/test_bf16.py
recomputes every result in numpy (ml_dtypes.bfloat16) from all ranks' inputs.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import quiet_tensorflow, worker_parser, write_results  # noqa: E402

quiet_tensorflow()

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402

BF16 = ml_dtypes.bfloat16
HALF_ULP_AT_ONE = 2.0 ** -8  # bfloat16 keeps 8 significant bits: 1 + 2**-7 is 1's neighbour


def rank_inputs(rank, size):
    """{name: bfloat16 array} this rank sends; every name has the same shape on every rank."""
    rng = np.random.default_rng(1000 + rank)
    mixed = rng.normal(size=20011) * 2.0 ** rng.integers(-20, 21, size=20011)  # odd: uneven segments
    # Rank 0 holds 1 and 1 + 2**-7; rank 1 adds half a unit: exact ties, to even (down, then up).
    ties = np.array([1.0, 1.0 + 2 * HALF_ULP_AT_ONE, -1.0, 3.0]) if rank == 0 else \
        np.array([HALF_ULP_AT_ONE, HALF_ULP_AT_ONE, -HALF_ULP_AT_ONE, 4 * HALF_ULP_AT_ONE]) if rank == 1 else \
        np.zeros(4)
    # 1 plus a third of a unit from each other rank: below a half unit per step, so rounding each
    # partial sum to bfloat16 keeps 1; the float32 total (1 + 0.5 or 1 + 1.5 half units) rounds once.
    once = np.array([1.0, 1.0]) if rank == 0 else np.array([2.0 ** -9, 2.0 ** -9 + 2.0 ** -12])
    specials = [np.inf, -np.inf if rank == 1 else 1.0, np.nan if rank == size - 1 else 0.0,
                2.0e38, -(2.0 ** -133) * (rank + 1), 0.0 if rank else -0.0]
    arrays = {"mixed": mixed, "ties": ties, "once": once, "specials": np.array(specials),
              "one": np.array([0.1 * (rank + 1)]), "three": np.array([1.0, -2.0, 0.5]) * (rank + 1) / 3,
              "matrix": rng.normal(size=(7, 5))}
    return {name: a.astype(BF16) for name, a in arrays.items()}


def float32_inputs(rank):
    """float32 gradients this rank sends through `hvd.Compression.bf16` (cast to bfloat16 by TF)."""
    rng = np.random.default_rng(2000 + rank)
    return {"dense": rng.normal(size=(33, 17)).astype(np.float32),
            "bias": (rng.normal(size=5) * 1e-3).astype(np.float32)}


def bits(tensor):
    """A bfloat16 tensor or array as its raw 16-bit words, flat."""
    return np.asarray(tensor.numpy() if hasattr(tensor, "numpy") else tensor).view(np.uint16).ravel().tolist()


def exchange_checks():
    """This rank's inputs and what each bfloat16 allreduce returned, as bits (JSON-able)."""
    collectives = tfdist.collectives
    hvd = collectives.horovod()
    rank, size = collectives.rank(), collectives.size()
    inputs = rank_inputs(rank, size)
    names = sorted(inputs)
    tensors = [tf.constant(inputs[n]) for n in names]
    assert all(t.dtype == tf.bfloat16 for t in tensors)
    out = {"rank": rank, "size": size, "bfloat16_built": bool(hvd.bfloat16_built()),
           "controller": "mpi" if hvd.mpi_enabled() else "gloo", "inputs": {n: bits(inputs[n]) for n in names}}
    for op in ("sum", "average", "min", "max"):
        reduced = collectives.allreduce(tensors, op=op, name=f"bf16.{op}")  # one grouped (fused) allreduce
        assert all(r.dtype == tf.bfloat16 for r in reduced)
        out[op] = {n: bits(r) for n, r in zip(names, reduced)}
    # each alone: the unfused path (Gloo copies the input first; MPI reads it in place of a send buffer)
    out["sum_alone"] = {n: bits(collectives.allreduce([t], op="sum", name=f"bf16.alone.{n}")[0])
                        for n, t in zip(names, tensors)}
    floats = float32_inputs(rank)
    compressed = collectives.allreduce([tf.constant(floats[n]) for n in sorted(floats)], op="sum",
                                       compression=hvd.Compression.bf16, name="bf16.compressed")
    out["compressed_inputs"] = {n: floats[n].ravel().tolist() for n in sorted(floats)}
    out["compressed"] = {n: r.numpy().view(np.uint32).ravel().tolist() for n, r in zip(sorted(floats), compressed)}
    out["compressed_dtype"] = [r.dtype.name for r in compressed]
    gathered = collectives.allgather(tensors[names.index("three")], name="bf16.gather")
    out["allgather"] = bits(gathered)
    out["broadcast"] = bits(collectives.broadcast(tensors[names.index("matrix")], root_rank=size - 1,
                                                  name="bf16.broadcast"))
    return out


def main():
    args = worker_parser().parse_args()
    strategy = tfdist.HorovodStrategy(tuning=False, compression="bf16")
    write_results(args.out, strategy.rank, {"exchange": exchange_checks()})


if __name__ == "__main__":
    main()
