"""Horovod's reduce-scatter on real ranks (tfdist's patch 0011: Gloo's is a pipelined ring), its
allgather and alltoall (patch 0013: Gloo posts their receives first), and its allreduce of small
inputs (patch 0018: one exchange, not a ring), under "small_allreduce".

    horovodrun -np 3 --gloo python tests/multirank/reducescatter_checks.py --out DIR

`reducescatter_checks()` also runs inside the clipping launches (Gloo, 2 and 4 ranks). Each rank
reduce-scatters tensors of its own, `rank_inputs(rank, size)`: alone (on 2 ranks patch 0014's
path, input and output in place) and grouped (Horovod's fusion buffer), float32 segments of more
1 MiB ring pieces than travel at once, first dimensions that do not divide by the
rank count or are smaller than it, float16, float64 and int32. Integer-valued floats keep every sum
exact in any order; one float32 case of random values is compared within a tolerance.
tests/reducescatter_reference.py recomputes each rank's share in numpy from every rank's inputs
(tests/test_clipping.py calls it), and checks the gathered rows (`check_gathers`).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the reference
from common import quiet_tensorflow, worker_parser, write_results  # noqa: E402

quiet_tensorflow()

from reducescatter_reference import (  # noqa: E402
    ALONE, GROUPED, gather_inputs, rank_inputs, rows_summary, small_allreduce_inputs)


def reducescatter_checks():
    """{name: this rank's share as a nested list, "dtype:<name>": dtype, "controller": ...}."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    inputs = rank_inputs(hvd.rank(), hvd.size())
    results = {"controller": "mpi" if hvd.mpi_enabled() else "gloo"}
    for name in ALONE:
        out = hvd.reducescatter(tf.constant(inputs[name]), op=hvd.Sum, name=f"tfdist_rs_check_{name}")
        results[name], results[f"dtype:{name}"] = out.numpy().tolist(), out.dtype.name
    grouped = hvd.grouped_reducescatter([tf.constant(inputs[name]) for name in GROUPED], op=hvd.Sum)
    for name, out in zip(GROUPED, grouped):
        results[name], results[f"dtype:{name}"] = out.numpy().tolist(), out.dtype.name
    mine, to_all, splits = gather_inputs(hvd.rank(), hvd.size())
    results["allgather"] = rows_summary(hvd.allgather(tf.constant(mine), name="tfdist_gather_check").numpy())
    received, received_splits = hvd.alltoall(tf.constant(to_all), splits=splits, name="tfdist_alltoall_check")
    results["alltoall"], results["alltoall_received_splits"] = rows_summary(received.numpy()), received_splits.numpy().tolist()
    results["small_allreduce"] = small_allreduces(hvd, tf)
    return results


def small_allreduces(hvd, tf):
    ops = {"sum": hvd.Sum, "max": hvd.Max}
    inputs = small_allreduce_inputs(hvd.rank(), hvd.size())
    found = {}
    for name, (value, op) in inputs.items():
        if not name.startswith("grouped"):
            found[name] = hvd.allreduce(tf.constant(value), op=ops[op], name=f"tfdist_small_{name}").numpy().tolist()
    grouped = hvd.grouped_allreduce([tf.constant(inputs[n][0]) for n in ("grouped_a", "grouped_b")], op=hvd.Sum)
    found["grouped_a"], found["grouped_b"] = (g.numpy().tolist() for g in grouped)
    return found


def main():
    args = worker_parser().parse_args()
    import horovod.tensorflow as hvd

    results = reducescatter_checks()
    write_results(args.out, hvd.rank(), results)


if __name__ == "__main__":
    main()
