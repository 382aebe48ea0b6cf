"""Checkpoint and resume under horovodrun: train 4 epochs; optionally die after an epoch; resume.

    horovodrun -np 2 --gloo python tests/multirank/checkpoint_checks.py --data DIR --ckpt DIR --out OUT

With CHECKPOINT_TEST_CRASH_AFTER=N every rank exits abruptly (os._exit, no cleanup) at the end
of epoch N, after the chief saved that epoch's checkpoint; running the same command again
resumes. CHECKPOINT_TEST_REFERENCE=1 first runs all 4 epochs uninterrupted (checkpoints in
CKPT-reference, results in OUT/reference/). Each rank writes its final weights, optimizer
state, the epochs it ran and the record ids each epoch fed it.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import keras_module, quiet_tensorflow, worker_parser, write_results  # noqa: E402

quiet_tensorflow()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402
from tfdist.callbacks import Checkpointer, WarmupSchedule, polynomial_decay  # noqa: E402
from tfdist.callbacks.checkpoint import training_variables  # noqa: E402
from tfdist.pipelines import read_dataset  # noqa: E402
from tfdist import collectives  # noqa: E402

keras = keras_module()
EPOCHS = 4
BATCH = 4


class EpochLog(keras.callbacks.Callback):
    """Records the epochs run; with `crash_after`, dies like a crash at the end of that epoch."""

    def __init__(self, crash_after):
        super().__init__()
        self.crash_after = crash_after
        self.epochs = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs.append(epoch)

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 == self.crash_after:
            # Both ranks pass this point only after the chief's save (an earlier callback), so
            # the launcher cannot kill the chief mid-save when the first rank dies.
            collectives.allreduce([tf.constant(1.0)], name="test.before_crash")
            os._exit(17)


def train(strategy, data, ckpt_dir, crash_after=0):
    """Fit 4 epochs with a Checkpointer in `ckpt_dir` (resuming if it holds a checkpoint)."""
    checkpointer = Checkpointer(ckpt_dir, strategy=strategy, keep=2)
    start = checkpointer.initial_epoch()
    plans, batches_seen = [], {}

    def note(index, ids):
        batches_seen[int(index)] = ids.numpy().tolist()
        return np.int64(0)

    def to_xy(index, batch):
        # Keras may open extra iterators (to peek at shapes); the pipeline is deterministic, so
        # batch #i holds the same ids in every iterator, and fit's iterator feeds #0, #1, ...
        noted = tf.py_function(note, [index, batch["id"]], tf.int64)
        with tf.control_dependencies([noted]):
            return tf.identity(batch["x"]), batch["y"]

    def dataset_fn(ctx):
        ds, plan = read_dataset(data, BATCH, input_context=ctx, training=True, seed=11,
                                initial_epoch=start, deterministic=True, shuffle_buffer=64)
        plans.append(plan)
        return ds.enumerate().map(to_xy)

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    steps = plans[0].steps_per_epoch

    keras.utils.set_random_seed(100 + strategy.rank)  # ranks start identical through broadcast
    # The warmup spans the crash, so a resumed run is right only if the LR position resumes too.
    schedule = WarmupSchedule(polynomial_decay(0.05, EPOCHS * steps), warmup_steps=3 * steps)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="tanh"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(schedule, momentum=0.9), loss="mse")
    epoch_log = EpochLog(crash_after)
    history = model.fit(dist, epochs=EPOCHS, steps_per_epoch=steps, verbose=0,
                        callbacks=[checkpointer, epoch_log])
    ids_by_epoch = {
        str(epoch): sum((batches_seen[i] for i in range(k * steps, (k + 1) * steps)), [])
        for k, epoch in enumerate(epoch_log.epochs)
    }
    return {
        "initial_epoch": start,
        "epochs_run": epoch_log.epochs,
        "restored_from": checkpointer.restored_from,
        "steps_per_epoch": steps,
        "iterations": int(np.asarray(model.optimizer.iterations)),
        "variables": [np.asarray(v).tolist() for v in training_variables(model)],
        "ids_by_epoch": ids_by_epoch,
        "loss": history.history["loss"],
    }


def main():
    parser = worker_parser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--ckpt", required=True)
    args = parser.parse_args()
    strategy = tfdist.HorovodStrategy(tuning=False)
    if os.environ.get("CHECKPOINT_TEST_REFERENCE"):  # an uninterrupted run first, in its own directory
        write_results(os.path.join(args.out, "reference"), strategy.rank,
                      train(strategy, args.data, args.ckpt + "-reference"))
    crash_after = int(os.environ.get("CHECKPOINT_TEST_CRASH_AFTER", "0"))
    write_results(args.out, strategy.rank, train(strategy, args.data, args.ckpt, crash_after))


if __name__ == "__main__":
    main()
