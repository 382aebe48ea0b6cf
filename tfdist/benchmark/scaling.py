"""Run tfdist-benchmark for several configurations side by side and tabulate them.

    tfdist-scaling --ranks 1 2 --modes none tfdist horovod --repeats 3 \\
        --global_batch 16 -- --model resnet50 --num_batches 6

Every configuration runs once per repeat, in alternating order, so a noisy shared machine
affects all of them alike. Each (mode, ranks) keeps the same global batch (per-replica batch =
global / ranks). Writes a markdown table (median, min, max images/s, efficiency against the
1-rank run of the same mode, the median step and, with none@core, the overhead), a PNG plot
(median with min-max bars per mode, against ranks) and a JSON file with every run (each run's
header, the settings in effect as TensorFlow reported them, and every step time, warm-up included
and marked). Modes tfdist, horovod and mwms run under horovodrun (mwms derives its TF_CONFIG from
it) over Gloo; a mode ending in `@mpirun` (`tfdist@mpirun`) runs under Open MPI's
mpirun instead (`tfdist-run --launcher mpirun`; Horovod's MPI controller and collectives); none runs
as one plain process (once a repeat, whatever --ranks say), and `none@core` as one plain process on
one core (the first this command may use) at the per-rank batch of the largest rank count: the
compute a rank does, without the exchange. With it, the table gives every multi-rank run's
per-step overhead, its median step less that one's:

    tfdist-scaling --ranks 1 2 --modes none none@core tfdist horovod --global_batch 64 -- --model mnist_cnn ...

A mode may start with variables for its runs, as a shell line does:
`"OMPI_MCA_mpi_yield_when_idle=0 tfdist@mpirun"`.
"""

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

BIN = os.path.dirname(sys.executable)


def parse_mode(mode):
    """A mode -> (variables, --variable_update value, launcher, Keras flavour, options of its own).

    "HOROVOD_CYCLE_TIME=40 tfdist:tf_keras@mpirun --no_tuning" -> ({"HOROVOD_CYCLE_TIME": "40"},
    "tfdist", "mpirun", "tf_keras", ["--no_tuning"]); no launcher: "" (horovodrun --gloo)."""
    words = shlex.split(mode)
    variables = {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        variables[name] = value
    if not words:
        sys.exit(f"mode {mode!r}: no --variable_update value after its variables")
    update, *own_args = words
    update, _, launcher = update.partition("@")
    if launcher not in ("", "mpirun", "core"):
        sys.exit(f"mode {mode!r}: the launcher after @ can only be mpirun (default: horovodrun --gloo), or core "
                 "after none")
    update, _, flavour = update.partition(":")
    if launcher == "core" and update != "none":
        sys.exit(f"mode {mode!r}: @core runs one plain process: none@core")
    return variables, update, launcher, flavour, own_args


def run_one(mode, ranks, global_batch, extra, out_json):
    """One benchmark run; `mode` is a --variable_update value, optionally ':tf_keras' or ':keras3',
    optionally '@mpirun', optionally followed by benchmark options of its own: "tfdist --num_inter_threads 2",
    optionally after variables for this run: "HOROVOD_CYCLE_TIME=40 tfdist" (`parse_mode`)."""
    variables, mode, launcher, flavour, own_args = parse_mode(mode)
    flavour_args = ["--keras", flavour] if flavour else []
    bench = [sys.executable, "-m", "tfdist.benchmark.train_benchmark", "--variable_update", mode, *flavour_args,
             "--batch_size", str(global_batch // ranks), "--json", out_json, *extra, *own_args]
    pin = None
    if mode == "none":
        command = bench
        if launcher == "core":
            first = min(os.sched_getaffinity(0))
            pin = lambda: os.sched_setaffinity(0, {first})  # noqa: E731  (in the child, before it starts)
    elif launcher == "mpirun":
        command = [os.path.join(BIN, "tfdist-run"), "--launcher", "mpirun", "-np", str(ranks), *bench]
    else:
        command = [os.path.join(BIN, "horovodrun"), "-np", str(ranks), "--gloo", *bench]
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, **variables}, preexec_fn=pin)
    if done.returncode != 0:
        sys.exit(f"benchmark failed (exit {done.returncode}): {' '.join(command)}\n{done.stdout[-4000:]}")
    with open(out_json) as f:
        result = json.load(f)
    result["command"] = command
    if variables:
        result["variables"] = variables
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--modes", nargs="+", default=["none", "tfdist", "horovod"],
                        help="--variable_update values, optionally with a Keras flavour (tfdist:tf_keras), a "
                             "launcher (tfdist@mpirun), options of their own and, first, variables (quoted: "
                             "'HOROVOD_CYCLE_TIME=40 tfdist --no_tuning')")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--global_batch", type=int, default=32)
    parser.add_argument("--out", default="scaling")
    parser.add_argument("extra", nargs="*", help="after --: arguments for tfdist-benchmark")
    args = parser.parse_args()
    from tfdist.tuning import startup

    startup.undo()  # each benchmark process applies its own settings (or none)
    # none runs once, as one process, whatever --ranks say: the baseline of every rank count
    configs = [(m, r) for m in args.modes for r in ([1] if parse_mode(m)[1] == "none" else args.ranks)]
    one_core = next((m for m in args.modes if parse_mode(m)[2] == "core"), None)  # the overheads' baseline
    runs = {f"{m}/{r}": [] for m, r in configs}
    results = {f"{m}/{r}": [] for m, r in configs}
    scratch = tempfile.mkdtemp(prefix="tfdist-scaling-")
    for repeat in range(args.repeats):
        order = configs if repeat % 2 == 0 else configs[::-1]
        for mode, ranks in order:
            batch = args.global_batch // max(args.ranks) if parse_mode(mode)[2] == "core" else args.global_batch
            result = run_one(mode, ranks, batch, args.extra, os.path.join(scratch, "r.json"))
            rate = result["total_images_per_sec"]
            runs[f"{mode}/{ranks}"].append(rate)
            results[f"{mode}/{ranks}"].append({**result, "repeat": repeat + 1})
            print(f"repeat {repeat + 1}: {mode:24s} {ranks} rank(s): {rate:8.2f} images/s", flush=True)
    lines = ["| mode | ranks | global batch | median images/s | min | max | vs 1 rank of this mode | median step ms "
             "| overhead ms |", "|---|---|---|---|---|---|---|---|---|"]
    steps = {config: statistics.median(step_ms(r) for r in rs) for config, rs in results.items()}
    core = steps[f"{one_core}/1"] if one_core else None
    for mode, ranks in configs:
        rates = runs[f"{mode}/{ranks}"]
        base = runs.get(f"{mode}/1")
        ratio = f"{statistics.median(rates) / statistics.median(base):.2f}x" if base else "-"
        step = steps[f"{mode}/{ranks}"]
        overhead = f"{step - core:.2f}" if core is not None and ranks > 1 else "-"
        lines.append(f"| {mode} | {ranks} | {results[f'{mode}/{ranks}'][0]['global_batch']} | "
                     f"{statistics.median(rates):.2f} | {min(rates):.2f} | {max(rates):.2f} | {ratio} | {step:.2f} | "
                     f"{overhead} |")
    table = "\n".join(lines)
    print("\n" + table)
    with open(f"{args.out}.md", "w") as f:
        f.write(table + "\n")
    with open(f"{args.out}.json", "w") as f:
        json.dump({"command": shlex.join(sys.argv),
                   "environment": {k: v for k, v in os.environ.items() if k.startswith(("ONEDNN_", "DNNL_", "TF_", "OMP_", "KMP_", "HOROVOD_", "TFDIST_"))}, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "runs": runs, "args": vars(args), "every_run": results}, f, indent=1)
    plot(runs, configs, args, f"{args.out}.png")


def step_ms(result):
    """The median of a run's timed steps (warm-up excluded), in ms."""
    return statistics.median(result["step_seconds"][result["warmup_steps_excluded"]:]) * 1000


def plot(runs, configs, args, path):
    """Median images/s per mode against ranks, min-max as error bars."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no PNG plot: matplotlib is not installed (scripts/bootstrap.sh installs it)")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in dict.fromkeys(m for m, _ in configs):
        ranks = [r for m, r in configs if m == mode]
        rates = [runs[f"{mode}/{r}"] for r in ranks]
        medians = [statistics.median(x) for x in rates]
        errors = [[m - min(x) for m, x in zip(medians, rates)], [max(x) - m for m, x in zip(medians, rates)]]
        ax.errorbar(ranks, medians, yerr=errors, marker="o", capsize=4, label=mode)
    ax.set_xlabel("ranks (processes)")
    ax.set_ylabel("images/s (median, min-max)")
    ax.set_xticks(sorted({r for _, r in configs}))
    ax.set_ylim(bottom=0)
    ax.set_title(f"global batch {args.global_batch}, {args.repeats} repeats", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
