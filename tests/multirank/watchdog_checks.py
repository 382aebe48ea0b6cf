"""A rank dies mid-epoch: the test kills it (or it raises); the others must exit naming it.

    horovodrun -np 2 --gloo python tests/multirank/watchdog_checks.py --out DIR --mode train

Every rank trains a tiny model for far longer than any test waits. After step 20 each rank
writes `DIR/ready<rank>` holding its pid, so the test knows training is under way and whom to
kill or interrupt (SIGINT). Modes:
  - raise: rank 1 raises a two-line ValueError at step 20 (with --slow_stderr S, its own
    excepthook takes S seconds before printing the traceback, as a slow stderr would);
  - exit: rank 1 calls sys.exit(3) at step 20;
  - nonfinite: rank 1's batches from step 5 on hold NaNs, and
    StopOnNonFiniteLoss(action="raise") raises NonFiniteLossError on both ranks (uncaught);
  - finish: a short run in which rank 1 ends first and rank 0 keeps going for 4 heartbeats;
    both must exit 0.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import keras_module, quiet_tensorflow, worker_parser, write_results  # noqa: E402

quiet_tensorflow()

import numpy as np  # noqa: E402

import tfdist  # noqa: E402

keras = keras_module()
READY_STEP = 20
NAN_STEP = 5
FIRST_LINE = "first line: rank 1 fails at step 20"
LAST_LINE = "second line: the real cause is injected on rank 1"


class Milestones(keras.callbacks.Callback):
    def __init__(self, strategy, out, mode):
        super().__init__()
        self.strategy, self.out, self.mode = strategy, out, mode

    def on_train_batch_end(self, batch, logs=None):
        if batch != READY_STEP:
            return
        rank = self.strategy.rank
        path = os.path.join(self.out, f"ready{rank}")
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)
        print(f"rank {rank} (pid {os.getpid()}) reached step {batch}", flush=True)
        if self.mode == "raise" and rank == 1:
            raise ValueError(f"{FIRST_LINE}\n{LAST_LINE}")
        if self.mode == "exit" and rank == 1:
            sys.exit(3)


def main():
    parser = worker_parser()
    parser.add_argument("--mode", choices=("train", "raise", "exit", "nonfinite", "finish"),
                        default="train")
    parser.add_argument("--slow_stderr", type=float, default=0.0)
    args = parser.parse_args()
    if args.slow_stderr and os.environ.get("HOROVOD_RANK") == "1":
        def slow_excepthook(exc_type, exc, tb):
            time.sleep(args.slow_stderr)
            sys.__excepthook__(exc_type, exc, tb)

        sys.excepthook = slow_excepthook  # the watchdog's hook, installed later, chains to it
    strategy = tfdist.HorovodStrategy(tuning=False)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    steps = 2 * READY_STEP if args.mode in ("finish", "nonfinite") else 1_000_000
    x = np.ones((8 * steps, 4), "float32")
    y = x[:, :1].copy()
    callbacks = [Milestones(strategy, args.out, args.mode)]
    if args.mode == "nonfinite":
        from tfdist.callbacks import StopOnNonFiniteLoss

        if strategy.rank == 1:
            y[8 * NAN_STEP:] = np.nan  # rank 1's batches from NAN_STEP on, however batches split
        callbacks = [StopOnNonFiniteLoss(action="raise")]
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=callbacks)
    if args.mode == "finish" and strategy.rank == 0:
        time.sleep(4)  # rank 1 has left (with a goodbye); the watchdog must not report it
    write_results(args.out, strategy.rank, {"finished": True})


if __name__ == "__main__":
    main()
