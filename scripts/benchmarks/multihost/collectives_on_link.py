"""Horovod's collectives alone on an emulated link: which one is slow, and by how much.

    .venv/bin/python scripts/benchmarks/multihost/collectives_on_link.py --rate_gbit 1 --out /tmp/collectives
    .venv/bin/python scripts/benchmarks/multihost/collectives_on_link.py --rate_gbit 1 --sizes_mb 12 24 48 --out /tmp/gathers
    .venv/bin/python scripts/benchmarks/multihost/collectives_on_link.py --rate_gbit 1 --sparse --out /tmp/sparse
    .venv/bin/python scripts/benchmarks/multihost/collectives_on_link.py --rate_gbit 10 --delay_ms 0.5 \
        --latency_kb 4 4800 --repeats 50 --rank_env HOROVOD_CYCLE_ON_ENQUEUE=0 --out /tmp/latency

Two network namespaces on a shaped veth pair (tests/emulate_hosts.py), one rank per host on a
core of its own, started as scripts/benchmarks/multihost_benchmark.py starts its ranks (an srun
step's variables; HorovodStrategy() runs the Gloo rendezvous). Each rank times, in a tf.function,
the allreduce of one tensor of --elements values in float32, bfloat16 and float16, then the
alltoall and allgather that tfdist's bfloat16 allreduce is made of (Horovod has no bfloat16
alltoall: float16 moves the same bytes), and the float32 reduce-scatter and allgather of the sharded
exchange, best of --repeats after one untimed call; with --sizes_mb, only a float32 allgather and
alltoall of each size; with --sparse, the sparse gradients of SPARSE_TABLES three ways: as tfdist
sends a `tf.IndexedSlices` (Horovod allgathers every looked-up row and its index), with repeated
rows merged first (horovod/horovod#3328), and densified (one allreduce of the whole table); with
--latency_kb, a float32 allreduce of each size, its median and range over --repeats after 10
untimed calls (a collective's latency on the link: Horovod's cycle, negotiation, transfer).
--delay_ms adds a one-way delay (tests/emulate_hosts.py: netem, or its delay line), --rank_env
sets the ranks' environment. --rate_gbit 0 leaves the link unshaped. Prints rank 0's milliseconds and writes them, with the link and the
command, to <out>.json.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))


# name: (table rows, width, looked-up rows a rank a step, ids drawn from how many rows)
SPARSE_TABLES = {
    "two-tower item table": (200_000, 64, 256, 200_000),  # a batch of 256 ids, few repeats
    "BERT token table": (8192, 256, 2048, 8192),  # 16 sequences of 128 tokens (bert_mini)
    "BERT segment table": (2, 256, 2048, 2),  # every token looks up row 0 or 1
}


def sparse_cases(best_ms, hvd, tf):
    from tfdist import collectives
    from tfdist.exchange.gradients import merge_repeated_rows as merged

    found = {}
    for name, (rows, width, looked_up, drawn) in SPARSE_TABLES.items():
        ids = tf.random.uniform([looked_up], 0, drawn, dtype=tf.int64, seed=hvd.rank() + 1)
        g = tf.IndexedSlices(tf.random.normal([looked_up, width], seed=hvd.rank()), ids, tf.constant([rows, width], tf.int64))
        unique = int(tf.size(tf.unique(ids)[0]))
        n = hvd.size()
        found[name] = {"rows": rows, "width": width, "looked_up": looked_up, "unique_here": unique,
                       "bytes_received": {"entries": (n - 1) * looked_up * (4 * width + 8),
                                          "merged": (n - 1) * unique * (4 * width + 8),
                                          "dense": 2 * (n - 1) * rows * width * 4 // n}}
        key = name.replace(" ", "_")
        for how, prepare in (("entries", lambda g: g), ("merged", merged), ("dense", tf.convert_to_tensor)):
            best_ms(f"{name}, {how}", lambda v, k=f"{key}.{how}", p=prepare:
                    tf.reduce_sum(tf.convert_to_tensor(collectives.allreduce([p(v)], name=k)[0])), g)
    return found


def rank_main(args):
    import tfdist
    import tensorflow as tf

    tfdist.HorovodStrategy()
    import horovod.tensorflow as hvd

    base = tf.random.normal([args.elements], seed=hvd.rank())
    results = {}

    def best_ms(label, collective, x):
        step = tf.function(collective)
        step(x).numpy()
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            step(x).numpy()
            times.append(time.perf_counter() - started)
        results[label] = round(min(times) * 1e3, 1)

    if args.sparse:
        results["tables"] = sparse_cases(best_ms, hvd, tf)
        return write(args, hvd, results)
    if args.latency_kb:
        results["settings"] = {k: os.environ.get(k) for k in ("HOROVOD_CYCLE_TIME", "HOROVOD_CYCLE_ON_ENQUEUE")}
        for kb in args.latency_kb:
            step = tf.function(lambda x, k=kb: hvd.allreduce(x, op=hvd.Sum, name=f"latency_{k:g}"))
            x = base[: int(kb * 1000 / 4)]
            times = []
            for i in range(10 + args.repeats):
                started = time.perf_counter()
                step(x).numpy()
                if i >= 10:
                    times.append((time.perf_counter() - started) * 1e3)
            times.sort()
            results[f"allreduce float32 {kb:g} KB: median (min-max)"] = (
                f"{times[len(times) // 2]:.2f} ({times[0]:.2f}-{times[-1]:.2f})")
        return write(args, hvd, results)
    if args.sizes_mb:  # allgather and alltoall alone, size by size (patch 0013: each at the link's rate)
        for size_mb in args.sizes_mb:
            n = int(size_mb * 2 ** 20 / 4)
            best_ms(f"allgather float32 {size_mb:g} MB from each rank",
                    lambda x, k=size_mb: hvd.allgather(x, name=f"allgather_{k:g}"), base[:n])
            best_ms(f"alltoall float32 {size_mb * hvd.size():g} MB ({size_mb:g} MB to each other rank)",
                    lambda x, k=size_mb: hvd.alltoall(x, name=f"alltoall_{k:g}"), tf.tile(base[:n], [hvd.size()]))
        return write(args, hvd, results)
    mb = args.elements / 2 ** 20
    for dtype in (tf.float32, tf.bfloat16, tf.float16):
        best_ms(f"allreduce {dtype.name} {mb * dtype.size:.0f} MB",
                lambda x, n=dtype.name: hvd.allreduce(x, op=hvd.Sum, name=f"allreduce_{n}"), tf.cast(base, dtype))
    best_ms(f"alltoall float16 {mb * 2:.0f} MB ({mb:.0f} MB to the other rank)",
            lambda x: hvd.alltoall(x, name="alltoall_half"), tf.cast(base, tf.float16))
    best_ms(f"allgather bfloat16 {mb:.0f} MB from each rank",
            lambda x: hvd.allgather(x, name="allgather_half"), tf.cast(base[: args.elements // 2], tf.bfloat16))
    best_ms(f"alltoall float32 {mb * 4:.0f} MB ({mb * 2:.0f} MB to the other rank)",
            lambda x: hvd.alltoall(x, name="alltoall_float"), base)
    # the sharded exchange (shard_optimizer_state=True): the allreduce's two halves, as two collectives
    best_ms(f"reducescatter float32 {mb * 4:.0f} MB",
            lambda x: hvd.reducescatter(x, op=hvd.Sum, name="reducescatter_float"), base)
    best_ms(f"allgather float32 {mb * 4 / hvd.size():.0f} MB from each rank",
            lambda x: hvd.allgather(x, name="allgather_float"), base[: args.elements // hvd.size()])
    return write(args, hvd, results)


def write(args, hvd, results):
    if hvd.rank() == 0:
        with open(args.result, "w") as f:
            json.dump(results, f)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate_gbit", type=float, default=1.0)
    parser.add_argument("--delay_ms", type=float, default=0.0)
    parser.add_argument("--elements", type=int, default=12288 * 2048, help="the wide MLP's largest kernel")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes_mb", type=float, nargs="+", help="instead: float32 allgather and alltoall of each size")
    parser.add_argument("--sparse", action="store_true", help="instead: the sparse exchange of SPARSE_TABLES, three ways")
    parser.add_argument("--latency_kb", type=float, nargs="+", help="instead: an allreduce of each size, median of --repeats")
    parser.add_argument("--rank_env", action="append", default=[], metavar="NAME=VALUE", help="set on the ranks")
    parser.add_argument("--out", help="write <out>.json")
    parser.add_argument("--result", help=argparse.SUPPRESS)  # set on the ranks
    args = parser.parse_args(argv)
    if args.result:
        return rank_main(args)
    sys.path.insert(0, os.path.dirname(HERE))
    import multihost_benchmark as bench

    link = bench.emulate_hosts.Link(args.rate_gbit or None, args.delay_ms)
    job = int(time.time()) % 100000 * 10
    with bench.emulate_hosts.NetworkNamespaces(2, link) as hosts, tempfile.TemporaryDirectory() as scratch:
        measured, rtt = hosts.measure_rate(0, 1, 32 << 20), hosts.measure_rtt(0, 1)
        result = os.path.join(scratch, "rank0.json")
        argv = [sys.executable, os.path.abspath(__file__), "--elements", str(args.elements), "--repeats",
                str(args.repeats), "--result", result, *(["--sizes_mb", *map(str, args.sizes_mb)] if args.sizes_mb else []),
                *(["--sparse"] if args.sparse else []),
                *(["--latency_kb", *map(str, args.latency_kb)] if args.latency_kb else [])]
        procs = []
        for r in range(2):
            env = {**bench.clean_env(), **bench.rank_env(hosts, "ready", r, job), **bench.THREADS,
                   **dict(e.split("=", 1) for e in args.rank_env)}
            log = open(os.path.join(scratch, f"task{r}.log"), "w")
            procs.append(hosts.run(r, argv, core=r % os.cpu_count(), env=env, cwd=ROOT, stdout=log,
                                   stderr=subprocess.STDOUT))
        codes = [p.wait(timeout=900) for p in procs]
        if any(codes):
            sys.exit(f"ranks exited with {codes}\n" + open(os.path.join(scratch, "task0.log")).read()[-3000:])
        results = json.load(open(result))
    header = (f"link {link.describe()} (delay by {hosts.delay_by}), measured {measured:.3f} Gbit/s, "
              f"round trip {rtt:.3f} ms; {bench.cpu_model()}; ranks' environment {args.rank_env}")
    tables, settings = results.pop("tables", {}), results.pop("settings", None)
    print(header + (f"; on the ranks {settings}" if settings else "") + "\n"
          + "\n".join(f"{k}: {v} ms" for k, v in results.items()))
    for name, table in tables.items():
        print(f"{name}: {table['rows']} x {table['width']}, {table['looked_up']} rows looked up a rank "
              f"({table['unique_here']} different on rank 0); bytes rank 0 receives: {table['bytes_received']}")
    if args.out:
        with open(f"{args.out}.json", "w") as f:
            json.dump({"command": " ".join([sys.executable, *sys.argv]), "link": header,
                       "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "ms": results, "settings": settings,
                       "tables": tables}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
