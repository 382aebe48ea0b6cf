"""Loss scaling under HorovodStrategy: an overflow on one rank must be skipped by all ranks.

    horovodrun -np 2 --gloo python tests/multirank/precision_checks.py --out DIR

Rank 1's third batch holds an inf, so only rank 1's local gradients are non-finite at step 3.
Each rank records, after every step, the loss scale and a weight checksum.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import keras_module, quiet_tensorflow, worker_parser, write_results  # noqa: E402

quiet_tensorflow()

import numpy as np  # noqa: E402

import tfdist  # noqa: E402

keras = keras_module()
STEPS, BATCH, BAD_STEP = 6, 8, 2  # global batch; 0-based step whose rank-1 half holds an inf


class Record(keras.callbacks.Callback):
    def __init__(self, optimizer):
        super().__init__()
        self.optimizer_ = optimizer
        self.steps = []

    def on_train_batch_end(self, batch, logs=None):
        scale = self.optimizer_.dynamic_scale if hasattr(self.optimizer_, "dynamic_scale") else self.optimizer_.loss_scale
        self.steps.append({
            "scale": float(np.asarray(scale)),
            "weights": [w.tolist() for w in self.model.get_weights()],
        })


def main():
    args = worker_parser().parse_args()
    strategy = tfdist.HorovodStrategy()
    rng = np.random.default_rng(strategy.rank)
    x = rng.normal(size=(STEPS * BATCH, 3)).astype("float32")
    y = rng.normal(size=(STEPS * BATCH, 1)).astype("float32")
    if strategy.rank == 1:
        x[BAD_STEP * BATCH + BATCH - 1] = np.inf  # the last row of a global batch is rank 1's
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        optimizer = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(0.01))
        model.compile(optimizer=optimizer, loss="mse")
    record = Record(optimizer)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[record])
    write_results(args.out, strategy.rank, {"steps": record.steps})


if __name__ == "__main__":
    main()
