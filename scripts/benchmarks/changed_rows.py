"""A sharded table's update gathered as its changed rows against as its whole slices, one node.

    .venv/bin/python scripts/benchmarks/changed_rows.py --ranks 2 --rows 200000 --width 64 \\
        --fractions 1 0.5 0.1 0.01 --out changed_rows

Under `shard_optimizer_state=True` and an optimizer that changes only its gradient's rows (plain
SGD, Adagrad), a variable with a sparse gradient (an embedding table) sends the rows of its slice
that changed in the update (`tfdist.exchange.changed_rows`); other variables, and every variable
under momentum or Adam, all-gather their whole slices. This times both on one table, with a given fraction of
its rows changed in every step (plain SGD and Adagrad change the rows looked up; momentum and
Adam, over a long run, nearly all): per step, each rank adds to that fraction of its slice's rows
and the table is made whole again on every rank, either way. The two ways alternate in blocks of
--steps steps, --repeats times; the result is each way's median step time and whole / rows.
Every rank must end with the same table both ways (checked). Writes <out>.json and <out>.md.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time


def worker(args):
    import numpy as np
    import tensorflow as tf

    import tfdist
    from tfdist.exchange import changed_rows, sharded

    strategy = tfdist.HorovodStrategy(tuning=False)
    rank, ranks = strategy.rank, strategy.size
    initial = np.random.default_rng(0).normal(size=(args.rows, args.width)).astype("float32")
    tables = {way: tf.Variable(initial) for way in ("whole", "rows")}
    slices = {way: sharded.VariableSlice(table, ranks, rank) for way, table in tables.items()}

    def step_of(way):
        table, variable_slice = tables[way], slices[way]

        @tf.function
        def step(delta):
            before = variable_slice.take(table)
            after = before + delta
            if way == "whole":
                table.assign(variable_slice.whole(sharded.allgather([after])[0]))
            else:
                received = changed_rows.gathered([changed_rows.changed(before, after, variable_slice)])[0]
                changed_rows.write(table, received, variable_slice)
        return step

    steps = {way: step_of(way) for way in tables}
    results = []
    for fraction in args.fractions:
        length = slices["whole"].length
        start = rank * length
        rows = np.arange(start // args.width, min(args.rows, -(-(start + length) // args.width)))
        chosen = rows[np.random.default_rng(rank).random(len(rows)) < fraction]
        delta = np.zeros(length, "float32")
        for row in chosen:
            lo, hi = max(row * args.width, start), min((row + 1) * args.width, start + length)
            delta[lo - start:hi - start] = 1e-3
        delta = tf.reshape(tf.constant(delta), slices["whole"].slice_shape)
        for way in steps:
            steps[way](delta)  # traced outside the timing
        times = {way: [] for way in steps}
        for _ in range(args.repeats):
            for way, step in steps.items():
                started = time.perf_counter()
                for _ in range(args.steps):
                    step(delta)
                _ = tables[way][0, 0].numpy()
                times[way].append((time.perf_counter() - started) / args.steps * 1e3)
        same = bool(np.array_equal(tables["whole"].numpy(), tables["rows"].numpy()))
        results.append({"fraction": fraction, "rows_changed_on_this_rank": int(len(chosen)),
                        "whole_ms": times["whole"], "rows_ms": times["rows"], "tables_equal": same})
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "results": results}, f)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.5, 0.1, 0.01])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="changed_rows")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    command = [os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np", str(args.ranks), "--gloo",
               sys.executable, os.path.abspath(__file__), "--worker", *sys.argv[1:]]
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    subprocess.run(command, check=True)
    per_rank = []
    for rank in range(args.ranks):
        with open(f"{args.out}.rank{rank}.json") as f:
            per_rank.append(json.load(f))
        os.remove(f"{args.out}.rank{rank}.json")
    cpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "?")
    lines = [f"# Changed rows against whole slices: a [{args.rows}, {args.width}] float32 table, {args.ranks} ranks",
             "", f"{started}, {cpu} ({platform.machine()}), `{' '.join(['changed_rows.py', *sys.argv[1:]])}`", "",
             "| rows changed a step | whole slices ms (median) | changed rows ms (median) | whole / rows | "
             "every rank's tables equal |", "|---|---|---|---|---|"]
    for i, first in enumerate(per_rank[0]["results"]):
        whole = max(statistics.median(r["results"][i]["whole_ms"]) for r in per_rank)
        rows = max(statistics.median(r["results"][i]["rows_ms"]) for r in per_rank)
        equal = all(r["results"][i]["tables_equal"] for r in per_rank)
        lines.append(f"| {first['fraction']:.0%} | {whole:.2f} | {rows:.2f} | {whole / rows:.2f}x | {equal} |")
    lines += ["", "Each figure is the slowest rank's median over the repeats; every run is in the JSON."]
    with open(f"{args.out}.md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(f"{args.out}.json", "w") as f:
        json.dump({"command": sys.argv, "started": started, "cpu": cpu, "ranks": per_rank}, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
