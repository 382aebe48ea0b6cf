"""Two ranks on one node against one rank, taken apart: split, contention, exchange.

    .venv/bin/python scripts/benchmarks/ranks_per_node.py --global_batch 16 64 --repeats 2 \\
        --out /tmp/ranks_per_node -- --model resnet50 --num_warmup_batches 2 --num_batches 6

For each global batch B, in alternating order (images/s of the whole node):

- `one`: 1 rank on every core, batch B (tfdist, as `tfdist-scaling` runs it);
- `two`: 2 ranks, B/2 each (tfdist, horovodrun --gloo; `--launcher mpirun`: Open MPI's mpirun);
- `apart`: 2 processes at once, each tfdist alone (one rank, so no exchange) on half of the
  cores (`taskset`; tfdist's tuning then gives it the threads of a rank there), B/2 each;
- `alone`: one such process by itself, the other half of the cores idle.

With the node's C cores busy throughout, one rank's step is t1 = B c / C (c: CPU-seconds an image)
and two ranks' step is t2 = s k t1 + 2 e / C, so two/one = 1 / (s k + x), where

- s = one / (2 alone): what halving the batch and the cores costs one process;
- k = 2 alone / apart: two processes computing at once slow each other (cache, memory, the host);
- e = C/2 (B/two - B/apart): the CPU-seconds a rank spends exchanging its gradients each step
  (copies, sums, Horovod's loop), taken from cores that were computing; x = 2e / (C t1).

e depends on the gradient bytes, not on the batch, so e measured at the first batch predicts
`two` at the others (printed beside the measurement). The last table scales x to nodes of more
cores at this run's images per core (same per-core speed and exchange cost): the exchange is a
rank's gradient bytes against its cores' compute, so it shrinks as cores per rank grow; s and k
are properties of a node that a small machine cannot show.
Writes --out.md (tables) and --out.json (every run).
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from tfdist.benchmark.scaling import run_one

CONFIGS = ("one", "two", "apart", "alone")


def run_alone(global_batch, extra, scratch, halves):
    """One-rank tfdist processes, one on each of `halves` (lists of cores), started together, B/2
    each. Returns the summed images/s and their results."""
    procs = []
    for i, cores in enumerate(halves):
        out = os.path.join(scratch, f"alone{i}.json")
        command = ["taskset", "-c", ",".join(map(str, cores)), sys.executable, "-m",
                   "tfdist.benchmark.train_benchmark", "--batch_size", str(global_batch // 2), "--json", out, *extra]
        procs.append((subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
                      out, command))
    results = []
    for proc, out, command in procs:
        output = proc.communicate()[0]
        if proc.returncode != 0:
            sys.exit(f"benchmark failed (exit {proc.returncode}): {shlex.join(command)}\n{output[-4000:]}")
        with open(out) as f:
            results.append({**json.load(f), "command": command})
    return sum(r["total_images_per_sec"] for r in results), results


def measure(config, global_batch, extra, scratch, halves, launcher="horovodrun"):
    if config in ("one", "two"):
        mode = "tfdist@mpirun" if launcher == "mpirun" else "tfdist"
        result = run_one(mode, 1 if config == "one" else 2, global_batch, extra, os.path.join(scratch, "r.json"))
        return result["total_images_per_sec"], [result]
    return run_alone(global_batch, extra, scratch, halves if config == "apart" else halves[:1])


def decompose(rates, global_batch, cores):
    """s, k, e (CPU-seconds a rank a step), x and two/one from the median images/s of each config."""
    one, two, apart, alone = (statistics.median(rates[c]) for c in CONFIGS)
    t1 = global_batch / one
    exchange_cpu_s = cores / 2 * (global_batch / two - global_batch / apart)
    return {"split": one / (2 * alone), "contention": 2 * alone / apart, "exchange_cpu_s": exchange_cpu_s,
            "exchange_share": 2 * exchange_cpu_s / (cores * t1), "two_over_one": two / one,
            "cpu_s_per_image": cores * t1 / global_batch}


def tables(by_batch, cores, batches):
    lines = ["| global batch | one | two | apart | alone | two/one | s (split) | k (contention) | "
             "e (exchange CPU-s a rank a step) | x (exchange share) | two, predicted from e at batch "
             f"{batches[0]} |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    first = by_batch[batches[0]]["model"]
    for b in batches:
        rates, m = by_batch[b]["rates"], by_batch[b]["model"]
        cells = " | ".join(f"{statistics.median(rates[c]):.2f} ({', '.join(f'{r:.2f}' for r in rates[c])})"
                           for c in CONFIGS)
        apart = statistics.median(rates["apart"])
        predicted = b / (b / apart + 2 * first["exchange_cpu_s"] / cores)
        lines.append(f"| {b} | {cells} | {m['two_over_one']:.3f} | {m['split']:.3f} | {m['contention']:.3f} | "
                     f"{m['exchange_cpu_s']:.3f} | {m['exchange_share']:.1%} | {predicted:.2f} |")
    per_core = batches[0] / cores
    lines += ["", f"The exchange's share on larger nodes (2 ranks, {per_core:g} images a core, e = "
              f"{first['exchange_cpu_s']:.3f} CPU-s, {first['cpu_s_per_image']:.3f} CPU-s an image as here):", "",
              "| cores on the node | global batch | x (exchange share) | two/one if s k = 1 |", "|---|---|---|---|"]
    for node_cores in sorted({cores, 16, 32, 64}):
        share = 2 * first["exchange_cpu_s"] / (per_core * node_cores * first["cpu_s_per_image"])
        lines.append(f"| {node_cores} | {per_core * node_cores:g} | {share:.2%} | {1 / (1 + share):.3f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--global_batch", type=int, nargs="+", default=[16])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="ranks_per_node")
    parser.add_argument("--launcher", choices=["horovodrun", "mpirun"], default="horovodrun",
                        help="for one and two: horovodrun --gloo, or Open MPI's mpirun (Horovod's MPI controller)")
    parser.add_argument("extra", nargs="*", help="after --: arguments for tfdist-benchmark")
    args = parser.parse_args()
    if any(b % 2 for b in args.global_batch):
        parser.error(f"--global_batch {args.global_batch}: each must be even (two ranks split it)")
    from tfdist.tuning import startup

    startup.undo()  # each benchmark process applies its own settings
    allowed = sorted(os.sched_getaffinity(0))
    cores = len(allowed)
    if cores < 2 or cores % 2:
        parser.error(f"this process may run on {cores} core(s) ({allowed}): two halves need an even count")
    halves = [allowed[:cores // 2], allowed[cores // 2:]]
    scratch = tempfile.mkdtemp(prefix="tfdist-ranks-per-node-")
    by_batch = {b: {"rates": {c: [] for c in CONFIGS}, "runs": {c: [] for c in CONFIGS}} for b in args.global_batch}
    for repeat in range(args.repeats):
        order = [(b, c) for b in args.global_batch for c in CONFIGS]
        for batch, config in (order if repeat % 2 == 0 else order[::-1]):
            rate, results = measure(config, batch, args.extra, scratch, halves, args.launcher)
            by_batch[batch]["rates"][config].append(rate)
            by_batch[batch]["runs"][config].append(results)
            print(f"repeat {repeat + 1}: batch {batch:4d} {config:6s} {rate:8.2f} images/s", flush=True)
    for b in args.global_batch:
        by_batch[b]["model"] = decompose(by_batch[b]["rates"], b, cores)
    text = tables(by_batch, cores, args.global_batch)
    print("\n" + text)
    with open(f"{args.out}.md", "w") as f:
        f.write(f"`{shlex.join(sys.argv)}` ({time.strftime('%Y-%m-%d %H:%M')}, {cores} cores)\n\n{text}\n")
    with open(f"{args.out}.json", "w") as f:
        json.dump({"command": shlex.join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "cores": cores,
                   "by_batch": by_batch}, f, indent=1)


if __name__ == "__main__":
    main()
