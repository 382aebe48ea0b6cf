"""Distributed reading checks under horovodrun: which record ids each rank sees.

    horovodrun -np 2 --gloo python tests/multirank/pipeline_checks.py --data DIR [DIR ...] --out OUT
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import quiet_tensorflow, write_results  # noqa: E402

quiet_tensorflow()

import tfdist  # noqa: E402
from tfdist.pipelines import read_dataset  # noqa: E402


def ids_seen(strategy, data_dir, training, batch_size=4):
    plans = []

    def dataset_fn(ctx):
        ds, plan = read_dataset(data_dir, batch_size, input_context=ctx, training=training, seed=5)
        plans.append(plan)
        return ds

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    ids = []
    iterator = iter(dist)
    steps = plans[0].steps_per_epoch if training else None
    for step, batch in enumerate(iterator):
        if steps is not None and step == steps:
            break
        ids += strategy.experimental_local_results(batch)[0]["id"].numpy().tolist()
    return {"ids": ids, "mode": plans[0].mode, "steps": plans[0].steps_per_epoch}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", nargs="+", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    strategy = tfdist.HorovodStrategy()
    results = {}
    for data_dir in args.data:
        name = os.path.basename(data_dir)
        results[name] = {"eval": ids_seen(strategy, data_dir, False), "train": ids_seen(strategy, data_dir, True)}
    write_results(args.out, strategy.rank, results)


if __name__ == "__main__":
    main()
