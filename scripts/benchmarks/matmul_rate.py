"""The machine's own float32 and bfloat16 rates: a square tf.matmul on every core, best of a few.

    .venv/bin/python scripts/benchmarks/matmul_rate.py                   # 4096x4096, both precisions
    .venv/bin/python scripts/benchmarks/matmul_rate.py --json rates.json

Efficiency figures in docs/PERFORMANCE.md are quoted against these rates (a training step's
GFLOP per second over the matmul's), measured on the same machine in the same session, rather
than against a clock-times-lanes ceiling: the clock under load, the vector units and what oneDNN
runs for bfloat16 all differ between the CPUs this project is measured on. TensorFlow's settings
are left as tfdist's tuning sets them before TensorFlow loads (oneDNN on where it helps).
Prints one line per precision and, with --json, writes {"float32": GFLOP/s, "bfloat16": ...}.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tfdist  # noqa: E402,F401  (tfdist's settings, before TensorFlow loads)


def matmul_rate(tf, dtype, size, repeats):
    """GFLOP/s of the best of `repeats` timed size x size matmuls in `dtype` (after one untimed)."""
    a = tf.cast(tf.random.normal((size, size), seed=1), dtype)
    b = tf.cast(tf.random.normal((size, size), seed=2), dtype)
    # The sum makes the product's every element needed; its cost is size**2, against size**3.
    step = tf.function(lambda a, b: tf.reduce_sum(tf.cast(tf.matmul(a, b), tf.float32)))
    step(a, b).numpy()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        step(a, b).numpy()
        best = min(best, time.perf_counter() - started)
    return 2.0 * size ** 3 / best / 1e9


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the rates here")
    args = parser.parse_args(argv)
    import tensorflow as tf

    rates = {name: round(matmul_rate(tf, getattr(tf, name), args.size, args.repeats), 1)
             for name in ("float32", "bfloat16")}
    for name, rate in rates.items():
        print(f"{name} matmul {args.size}x{args.size}, {os.cpu_count()} cpus: {rate:.1f} GFLOP/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rates, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
