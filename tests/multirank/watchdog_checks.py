"""A rank dies mid-epoch: the test kills it (or it raises); the others must exit naming it.

    horovodrun -np 2 --gloo python tests/multirank/watchdog_checks.py --out DIR --mode train

Every rank trains a tiny model for far longer than any test waits. After step 20 each rank
writes `DIR/ready<rank>` holding its pid, so the test knows training is under way and whom to
kill. `--mode raise`: rank 1 raises at step 20 instead. `--mode finish`: a short run in which
rank 1 ends first and rank 0 keeps going for 4 heartbeats; both must exit 0.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import keras_module, quiet_tensorflow, write_results  # noqa: E402

quiet_tensorflow()

import numpy as np  # noqa: E402

import tfdist  # noqa: E402

keras = keras_module()
READY_STEP = 20


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
            raise RuntimeError(f"injected failure on rank 1 at step {batch}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=("train", "raise", "finish"), default="train")
    args = parser.parse_args()
    strategy = tfdist.HorovodStrategy(tuning=False)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    steps = 2 * READY_STEP if args.mode == "finish" else 1_000_000
    x = np.ones((8 * steps, 4), "float32")
    model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0, shuffle=False,
              callbacks=[Milestones(strategy, args.out, args.mode)])
    if args.mode == "finish" and strategy.rank == 0:
        time.sleep(4)  # rank 1 has left (with a goodbye); the watchdog must not report it
    write_results(args.out, strategy.rank, {"finished": True})


if __name__ == "__main__":
    main()
