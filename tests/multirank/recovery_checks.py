"""Recovery worker: a tiny digits MLP with a Checkpointer, killed on purpose, relaunched by tfdist-run.

    tfdist-run -np 2 --max-restarts 2 python tests/multirank/recovery_checks.py \
        --data DIR --ckpt DIR --out OUT --epochs 3

Fault injection (this test worker only): RECOVERY_TEST_KILL="restart:rank:epoch:step,..." makes
that rank SIGKILL itself at the start of that step (0-based epoch and step) of launch number
`restart` (TFDIST_RESTART). RECOVERY_TEST_GONE=FILE: the rank creates FILE just before it kills
itself (the test's discovery script then reports one slot fewer: "its host is gone").
RECOVERY_TEST_BACK="restart:epoch": rank 0 deletes that FILE again at the start of that epoch of
that launch (the host is back), and from then on takes 0.1 s a step, so that tfdist-run's grow
watcher sees it within the epoch. RECOVERY_TEST_REFERENCE=1: launch 0 first trains uninterrupted (checkpoints in CKPT-reference,
results in OUT/reference/).

Each rank appends "restart size epoch" to OUT/epochs-rank<r>.log at every epoch start, and at
the end writes OUT/rank<r>.json: the launch, size, epochs run, final variables and the test
accuracy of the final weights (numpy forward pass on the held-out digits).
"""

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import keras_module, quiet_tensorflow, worker_parser, write_results  # noqa: E402

quiet_tensorflow()

import numpy as np  # noqa: E402

import tfdist  # noqa: E402
from tfdist.callbacks import Checkpointer  # noqa: E402
from tfdist.callbacks.checkpoint import training_variables  # noqa: E402
from tfdist.pipelines import read_dataset  # noqa: E402
from tfdist.launch.recovery import restart_info  # noqa: E402

keras = keras_module()
GLOBAL_BATCH = 48  # divides by 3 and by 2: kept when a 3-rank job goes on with 2


def kills(restart, rank):
    """{(epoch, step)} at which this rank kills itself in this launch."""
    found = set()
    for item in filter(None, os.environ.get("RECOVERY_TEST_KILL", "").split(",")):
        k, r, epoch, step = map(int, item.split(":"))
        if (k, r) == (restart, rank):
            found.add((epoch, step))
    return found


class Faults(keras.callbacks.Callback):
    """Logs every epoch start; SIGKILLs this process at the planned steps."""

    def __init__(self, log_path, restart, size, rank):
        super().__init__()
        self.log_path, self.restart, self.size = log_path, restart, size
        self.plan = kills(restart, rank) if log_path else set()  # the reference run is never hit
        self.rank = rank
        self.epoch = None
        self.epochs = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        self.epochs.append(epoch)
        if self.log_path:
            with open(self.log_path, "a") as f:
                f.write(f"{self.restart} {self.size} {epoch}\n")
        back = os.environ.get("RECOVERY_TEST_BACK", "")
        if self.log_path and back and tuple(map(int, back.split(":"))) == (self.restart, epoch):
            self.slow = True
            if self.rank == 0 and os.path.exists(os.environ["RECOVERY_TEST_GONE"]):
                os.remove(os.environ["RECOVERY_TEST_GONE"])  # rank 0 only: two ranks would race

    def on_train_batch_end(self, batch, logs=None):
        if getattr(self, "slow", False):
            time.sleep(0.1)

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) in self.plan:
            gone = os.environ.get("RECOVERY_TEST_GONE")
            if gone:
                open(gone, "w").close()
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def test_accuracy(weights, data_dir):
    x, y = np.load(os.path.join(data_dir, "..", "test.npz")).values()
    w1, b1, w2, b2 = (np.array(w) for w in weights[:4])
    logits = np.maximum(x.reshape(len(x), -1) @ w1 + b1, 0) @ w2 + b2
    return float(np.mean(np.argmax(logits, 1) == y))


def train(strategy, data, ckpt_dir, epochs, log_path=None):
    restart, _ = restart_info()
    checkpointer = Checkpointer(ckpt_dir, strategy=strategy, keep=2)
    start = checkpointer.initial_epoch()
    # The global batch, split over the ranks by the strategy: the same on 3 ranks and on 2.
    ds, plan = read_dataset(data, GLOBAL_BATCH, training=True, seed=5, initial_epoch=start,
                            deterministic=True, shuffle_buffer=2000)
    ds = ds.map(lambda b: (b["x"], b["y"]))
    keras.utils.set_random_seed(7 + strategy.rank)  # ranks start identical through broadcast
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    faults = Faults(log_path, restart, strategy.size, strategy.rank)
    model.fit(ds, epochs=epochs, steps_per_epoch=plan.steps_per_epoch, verbose=0,
              callbacks=[checkpointer, faults])
    variables = [np.asarray(v) for v in training_variables(model)]
    return {
        "restart": restart,
        "size": strategy.size,
        "initial_epoch": start,
        "epochs_run": faults.epochs,
        "restored_from": checkpointer.restored_from,
        "steps_per_epoch": plan.steps_per_epoch,
        "iterations": int(np.asarray(model.optimizer.iterations)),
        "variables": [v.tolist() for v in variables],
        "test_accuracy": test_accuracy(variables, data),
    }


def main():
    parser = worker_parser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    strategy = tfdist.HorovodStrategy(tuning=False)
    restart, cause = restart_info()
    if strategy.rank == 0:
        print(f"recovery_checks: launch {restart} on {strategy.size} rank(s); cause: {cause}", flush=True)
    if os.environ.get("RECOVERY_TEST_REFERENCE") and restart == 0:
        write_results(os.path.join(args.out, "reference"), strategy.rank,
                      train(strategy, args.data, args.ckpt + "-reference", args.epochs))
    log_path = os.path.join(args.out, f"epochs-rank{strategy.rank}.log")
    write_results(args.out, strategy.rank, train(strategy, args.data, args.ckpt, args.epochs, log_path))


if __name__ == "__main__":
    main()
