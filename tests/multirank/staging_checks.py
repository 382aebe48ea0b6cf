"""Node-local staging checks: local rank 0 copies, the others wait, then every rank reads its share.

    horovodrun -np 2 --gloo python tests/multirank/staging_checks.py --source DIR --local DIR --out OUT
    SLURM_LOCALID=1 python tests/multirank/staging_checks.py --plain --source DIR --local DIR --out OUT

Under horovodrun the dataset is staged twice: before Horovod starts (local rank from
$HOROVOD_LOCAL_RANK) and after (local rank from Horovod). `--plain` stages once, without Horovod,
and names its result file after the local rank.
"""

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import quiet_tensorflow, worker_parser, write_results  # noqa: E402

quiet_tensorflow()

import tensorflow as tf  # noqa: E402

from tfdist.pipelines import read_dataset  # noqa: E402
from tfdist.pipelines.staging import LOCAL_RANK_VARIABLES, stage_dataset  # noqa: E402


class StagingStats(logging.Handler):
    """Collects the statistics that stage_dataset attaches to its log record."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.calls = []

    def emit(self, record):
        if hasattr(record, "staging"):
            self.calls.append(record.staging)


def main():
    parser = worker_parser()
    parser.add_argument("--source", required=True)
    parser.add_argument("--local", required=True)
    parser.add_argument("--plain", action="store_true", help="no Horovod")
    parser.add_argument("--timeout", type=float, default=120)
    args = parser.parse_args()
    stats = StagingStats()
    logger = logging.getLogger("tfdist.pipelines")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(stats)

    before = stage_dataset(args.source, args.local, timeout=args.timeout)
    results = {"before_init": stats.calls[-1], "manifest": before.to_json(), "directory": before.directory}
    if args.plain:
        write_results(args.out, stats.calls[-1]["local_rank"], results)
        return

    import tfdist

    strategy = tfdist.HorovodStrategy()
    for name in LOCAL_RANK_VARIABLES:  # from here on, a local rank read from the environment shows as 99
        os.environ[name] = "99"
    after = stage_dataset(args.source, args.local, timeout=args.timeout)
    context = tf.distribute.InputContext(strategy.size, strategy.rank, 1)
    ds, plan = read_dataset(after.directory, 4, input_context=context, training=False)
    results.update(
        after_init=stats.calls[-1],
        manifest_after_init=after.to_json(),
        rank=strategy.rank,
        local_rank=strategy.local_rank,
        ids=[int(i) for batch in ds for i in batch["id"].numpy()],
        files_read=[path for path, _, _ in plan.segments],
    )
    write_results(args.out, strategy.rank, results)


if __name__ == "__main__":
    main()
