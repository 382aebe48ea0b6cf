"""Distributed reading checks under horovodrun: which record ids each rank sees.

    horovodrun -np 2 --gloo python tests/multirank/pipeline_checks.py --data DIR [DIR ...] --out OUT
    horovodrun -np 2 --gloo python tests/multirank/pipeline_checks.py --corrupt DIR [DIR ...] --out OUT

`--corrupt` datasets hold bad records: each is read with `skip_corrupt=True` in training for two
epochs of `steps_per_epoch` steps, recording the ids and the skip report of each epoch.
"""

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import LogMessages, quiet_tensorflow, worker_parser, write_results  # noqa: E402

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


def skipping_epochs(strategy, data_dir, epochs=2, batch_size=5):
    plans, messages, logger = [], LogMessages(), logging.getLogger("tfdist.pipelines")
    logger.addHandler(messages)
    logger.setLevel(logging.INFO)

    def dataset_fn(ctx):
        ds, plan = read_dataset(data_dir, batch_size, input_context=ctx, training=True, skip_corrupt=True,
                                seed=5, shuffle_buffer=16)
        plans.append(plan)
        return ds

    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
    logger.removeHandler(messages)
    plan = plans[0]
    out = {"steps": plan.steps_per_epoch, "good": plan.good_records, "mode": plan.mode, "epochs": [],
           "log": messages.texts}
    for _ in range(epochs):
        ids = []
        for _ in range(plan.steps_per_epoch):
            ids += strategy.experimental_local_results(next(iterator))[0]["id"].numpy().tolist()
        out["epochs"].append({"ids": ids, "skipped": plan.skipped.report()})
        plan.skipped.reset()
    return out


def main():
    parser = worker_parser()
    parser.add_argument("--data", nargs="+", default=[])
    parser.add_argument("--corrupt", nargs="+", default=[])
    args = parser.parse_args()
    strategy = tfdist.HorovodStrategy()
    results = {}
    for data_dir in args.data:
        name = os.path.basename(data_dir)
        results[name] = {"eval": ids_seen(strategy, data_dir, False), "train": ids_seen(strategy, data_dir, True)}
    for data_dir in args.corrupt:
        results[os.path.basename(data_dir)] = skipping_epochs(strategy, data_dir)
    write_results(args.out, strategy.rank, results)


if __name__ == "__main__":
    main()
