"""Sharded optimizer state (`shard_optimizer_state=True`) against the replicated exchange, one node.

    .venv/bin/python scripts/benchmarks/sharded_state.py --models resnet50 mlp:wide_mlp --ranks 1 2 4 \\
        --out docs/benchmarks/sharded-state-2026-11-28

Per model, Adam, synthetic data:

- memory: for each rank count and exchange, a job of its own (`horovodrun -np N --gloo`) trains
  --steps steps and reports, per rank, the bytes of `optimizer.variables`, the bytes of the
  working copies of its slices, and the process's peak RSS (`ru_maxrss`);
- step time: one job per rank count (2+) holds both models (same seed) and alternates blocks of
  --block steps, sharded and replicated, --repeats times each; the ratio is replicated / sharded
  median step time (above 1: sharded is faster).

Writes <out>.json (every run, the commands, lscpu's model, the date, the load average before and
after) and <out>.md.
"""

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
sys.path.insert(0, os.path.join(ROOT, "scripts", "benchmarks", "multihost"))  # mlp:wide_mlp


def worker(args):
    import numpy as np

    import tfdist
    from tfdist import collectives
    from tfdist.benchmark.models import build_model
    from tfdist.exchange import sharded
    from tfdist.keras.flavour import keras_module

    keras = keras_module()
    exchanges = ["sharded", "replicated"] if args.worker == "alternate" else [args.worker]
    strategies = {e: tfdist.HorovodStrategy(shard_optimizer_state=e == "sharded") for e in exchanges}
    size = collectives.size()
    image = args.image_size
    x = np.random.default_rng(0).normal(size=(args.batch_size * size * args.block, image, image, 3)).astype("float32")
    y = np.random.default_rng(1).integers(0, 1000, size=len(x))
    models = {}
    for exchange, strategy in strategies.items():
        keras.utils.set_random_seed(3)
        with strategy.scope():
            model = build_model(keras, args.model, image, 1000)
            model.compile(keras.optimizers.Adam(1e-4), "sparse_categorical_crossentropy")
        models[exchange] = model

    class Steps(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.started = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter() - self.started)

    times = {e: [] for e in exchanges}
    fit = {"batch_size": args.batch_size * size, "shuffle": False, "verbose": 0}
    for exchange in exchanges:  # warm-up: trace, build, first steps
        models[exchange].fit(x[: args.batch_size * size * args.warmup], y[: args.batch_size * size * args.warmup], **fit)
    for _ in range(args.repeats):
        for exchange in exchanges:
            steps = Steps()
            steps.times = []
            models[exchange].fit(x, y, callbacks=[steps], **fit)
            times[exchange].append(statistics.median(steps.times) * 1e3)
    result = {"times_ms": times, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    for exchange, model in models.items():
        state = sharded.state_of(model.optimizer)
        result[exchange] = {
            "optimizer_bytes": int(sum(np.asarray(v).nbytes for v in model.optimizer.variables)),
            "working_copy_bytes": int(sum(s.length * s.dtype.size for s in state.slices.values())) if state else 0,
            "weight_bytes": int(sum(np.asarray(w).nbytes for w in model.trainable_weights)),
        }
    rows = collectives.allgather_object(result)
    if collectives.rank() == 0:
        with open(args.result, "w") as f:
            json.dump(rows, f)


def run(args, model, ranks, mode, path):
    command = [os.path.join(BIN, "horovodrun"), "-np", str(ranks), "--gloo", sys.executable, os.path.abspath(__file__),
               "--worker", mode, "--model", model, "--result", path, "--image_size", str(args.image_size[model]),
               "--batch_size", str(args.batch_size[model]), "--block", str(args.block), "--repeats",
               str(args.repeats if mode == "alternate" else 1), "--warmup", str(args.warmup)]
    started = time.time()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=args.run_timeout,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
                               "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "scripts", "benchmarks", "multihost"),
                                                              os.environ.get("PYTHONPATH", "")])})
    if proc.returncode != 0:
        raise SystemExit(f"{model} {ranks} {mode}: exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(path) as f:
        return {"command": " ".join(command), "seconds": time.time() - started, "per_rank": json.load(f)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=["sharded", "replicated", "alternate"], help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--models", nargs="+", default=["resnet50", "mlp:wide_mlp"])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--image_size", default=None)
    parser.add_argument("--batch_size", default=None, help="per rank")
    parser.add_argument("--block", type=int, default=3, help="steps per timed block")
    parser.add_argument("--repeats", type=int, default=3, help="alternating blocks per exchange")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--run_timeout", type=int, default=1800)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        args.image_size, args.batch_size = int(args.image_size), int(args.batch_size)
        return worker(args)
    args.image_size = {"resnet50": 224, "mlp:wide_mlp": 32}
    args.batch_size = {"resnet50": 4, "mlp:wide_mlp": 64}
    cpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "?")
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu, "cores": os.cpu_count(),
              "python": platform.python_version(), "load_before": os.getloadavg(), "runs": []}
    for model in args.models:
        for ranks in args.ranks:
            for mode in (["replicated"] if ranks == 1 else ["sharded", "replicated"]):
                report["runs"].append({"model": model, "ranks": ranks, "kind": "memory", "exchange": mode,
                                       **run(args, model, ranks, mode, f"{args.out}-{len(report['runs'])}.tmp.json")})
                print(json.dumps(report["runs"][-1])[:400], flush=True)
        for ranks in [r for r in args.ranks if r > 1]:
            report["runs"].append({"model": model, "ranks": ranks, "kind": "time", "exchange": "alternate",
                                   **run(args, model, ranks, "alternate", f"{args.out}-{len(report['runs'])}.tmp.json")})
            print(json.dumps(report["runs"][-1])[:400], flush=True)
    report["load_after"] = os.getloadavg()
    with open(f"{args.out}.json", "w") as f:
        json.dump(report, f, indent=1)
    for path in os.listdir(os.path.dirname(os.path.abspath(args.out))):
        if path.startswith(os.path.basename(args.out)) and path.endswith(".tmp.json"):
            os.remove(os.path.join(os.path.dirname(os.path.abspath(args.out)), path))
    with open(f"{args.out}.md", "w") as f:
        f.write(markdown(report))
    print(markdown(report))


def markdown(report):
    lines = [f"{report['date']}, {report['cpu']}, {report['cores']} cores; load average before "
             f"{report['load_before'][0]:.1f}, after {report['load_after'][0]:.1f}", "",
             "| model | ranks | exchange | optimizer MB / rank | working copy MB | weights MB | peak RSS MB (max rank) |",
             "|---|---|---|---|---|---|---|"]
    for run in report["runs"]:
        if run["kind"] != "memory":
            continue
        rank0 = run["per_rank"][0][run["exchange"]]
        lines.append(f"| {run['model']} | {run['ranks']} | {run['exchange']} | "
                     f"{max(r[run['exchange']]['optimizer_bytes'] for r in run['per_rank']) / 2**20:.1f} | "
                     f"{rank0['working_copy_bytes'] / 2**20:.1f} | {rank0['weight_bytes'] / 2**20:.1f} | "
                     f"{max(r['rss_mb'] for r in run['per_rank']):.0f} |")
    lines += ["", "| model | ranks | sharded step ms (blocks, rank 0) | replicated step ms | replicated / sharded |",
              "|---|---|---|---|---|"]
    for run in report["runs"]:
        if run["kind"] != "time":
            continue
        times = run["per_rank"][0]["times_ms"]
        sharded, replicated = statistics.median(times["sharded"]), statistics.median(times["replicated"])
        lines.append(f"| {run['model']} | {run['ranks']} | {', '.join(f'{t:.0f}' for t in times['sharded'])} | "
                     f"{', '.join(f'{t:.0f}' for t in times['replicated'])} | {replicated / sharded:.2f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
