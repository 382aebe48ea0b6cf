"""`tfdist-tune`: time a few training steps under candidate settings, keep the fastest for this machine.

    tfdist-tune                                  # ResNet50 fp32 224x224, global batch 16
    tfdist-tune --model mypkg.models:build --image_size 96 --global_batch 64
    tfdist-tune --candidates defaults onednn_flip ranks2   # a subset, by name

Each candidate runs `tfdist-benchmark` in a fresh process (oneDNN and the thread pools are fixed
when TensorFlow loads, so nothing else measures them): one warm-up step, then `--steps` timed
steps at the same global batch. The candidates:

    defaults      TensorFlow's own settings: HorovodStrategy(tuning=False), nothing set before
                  TensorFlow loads (the baseline; every candidate runs under HorovodStrategy)
    onednn_flip   tfdist's plan with oneDNN the other way round from TensorFlow's default
    plan          tfdist's built-in plan (skipped after `defaults`: it equals `defaults` where
                  oneDNN is on by default, else `onednn_flip`)
    ranks2        2 ranks per node, each pinned to half the cores, 10 ms Horovod cycle
    ranks2_cycle1 the same with Horovod's default 1 ms cycle
    ranks2_nopin  2 ranks per node, not pinned

A fresh process costs about 40 s before its first timed step with ResNet50 on 2 cores (importing
TensorFlow, tracing and optimising the training graph), so `--budget` (seconds, default 180) stops
starting candidates once the next one would not finish in time: the candidates are ordered by
what they were worth in measurements (oneDNN, ranks per node and pinning first, a 1 ms Horovod
cycle last, see docs/benchmarks/records-2026-11-22-cpu-tuning.md), and the skipped ones are named.

It prints the table it measured and caches the fastest candidate per ranks-per-node for this
(CPU model, cpus, TensorFlow version, model) in `tfdist.tuning.cache`. Later jobs on this machine
(`import tfdist`, `tfdist-run`, `HorovodStrategy()`) apply the cached choice at no cost.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from tfdist.tuning import startup
from tfdist.tuning import cache as tuning_cache

# In the order they are measured: when --budget runs out, the last ones are skipped (and named).
# No 1-inter-op-thread candidate: one thread can deadlock a step (tuning.plan.MIN_INTER_OP_THREADS).
CANDIDATES = ("defaults", "onednn_flip", "plan", "ranks2", "ranks2_nopin", "ranks2_cycle1")


def candidate_settings(name, onednn_default):
    """(ranks per node, TFDIST_TUNING_CHOICE dict or None for TF defaults) of candidate `name`."""
    on = True if onednn_default is None else onednn_default
    table = {
        "defaults": (1, None),
        "onednn_flip": (1, {"overrides": {"onednn": not on}}),
        "plan": (1, {"overrides": {"onednn": True}}),
        "ranks2": (2, {"overrides": {"onednn": True}, "cycle_time_ms": 10}),
        "ranks2_cycle1": (2, {"overrides": {"onednn": True}, "cycle_time_ms": 1}),
        "ranks2_nopin": (2, {"overrides": {"onednn": True, "pin": False}, "cycle_time_ms": 10}),
    }
    return table[name]


def describe_choice(choice):
    if choice is None:
        return "TensorFlow's own settings (tuning=False)"
    o = choice.get("overrides", {})
    parts = [f"oneDNN {'on' if o.get('onednn') else 'off'}" if o.get("onednn") is not None else "oneDNN default",
             f"inter_op={o['inter_op_threads']}" if o.get("inter_op_threads") else "inter_op default",
             "unpinned" if o.get("pin") is False else "pinned"]
    if choice.get("cycle_time_ms"):
        parts.append(f"cycle {choice['cycle_time_ms']:g} ms")
    return ", ".join(parts)


def run_candidate(name, ranks, choice, args, scratch):
    """One benchmark process (or `ranks` of them); returns its result dict."""
    out = os.path.join(scratch, f"{name}.json")
    bench = [sys.executable, "-m", "tfdist.benchmark.train_benchmark", "--model", args.model,
             "--image_size", str(args.image_size), "--num_classes", str(args.num_classes),
             "--batch_size", str(args.global_batch // ranks), "--num_warmup_batches", "1",
             "--num_batches", str(args.steps), "--display_every", str(args.steps), "--json", out,
             "--variable_update", "tfdist", "--precision", args.precision]
    if choice is None:  # HorovodStrategy(tuning=False), nothing set early: TensorFlow's own settings
        bench.append("--no_tuning")
    env = clean_env()
    if choice is None:
        env[startup.SWITCH_VARIABLE] = "0"
    else:
        env[tuning_cache.CHOICE_VARIABLE] = json.dumps(choice)
    command = bench if ranks == 1 else [os.path.join(os.path.dirname(sys.executable), "horovodrun"),
                                        "-np", str(ranks), "--gloo", *bench]
    start = time.perf_counter()
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise SystemExit(f"tfdist-tune: candidate {name} failed (exit {done.returncode}): "
                         f"{' '.join(command)}\n{done.stdout[-3000:]}")
    with open(out) as f:
        result = json.load(f)
    result["wall_seconds"] = time.perf_counter() - start
    return result


def measure(name, ranks, choice, args, scratch, repeat):
    result = run_candidate(name, ranks, choice, args, scratch)
    effect = result.get("in_effect", {})
    row = {"candidate": name, "ranks": ranks, "settings": describe_choice(choice), "choice": choice,
           "runs": [result["total_images_per_sec"]], "step_seconds": [result["step_seconds"]],
           "in_effect": effect, "wall_seconds": round(result["wall_seconds"], 1)}
    print(f"tfdist-tune: repeat {repeat}: {name:14s} {ranks} rank(s) {row['runs'][0]:7.2f} images/s  "
          f"({row['settings']}; in effect: oneDNN {'on' if effect.get('onednn') else 'off'}; "
          f"{row['wall_seconds']:.0f} s)", flush=True)
    return row


def merge_repeats(rows):
    """One row per candidate, in first-run order: every run kept, the median as images_per_sec."""
    import statistics

    merged = {}
    for row in rows:
        if row["candidate"] in merged:
            kept = merged[row["candidate"]]
            kept["runs"] += row["runs"]
            kept["step_seconds"] += row["step_seconds"]
        else:
            merged[row["candidate"]] = row
    for row in merged.values():
        row["images_per_sec"] = statistics.median(row["runs"])
    return list(merged.values())


def clean_env():
    """This environment without a surrounding job's launcher and tfdist variables."""
    prefixes = ("HOROVOD_", "OMPI_", "PMI_", "PMIX_", "SLURM_STEP", "TFDIST_", "TF_NUM_", "TF_ENABLE_ONEDNN",
                "OMP_", "KMP_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if "TFDIST_CACHE_DIR" in os.environ:
        env["TFDIST_CACHE_DIR"] = os.environ["TFDIST_CACHE_DIR"]
    return env


def model_signature(args):
    return f"{args.model} {args.image_size}px global batch {args.global_batch} {args.precision}"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="tfdist-tune", description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", default="resnet50",
                        help="a tfdist-benchmark model name, or module:function(image_size, num_classes) "
                             "returning an uncompiled Keras model")
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--num_classes", type=int, default=1000)
    parser.add_argument("--global_batch", type=int, default=16)
    parser.add_argument("--precision", default="float32")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per candidate (after 1 warm-up)")
    parser.add_argument("--budget", type=float, default=180,
                        help="seconds: start no candidate that would end after this (0: no limit)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per candidate, alternating order (median kept)")
    parser.add_argument("--candidates", nargs="+", choices=CANDIDATES, default=list(CANDIDATES))
    parser.add_argument("--max_ranks", type=int, default=None,
                        help="largest ranks per node to try (default: 2 if this node has 2 or more cores)")
    parser.add_argument("--no_cache", action="store_true", help="print the table, do not cache the choice")
    parser.add_argument("--json", help="also write every candidate's result here")
    args = parser.parse_args(argv)
    startup.undo()  # the candidates set up their own processes
    cores = len(startup.node_cpus())
    max_ranks = args.max_ranks or (2 if cores >= 2 else 1)
    scratch = tempfile.mkdtemp(prefix="tfdist-tune-")
    rows, onednn_default, began = [], None, time.perf_counter()
    names = [n for n in CANDIDATES if n in args.candidates]
    if "defaults" in names:
        names.remove("defaults")
        names.insert(0, "defaults")
    plan_rows, skipped = [], []
    for name in names:
        ranks, choice = candidate_settings(name, onednn_default)
        if ranks > max_ranks or args.global_batch % ranks:
            continue
        if name == "plan" and onednn_default is not None:
            same = "defaults" if onednn_default else "onednn_flip"
            print(f"tfdist-tune: plan: skipped, the same settings as {same} on this machine", flush=True)
            continue
        plan_rows.append((name, ranks, choice))
        if name == "defaults":  # learn TensorFlow's own oneDNN choice first: it decides the others
            first = measure(name, ranks, choice, args, scratch, repeat=1)
            onednn_default = first["in_effect"].get("onednn")
            rows.append(first)
    for repeat in range(1, args.repeats + 1):
        order = plan_rows if repeat % 2 else plan_rows[::-1]
        for name, ranks, choice in order:
            if name == "defaults" and repeat == 1:
                continue
            spent = time.perf_counter() - began
            per_candidate = spent / max(len(rows), 1)
            if args.budget and rows and spent + per_candidate > args.budget:
                skipped.append(f"{name} (repeat {repeat})")
                continue
            rows.append(measure(name, ranks, choice, args, scratch, repeat))
    if skipped:
        print(f"tfdist-tune: --budget {args.budget:g} s: skipped {', '.join(skipped)} "
              f"(about {per_candidate:.0f} s per candidate here; raise --budget to measure them)", flush=True)
    rows = merge_repeats(rows)
    if not rows:
        parser.error("no candidate fits (check --candidates, --max_ranks and --global_batch)")
    print("\n" + format_table(rows, args))
    print(f"\ntfdist-tune: {len(rows)} candidates in {time.perf_counter() - began:.0f} s")
    best_overall = max(rows, key=lambda r: r["images_per_sec"])
    for ranks in sorted({r["ranks"] for r in rows}):
        best = max((r for r in rows if r["ranks"] == ranks), key=lambda r: r["images_per_sec"])
        choice = best["choice"] or {"overrides": {"onednn": None, "pin": False}}
        if not args.no_cache:
            where = tuning_cache.save(model_signature(args), ranks, choice, rows)
            print(f"tfdist-tune: {ranks} rank(s) per node: {best['candidate']} ({best['settings']}) cached in {where}")
    print(f"tfdist-tune: fastest overall: {best_overall['candidate']} with {best_overall['ranks']} rank(s) per node "
          f"(launch with tfdist-run -np {best_overall['ranks']} per node)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": tuning_cache.machine_key(), "model": model_signature(args), "rows": rows,
                       "skipped": skipped, "seconds": round(time.perf_counter() - began, 1),
                       "date": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv}, f, indent=1)
    return 0


RANK_CANDIDATES = {1: ("defaults", "onednn_flip"), 2: ("ranks2", "ranks2_cycle1", "ranks2_nopin")}
WAIT_SECONDS = 900


def ensure_measured(local_rank, local_size):
    """`HorovodStrategy(tuning="measure")`, before `hvd.init()`: unless this machine has a cached
    choice for `local_size` ranks per node, local rank 0 runs tfdist-tune for that layout (ResNet50,
    or the arguments in TFDIST_TUNE_ARGS) while the node's other ranks wait for its result."""
    import shlex

    if tuning_cache.choice_for(local_size):
        return False
    if local_rank == 0:
        candidates = RANK_CANDIDATES.get(local_size)
        if not candidates:
            raise ValueError(f"tuning='measure' measures 1 or 2 ranks per node, not {local_size}; run tfdist-tune "
                             f"with --candidates of your choice, or use tuning=True")
        extra = shlex.split(os.environ.get("TFDIST_TUNE_ARGS", ""))
        main(["--candidates", *candidates, "--max_ranks", str(local_size), *extra])
        return True
    deadline = time.monotonic() + WAIT_SECONDS
    while not tuning_cache.choice_for(local_size):
        if time.monotonic() > deadline:
            raise TimeoutError(f"tuning='measure': local rank {local_rank} waited {WAIT_SECONDS} s for local rank 0's "
                               f"tfdist-tune result in {tuning_cache.path()}; see rank 0's output")
        time.sleep(1)
    return True


def format_table(rows, args):
    base = next((r["images_per_sec"] for r in rows if r["candidate"] == "defaults"), None)
    lines = [f"{model_signature(args)} on {tuning_cache.machine_key()}",
             "| candidate | ranks/node | settings | images/s (median) | runs | vs TF defaults |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['images_per_sec'] / base:.2f}x" if base else "-"
        runs = ", ".join(f"{x:.2f}" for x in r["runs"])
        lines.append(f"| {r['candidate']} | {r['ranks']} | {r['settings']} | {r['images_per_sec']:.2f} | {runs} | {ratio} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
