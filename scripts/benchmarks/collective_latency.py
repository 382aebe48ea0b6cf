"""One allreduce's time on the ranks of this node, as a training step's collective sees it.

    tfdist-run -np 2 python scripts/benchmarks/collective_latency.py                      # Gloo
    tfdist-run --launcher mpirun -np 2 python scripts/benchmarks/collective_latency.py    # Open MPI
    PYTHONPATH=/tmp/other_horovod tfdist-run -np 2 python scripts/benchmarks/collective_latency.py
    HOROVOD_CYCLE_TIME=10 HOROVOD_CYCLE_ON_ENQUEUE=1 tfdist-run -np 2 python \
        scripts/benchmarks/collective_latency.py --idle_seconds 8 --eager

Each rank starts as tfdist starts it (`import tfdist` first: its cores, threads and Horovod's
cycle), then times a float32 allreduce inside a tf.function, `--repeats` times for each
`--elements` count, after `--warmup` untimed calls, and rank 0 prints the median and minimum in ms
(and writes them to --json). The tensor is ready on every rank at once, so the time is Horovod's:
the wait for its cycle, the negotiation, the transfer and the sum. A third form, with another
Horovod build unpacked in a folder first on PYTHONPATH, compares two builds side by side. The
fourth sets Horovod's cycle as HorovodStrategy() does on CPU (10 ms, started by each enqueued
collective: patch 0017), first measures what an idle rank's Horovod costs (the process's CPU time
over `--idle_seconds` of sleep, as a share of one core), and calls the allreduce eagerly (`--eager`:
one op at a time, as callbacks and variable broadcasts do) instead of in a tf.function.
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
parser.add_argument("--idle_seconds", type=float, default=0,
                    help="first sleep this long and report the process's CPU use meanwhile (%% of a core)")
parser.add_argument("--eager", action="store_true", help="call the allreduce eagerly, not in a tf.function")
args = parser.parse_args()

import horovod.tensorflow as hvd  # noqa: E402
import tensorflow as tf  # noqa: E402

hvd.init()


def allreduce(x):
    return hvd.allreduce(x, op=hvd.Sum, name="latency")


if not args.eager:
    allreduce = tf.function(allreduce)
hvd.allreduce(tf.ones([1]), name="started")   # every rank's Horovod running before the idle time
cpu, wall = time.process_time(), time.perf_counter()
time.sleep(args.idle_seconds)
idle_core_percent = 100 * (time.process_time() - cpu) / (time.perf_counter() - wall) if args.idle_seconds else None

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
    from tfdist.tuning import cycle

    on_enqueue = cycle.starts_on_enqueue()
    print(f"{hvd.size()} ranks, {controller}, Horovod from {os.path.dirname(hvd.__file__)}, "
          f"cycle {os.environ.get('HOROVOD_CYCLE_TIME', '1')} ms, started on enqueue: {on_enqueue} (Horovod's word), "
          f"{'eager' if args.eager else 'tf.function'}")
    if idle_core_percent is not None:
        print(f"idle for {args.idle_seconds:g} s: {idle_core_percent:.1f}% of a core")
    for r in results:
        print(f"allreduce {r['bytes']:>10,} bytes: median {r['median_ms']:.2f} ms  min {r['min_ms']:.2f}  "
              f"max {r['max_ms']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": hvd.size(), "controller": controller, "horovod": hvd.__file__,
                       "cycle_ms": os.environ.get("HOROVOD_CYCLE_TIME"), "starts_on_enqueue": on_enqueue,
                       "eager": args.eager, "idle_core_percent": idle_core_percent, "results": results}, f, indent=1)
