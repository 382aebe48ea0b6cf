"""Ranks that wait in different collectives, and a slow step that is not a hang (tfdist.faults.hang_detector).

    TFDIST_HANG_WARN_SECONDS=5 TFDIST_HANG_TIMEOUT=12 \
        horovodrun -np 2 --gloo python tests/multirank/hang_checks.py --out DIR --mode hang

Every rank trains a tiny model under `HorovodStrategy()` for one short epoch. Modes:
  - hang: then rank 0 enters an eager allreduce ('tfdist.test.only_rank0') and rank 1 an eager
    allgather ('tfdist.test.only_rank1'), each writing `DIR/entered<rank>` (time.time() just
    before) and the warn bound in effect; the detector must end the job;
  - slow: rank 1's train step 3 sleeps SLOW_SECONDS inside the step (a tf.py_function), while
    rank 0 waits for it in the same step's gradient allreduce: not a hang. Each rank writes
    rank<R>.json with the longest mark before that step.
  - uneven: the ranks fit arrays of different lengths (rank 1 has two global batches more) under
    the global-batch convention, against its contract. Sharded by DATA, no partial-batch check
    pads the short rank, so rank 1 waits alone in a step's allreduce while rank 0 has gone on to
    the epoch's end: the detector must name both and end the job.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import keras_module, quiet_tensorflow, worker_parser, write_results  # noqa: E402

quiet_tensorflow()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402
from tfdist import collectives  # noqa: E402
from tfdist.faults import hang
from tfdist.faults import hang_detector

keras = keras_module()
STEPS = 10
SLOW_STEP = 3
SLOW_SECONDS = 8.0


def sleeper(rank):
    """A layer that sleeps SLOW_SECONDS on rank 1 in its SLOW_STEP-th call, inside the step."""
    calls = [0]

    def nap(x):
        calls[0] += 1
        if rank == 1 and calls[0] == SLOW_STEP:
            time.sleep(SLOW_SECONDS)
        return x

    class Sleep(keras.layers.Layer):
        def call(self, x):
            y = tf.py_function(nap, [x], x.dtype)
            y.set_shape(x.shape)
            return y

    return Sleep()


class BeforeSlowStep(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.longest = None

    def on_train_batch_begin(self, batch, logs=None):
        if batch + 1 == SLOW_STEP:
            self.longest = hang.snapshot()["longest"]


def main():
    parser = worker_parser()
    parser.add_argument("--mode", choices=("hang", "slow", "uneven"), required=True)
    args = parser.parse_args()
    strategy = tfdist.HorovodStrategy(tuning=False)
    rank = strategy.rank
    with strategy.scope():
        layers = [keras.Input((4,)), keras.layers.Dense(1)]
        if args.mode == "slow":
            layers.insert(1, sleeper(rank))
        model = keras.Sequential(layers)
        model.compile(optimizer="sgd", loss="mse")
    x = np.ones((8 * (STEPS + (4 if args.mode == "uneven" and rank == 1 else 0)), 4), "float32")
    y = x[:, :1].copy()
    before = BeforeSlowStep()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[before])
    if args.mode == "uneven":
        model.evaluate(x, y, batch_size=8, verbose=0)  # a collective at its end: where rank 0 waits
        write_results(args.out, rank, {"finished": True})  # never reached on both ranks
        return
    if args.mode == "slow":
        write_results(args.out, rank, {"finished": True, "longest_before_slow_step": before.longest,
                                       "slow_seconds": SLOW_SECONDS})
        return
    warn, _ = hang_detector.settings()
    record = {"time": time.time(), "bound": max(warn, hang_detector.STEP_FACTOR * hang.snapshot()["longest"])}
    with open(os.path.join(args.out, f"entered{rank}"), "w") as f:
        json.dump(record, f)
    print(f"rank {rank} enters its collective: {record}", flush=True)
    if rank == 0:
        collectives.allreduce([tf.ones(3)], name="tfdist.test.only_rank0")
    else:
        collectives.allgather(tf.ones([2]), name="tfdist.test.only_rank1")
    write_results(args.out, rank, {"finished": True})  # never reached: the detector ends the job


if __name__ == "__main__":
    main()
