"""Profiling under HorovodStrategy: step markers, named collectives, a straggler, Horovod's timeline.

    horovodrun -np 2 --gloo python tests/multirank/profile_checks.py --out DIR --slow_rank 1
    TF_USE_LEGACY_KERAS=1 python tests/multirank/profile_checks.py --out DIR    # 1 process, tf-keras

`fit` trains a small model for STEPS steps with ProfileSteps on every rank (DIR/fit/rank<R>/);
`--slow_rank`'s input pipeline sleeps SLEEP s per batch from step SLOW_FROM on, so the other rank
waits for it in the gradient allreduce. Then a custom training loop profiles LOOP_STEPS steps
marked with `step_marker` (DIR/loop/rank<R>/). Horovod's timeline is recorded on demand
(`horovod={"timeline": "DYNAMIC"}`). Each rank writes DIR/rank<R>.json with what it saw.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import keras_module, quiet_tensorflow, worker_parser, write_results  # noqa: E402

quiet_tensorflow()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402
from tfdist.callbacks import ProfileSteps, step_marker  # noqa: E402

keras = keras_module()
GLOBAL_BATCH, FEATURES = 32, 64
STEPS, PROFILED = 12, (6, 10)  # PROFILED within the one epoch, after the tf.data buffers drained
SLOW_FROM, SLEEP = 2, 0.2
LOOP_STEPS = 3


def dataset(slow):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * GLOBAL_BATCH, FEATURES)).astype("float32")
    y = rng.integers(0, 4, size=STEPS * GLOBAL_BATCH).astype("int32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    if not slow:
        return ds

    def wait(index, x, y):
        if index >= SLOW_FROM:
            time.sleep(SLEEP)  # a slow reader or decoder on this rank only
        return x, y

    def slow_batch(index, batch):
        x, y = tf.numpy_function(wait, [index, *batch], [tf.float32, tf.int32], stateful=True)
        return tf.ensure_shape(x, [None, FEATURES]), tf.ensure_shape(y, [None])

    return ds.enumerate().map(slow_batch)


def main():
    parser = worker_parser()
    parser.add_argument("--slow_rank", type=int, default=None)
    args = parser.parse_args()
    strategy = tfdist.HorovodStrategy(horovod={"timeline": "DYNAMIC"})
    with strategy.scope():
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(4)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    profile = ProfileSteps(f"{args.out}/fit", steps=PROFILED, ranks=range(strategy.size),
                           batch_size=GLOBAL_BATCH // strategy.size)
    started = time.perf_counter()
    model.fit(dataset(strategy.rank == args.slow_rank), epochs=1, verbose=0, callbacks=[profile])
    fit_seconds = time.perf_counter() - started

    # A custom training loop under the strategy, its steps marked with step_marker.
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def replica_step(batch):
        x, y = batch
        with tf.GradientTape() as tape:
            per_example = loss_fn(y, model(x, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train_step(batch):
        return strategy.run(replica_step, args=(batch,))

    iterator = iter(strategy.experimental_distribute_dataset(dataset(False)))
    train_step(next(iterator))  # traced outside the profile
    tf.profiler.experimental.start(f"{args.out}/loop/rank{strategy.rank}")
    for step in range(LOOP_STEPS):
        with step_marker(step):  # the batch is taken inside: its input time is part of the step
            train_step(next(iterator))
    tf.profiler.experimental.stop()

    write_results(args.out, strategy.rank, {
        "size": strategy.size,
        "fit_seconds": fit_seconds,
        "timeline": os.path.exists(profile.timeline_path),
        "keras": keras.__name__,
    })


if __name__ == "__main__":
    main()
