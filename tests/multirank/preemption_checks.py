"""Graceful preemption and exact mid-epoch resume, one relaunch per phase.

    horovodrun -np 2 --gloo python tests/multirank/preemption_checks.py --phase N --work DIR --out OUT

Phase 0 trains every case uninterrupted (the references), then starts case 0, which a signal
stops mid-epoch: the job exits 75. Phase N resumes case N-1 to its end, then starts case N
(stopped the same way). Each rank writes, per case, the steps it trained in each run (the
optimizer's counter before and after), its final variables, and which callbacks saved.
"""

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import keras_module, quiet_tensorflow, worker_parser, write_results  # noqa: E402

quiet_tensorflow()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402
from tfdist.faults import preemption  # noqa: E402
from tfdist.callbacks import Checkpointer  # noqa: E402
from tfdist.callbacks.checkpoint import training_variables  # noqa: E402

keras = keras_module()
LEGACY = keras.__name__.startswith("tf_keras")
EPOCHS, GLOBAL_BATCH, EXAMPLES = 3, 16, 320  # 20 steps an epoch
# (name, checkpointing, input, signal, ranks signalled, epoch, batch after which it is sent).
# "launcher", "job": rank 0 writes WORK/ready there and slows down; the test signals the launcher,
# or every process of the job twice (as Slurm at a time limit).
CASES = [
    ("backup_arrays", "backup", "arrays", signal.SIGTERM, (1,), 1, 9),
    ("checkpointer_dataset", "checkpointer", "dataset", signal.SIGUSR1, (0, 1), 1, 5),
    ("backup_every_5_launcher", "backup5", "dataset", "launcher", (0,), 1, 6),
    ("custom_loop", "loop", "dataset", signal.SIGTERM, (1,), 1, 12),
    ("nothing_saved", "none", "arrays", "job", (0,), 0, 3),
]


class Signal(keras.callbacks.Callback):
    """Sends `sig` to this process after batch `batch` of epoch `epoch` (as a scheduler would),
    or for "launcher" and "job" writes `ready` there and then takes 0.2 s a step (the test signals)."""

    def __init__(self, sig, epoch, batch, ready):
        super().__init__()
        self.sig, self.epoch, self.batch, self.current, self.ready = sig, epoch, batch, 0, ready
        self.sent = None

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.current, batch) == (self.epoch, self.batch):
            self.sent = time.time()
            if self.sig in ("launcher", "job"):
                open(self.ready, "w").close()
            else:
                os.kill(os.getpid(), self.sig)
        elif self.sent and self.sig in ("launcher", "job"):
            time.sleep(0.2)


class Counter(keras.callbacks.Callback):
    """The optimizer's step counter once the checkpoint callbacks before it have restored, and
    every (epoch, batch) that reached the callbacks' on_train_batch_end."""

    def __init__(self):
        super().__init__()
        self.epoch, self.batch_ends = 0, []

    def on_train_begin(self, logs=None):
        self.start = int(np.asarray(self.model.optimizer.iterations))

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.batch_ends.append([self.epoch, batch])


def data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(EXAMPLES, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(EXAMPLES, 1))).astype("float32")
    return x, y


def train(strategy, case, work, interrupt):
    name, saver, source, sig, ranks, epoch, batch = case
    keras.utils.set_random_seed(7)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    folder = os.path.join(work, name + ("" if interrupt is not None else "-reference"))
    callbacks = []
    if saver.startswith("backup"):
        callbacks.append(keras.callbacks.BackupAndRestore(os.path.join(folder, "backup"),
                                                          save_freq=int(saver[6:]) if saver[6:] else "epoch"))
    elif saver == "checkpointer":
        callbacks.append(Checkpointer(os.path.join(folder, "ckpt"), strategy=strategy))
        callbacks.append(keras.callbacks.ModelCheckpoint(os.path.join(folder, "model-{epoch}.weights.h5"),
                                                         save_weights_only=True))
    counter = Counter()
    callbacks.append(counter)
    signaller = None
    if interrupt and strategy.rank in ranks:
        signaller = Signal(sig, epoch, batch, os.path.join(work, "ready"))
        callbacks.append(signaller)
    x, y = data()
    result = {"case": name}
    try:
        if saver == "loop":
            custom_loop(strategy, model, folder, signaller, counter)
        elif source == "arrays":
            # Keras 3 draws the same permutation every epoch; tf-keras a new one, which a resumed
            # process would not repeat (docs/faults/PREEMPTION.md), so its arrays are not shuffled here.
            model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=not LEGACY, verbose=0,
                      callbacks=callbacks)
        else:
            ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(EXAMPLES, seed=5, reshuffle_each_iteration=False)
            model.fit(ds.batch(GLOBAL_BATCH), epochs=EPOCHS, verbose=0, callbacks=callbacks)
    except SystemExit as stop:
        result.update(exit_code=stop.code, exit_time=time.time(), signal_time=getattr(signaller, "sent", None))
        raise
    finally:
        result.setdefault("trained_from", counter.start)
        result.setdefault("trained_to", int(np.asarray(model.optimizer.iterations)))
        result["batch_ends"] = counter.batch_ends
        result["variables"] = [np.asarray(v).tolist() for v in training_variables(model)]
        saved = os.path.join(folder, f"rank{strategy.rank}-{'stopped' if interrupt else 'finished'}")
        write_results(saved, strategy.rank, result)
    return result


def custom_loop(strategy, model, folder, signaller, counter):
    """A custom training loop with `tfdist.faults.preemption.StepAgreement` and its own checkpoint file
    (as a user writes it); `counter.start`: the step it starts at."""
    optimizer, state = model.optimizer, os.path.join(folder, "loop-state.npz")
    with strategy.scope():
        optimizer.build(model.trainable_variables)
    variables = training_variables(model)
    start = 0
    if os.path.exists(state):  # every rank reads the chief's save (a shared file system)
        with np.load(state) as saved:
            start = int(saved["step"])
            for i, variable in enumerate(variables):
                variable.assign(saved[f"v{i}"])
    x, y = data()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(EXAMPLES, seed=5, reshuffle_each_iteration=False)
    iterator = iter(strategy.experimental_distribute_dataset(ds.batch(GLOBAL_BATCH).repeat(EPOCHS)))
    counter.start = start
    for _ in range(start):  # the steps already trained: their data is read, not trained on
        next(iterator)

    @tf.function
    def train_step(batch):
        def replica(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(model(xb, training=True) - yb)) / GLOBAL_BATCH
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        strategy.run(replica, args=batch)

    steps_per_epoch = EXAMPLES // GLOBAL_BATCH
    agreement = preemption.StepAgreement()
    for step in range(start, EPOCHS * steps_per_epoch):
        train_step(next(iterator))
        if signaller is not None:
            signaller.on_epoch_begin(step // steps_per_epoch)
            signaller.on_train_batch_end(step % steps_per_epoch)
        if agreement.stop_after(step + 1):
            if strategy.rank == 0:
                os.makedirs(folder, exist_ok=True)
                with open(state + ".tmp", "wb") as f:
                    np.savez(f, step=step + 1, **{f"v{i}": np.asarray(v) for i, v in enumerate(variables)})
                os.replace(state + ".tmp", state)
            preemption.exit_preempted(f"step {step + 1} saved to {state}")
    agreement.close()


SLURM_CASE = ("slurm", "backup", "dataset", "launcher", (0,), 1, 6)


def slurm_job(strategy, work, out):
    """Under sbatch --requeue: the first run is signalled mid-epoch by the test (scancel) and exits
    75; the requeued run (SLURM_RESTART_COUNT=1) resumes it, then trains the uninterrupted reference."""
    if int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) == 0:
        train(strategy, SLURM_CASE, work, interrupt=True)
    train(strategy, SLURM_CASE, work, interrupt=False)
    train(strategy, SLURM_CASE, work, interrupt=None)
    write_results(out, strategy.rank, {"restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0"))})


def main():
    parser = worker_parser()
    parser.add_argument("--phase", required=True, help="0, 1, ... or slurm")
    parser.add_argument("--work", required=True)
    args = parser.parse_args()
    strategy = tfdist.HorovodStrategy(tuning=False)
    if args.phase == "slurm":
        return slurm_job(strategy, args.work, args.out)
    args.phase = int(args.phase)
    if args.phase == 0:
        for case in CASES[:-1]:  # the last is never resumed
            train(strategy, case, args.work, interrupt=None)
    else:
        train(strategy, CASES[args.phase - 1], args.work, interrupt=False)
    write_results(args.out, strategy.rank, {"phase": args.phase})
    if args.phase < len(CASES):
        train(strategy, CASES[args.phase], args.work, interrupt=True)


if __name__ == "__main__":
    main()
