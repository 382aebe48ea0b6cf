"""One allreduce's time on the ranks of this node, as a training step's collective sees it.

    tfdist-run -np 2 python scripts/benchmarks/collective_latency.py                      # Gloo
    tfdist-run --launcher mpirun -np 2 python scripts/benchmarks/collective_latency.py    # Open MPI
    PYTHONPATH=/tmp/other_horovod tfdist-run -np 2 python scripts/benchmarks/collective_latency.py

Each rank starts as tfdist starts it (`import tfdist` first: its cores, threads and Horovod's
cycle), then times a float32 allreduce inside a tf.function, `--repeats` times for each
`--elements` count, after `--warmup` untimed calls, and rank 0 prints the median and minimum in ms
(and writes them to --json). The tensor is ready on every rank at once, so the time is Horovod's:
the wait for its cycle, the negotiation, the transfer and the sum. A third form, with another
Horovod build unpacked in a folder first on PYTHONPATH, compares two builds side by side.
"""

import argparse
import json
import os
import statistics
import time

import tfdist  # noqa: F401  (first: this rank's cores and threads, before TensorFlow loads)

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--elements", type=int, nargs="+", default=[1000, 1_200_000],
                    help="float32 values a tensor (default: 4 KB, and 4.8 MB: a small CNN's gradients)")
parser.add_argument("--repeats", type=int, default=100)
parser.add_argument("--warmup", type=int, default=10)
parser.add_argument("--json", help="rank 0 writes its figures here")
args = parser.parse_args()

import horovod.tensorflow as hvd  # noqa: E402
import tensorflow as tf  # noqa: E402

hvd.init()


@tf.function
def allreduce(x):
    return hvd.allreduce(x, op=hvd.Sum, name="latency")


results = []
for elements in args.elements:
    x = tf.ones([elements])
    times = []
    for i in range(args.warmup + args.repeats):
        start = time.perf_counter()
        allreduce(x).numpy()
        if i >= args.warmup:
            times.append((time.perf_counter() - start) * 1000)
    results.append({"elements": elements, "bytes": 4 * elements, "median_ms": statistics.median(times),
                    "min_ms": min(times), "max_ms": max(times)})
if hvd.rank() == 0:
    controller = "MPI" if hvd.mpi_enabled() and not hvd.gloo_enabled() else "Gloo"
    print(f"{hvd.size()} ranks, {controller}, Horovod from {os.path.dirname(hvd.__file__)}, "
          f"cycle {os.environ.get('HOROVOD_CYCLE_TIME', '1')} ms")
    for r in results:
        print(f"allreduce {r['bytes']:>10,} bytes: median {r['median_ms']:.2f} ms  min {r['min_ms']:.2f}  "
              f"max {r['max_ms']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": hvd.size(), "controller": controller, "horovod": hvd.__file__,
                       "cycle_ms": os.environ.get("HOROVOD_CYCLE_TIME"), "results": results}, f, indent=1)
