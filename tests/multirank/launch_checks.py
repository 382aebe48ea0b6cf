"""Train a tiny model under whatever launcher started this process, and record what Horovod saw.

    SLURM_PROCID=0 SLURM_STEP_NUM_TASKS=2 ... python tests/multirank/launch_checks.py --out DIR
    tfdist-run -np 2 python tests/multirank/launch_checks.py --out DIR
    python tests/multirank/launch_checks.py --out DIR --reference     # 1 process, same global batch

    TF_CONFIG='{"cluster": ...}' python tests/multirank/launch_checks.py --out DIR   # x each task

Each rank writes DIR/rank<R>.json with its topology, the HOROVOD_* variables it ran with, the
TF_CONFIG it saw, its replicas and cluster resolver, and the final weights; tests/test_launch.py compares the ranks with each other and with the reference.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import keras_module, worker_parser, write_results  # noqa: E402
from train_checks import PER_RANK_BATCH, RANKS, STEPS, build_model, loss_fn, make_data  # noqa: E402

import tfdist  # noqa: E402

TF_CONFIG_AT_START = os.environ.get("TF_CONFIG")  # what a script that reads it at the top sees

keras = keras_module()


def main():
    args = worker_parser(reference=True).parse_args()
    strategy = tfdist.HorovodStrategy(tuning=False)
    hvd = tfdist.collectives.horovod()
    rank, size = strategy.rank, strategy.size
    batch = PER_RANK_BATCH * RANKS  # the global batch, split across ranks by the strategy
    x, y = make_data("dense", PER_RANK_BATCH * RANKS * STEPS)
    with strategy.scope():
        model = build_model("dense", seed=100 + rank)  # ranks start different; the broadcast aligns them
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss=loss_fn())
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    write_results(args.out, rank, {
        "topology": {"rank": rank, "size": size, "local_rank": hvd.local_rank(),
                     "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(),
                     "cross_size": hvd.cross_size()},
        "horovod_env": {k: v for k, v in os.environ.items() if k.startswith(("HOROVOD_", "NCCL_"))},
        "startup": tfdist.tuning.startup.state(), "cpus": sorted(os.sched_getaffinity(0)),
        "intra_op_threads": tfdist.tuning.plan.in_effect()["intra_op_threads"],
        "replicas": strategy.num_replicas_in_sync, "is_chief": strategy.is_chief,
        "resolver": [strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id],
        "tf_config_at_start": TF_CONFIG_AT_START, "tf_config": os.environ.get("TF_CONFIG"),
        "steps": int(model.optimizer.iterations.numpy()),
        "final": [w.tolist() for w in model.get_weights()],
    })


if __name__ == "__main__":
    main()
