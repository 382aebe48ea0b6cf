"""Accuracy beside speed: the digits task trained on 2 ranks with each gradient compression.

    python scripts/examples/make_digits_dataset.py /tmp/digits
    .venv/bin/python scripts/benchmarks/compression_accuracy.py --data /tmp/digits --methods none powersgd:4 topk:0.01 \\
        --repeats 2 --epochs 20 --target 0.9 --out docs/benchmarks/compression-accuracy-2026-11-24

Each run is `horovodrun -np 2 --gloo tfdist-benchmark --model mnist_cnn ... --epochs N
[--compression M]`, every epoch trained (no early stop) and evaluated on the test set. Methods run
once per repeat, in alternating order. Per method: epochs and seconds until the test accuracy
first reached --target, the final accuracy and its difference from the uncompressed runs' mean.
Writes <out>.json (every epoch of every run, the commands, `lscpu`'s model) and <out>.md.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)


def run(method, args, out_json):
    command = [os.path.join(BIN, "horovodrun"), "-np", "2", "--gloo", os.path.join(BIN, "tfdist-benchmark"),
               "--model", "mnist_cnn", "--image_size", "32", "--num_classes", "10", "--batch_size", "32",
               "--learning_rate", str(args.learning_rate), "--data_dir", os.path.join(args.data, "train"),
               "--eval_dir", os.path.join(args.data, "test"), "--epochs", str(args.epochs), "--json", out_json]
    if method != "none":
        command += ["--compression", method]
    started = time.time()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=args.run_timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{method}: exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(out_json) as f:
        result = json.load(f)
    epochs = result["epochs"]
    reached = next((e for e in epochs if (e["test_accuracy"] or 0) >= args.target), None)
    return {"method": method, "command": command, "wall_seconds": round(time.time() - started, 1),
            "epochs": epochs, "final_accuracy": epochs[-1]["test_accuracy"],
            "best_accuracy": max(e["test_accuracy"] for e in epochs),
            "epochs_to_target": reached["epoch"] if reached else None,
            "seconds_to_target": round(reached["seconds"], 1) if reached else None,
            "seconds_per_epoch": round(epochs[-1]["seconds"] / len(epochs), 2)}


def table(runs, args):
    base = [r["final_accuracy"] for r in runs if r["method"] == "none"]
    base = statistics.mean(base) if base else None
    lines = [f"digits (mnist_cnn, 32x32), 2 ranks, global batch 64, lr {args.learning_rate}, {args.epochs} epochs, "
             f"target {args.target}", "",
             "| method | run | epochs to target | seconds to target | final accuracy | vs uncompressed mean | "
             "best accuracy | s/epoch |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        delta = f"{(r['final_accuracy'] - base) * 100:+.2f} points" if base is not None else "-"
        lines.append(f"| {r['method']} | {r['repeat']} | {r['epochs_to_target'] or 'not reached'} | "
                     f"{r['seconds_to_target'] or '-'} | {r['final_accuracy']:.4f} | {delta} | "
                     f"{r['best_accuracy']:.4f} | {r['seconds_per_epoch']} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="scripts/examples/make_digits_dataset.py's output (train/, test/)")
    parser.add_argument("--methods", nargs="+", default=["none", "powersgd:4", "topk:0.01"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--learning_rate", type=float, default=0.01)
    parser.add_argument("--run_timeout", type=float, default=900)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    cpu = next((l.split(":", 1)[1].strip() for l in subprocess.run(["lscpu"], capture_output=True, text=True)
                .stdout.splitlines() if l.startswith("Model name")), "?")
    meta = {"command": " ".join([sys.executable, *sys.argv]), "cpu": cpu, "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "args": vars(args)}
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for method in (args.methods if repeat % 2 == 0 else args.methods[::-1]):
                result = run(method, args, os.path.join(scratch, "result.json"))
                runs.append({**result, "repeat": repeat + 1})
                print(f"repeat {repeat + 1} {method}: final {result['final_accuracy']:.4f}, target after "
                      f"{result['epochs_to_target']} epochs / {result['seconds_to_target']} s", flush=True)
                with open(f"{args.out}.json", "w") as f:
                    json.dump({**meta, "runs": runs}, f, indent=1)
    with open(f"{args.out}.md", "w") as f:
        f.write(f"Command ({meta['date']}, {meta['cpus']} vCPUs {cpu}):\n\n    {meta['command']}\n\n{table(runs, args)}")
    print(table(runs, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
