"""Checks run under a real mpirun (Open MPI): training equals one process, global metrics, Adasum.

    tfdist-run --launcher mpirun -np 2 python tests/multirank/mpi_checks.py --out DIR
    mpirun --allow-run-as-root -np 2 -H localhost:2 -bind-to none -map-by slot \
        python tests/multirank/mpi_checks.py --out DIR
    python tests/multirank/mpi_checks.py --out DIR --reference     # 1 process, same global batch

Each rank writes DIR/rank<R>.json: how it was launched (Horovod's controller,
OMPI_COMM_WORLD_RANK), the weights, History and evaluation of an `op="average"` fit with a
metric, and (not with --reference) one Adasum exchange (this rank's unscaled local gradients and
the exchanged ones), the same with global_clipnorm, the losses of a short Adasum fit, and the
bfloat16 allreduces of bf16_checks.py. tests/test_mpi.py compares them.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import keras_module, quiet_tensorflow, worker_parser, write_results  # noqa: E402

quiet_tensorflow()

import bf16_checks  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402
from train_checks import PER_RANK_BATCH, RANKS, STEPS, build_model, loss_fn, make_data  # noqa: E402

keras = keras_module()


def weights(model):
    return [w.tolist() for w in model.get_weights()]


def launch_info(strategy):
    hvd = tfdist.collectives.horovod()
    return {"rank": strategy.rank, "size": strategy.size, "mpi_enabled": bool(hvd.mpi_enabled()),
            "gloo_enabled": bool(hvd.gloo_enabled()), "ompi_rank": os.environ.get("OMPI_COMM_WORLD_RANK"),
            "startup": {k: v for k, v in (tfdist.tuning.startup.state() or {}).items()
                        if k in ("route", "layout", "pinned", "bound_by_launcher")},
            "keras": keras.__name__,
            "open_mpi_waiting": tfdist.tuning.horovod_env.open_mpi_waiting(),
            "transport": tfdist.collectives.transport(strategy.extended.worker_devices[0])}


def average_fit(strategy):
    """The usual fit at the global batch: 2 ranks must equal 1 process, metrics included."""
    global_batch = PER_RANK_BATCH * RANKS
    x, y = make_data("dense", global_batch * STEPS)
    with strategy.scope():
        model = build_model("dense", seed=100 + strategy.rank)  # the broadcast aligns the ranks
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss=loss_fn(),
                      metrics=["accuracy"])
    initial = weights(model)
    history = model.fit(x, y, batch_size=global_batch, epochs=2, shuffle=False, verbose=0)
    evaluation = model.evaluate(x, y, batch_size=global_batch, verbose=0)
    return {"initial": initial, "final": weights(model), "history": history.history,
            "evaluate": [float(v) for v in np.atleast_1d(evaluation)]}


ADASUM_CLIP = 0.05  # global_clipnorm, well below the Adasum of this problem's first gradients


def adasum_exchange(strategy, clip=None, sparse=False):
    """One SGD(1.0) step of a custom loop: the weights move by exactly the exchanged gradient
    (with `clip`, SGD(1.0, global_clipnorm=clip): the exchanged gradient, clipped; with `sparse`,
    an Embedding first, whose tf.IndexedSlices gradient is exchanged beside the dense ones)."""
    size, rng = strategy.size, np.random.default_rng(11)
    global_batch = PER_RANK_BATCH * size
    x = rng.normal(size=(global_batch, 4)).astype("float32")
    if sparse:  # ids with repeats, within and across ranks
        x = rng.integers(0, 6, (global_batch, 4)).astype("int32")
    y = rng.normal(size=(global_batch, 3)).astype("float32")
    with strategy.scope():
        keras.utils.set_random_seed(5)
        layers = [keras.layers.Embedding(6, 2), keras.layers.Flatten()] if sparse else []
        model = keras.Sequential([keras.Input((4,), dtype="int32" if sparse else "float32"), *layers,
                                  keras.layers.Dense(3)])
        optimizer = keras.optimizers.SGD(1.0, global_clipnorm=clip)
        optimizer.build(model.trainable_variables)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    batch_x, batch_y = next(iter(strategy.experimental_distribute_dataset(dataset)))
    local_x, local_y = (strategy.experimental_local_results(v)[0] for v in (batch_x, batch_y))
    with tf.GradientTape() as tape:  # this rank's gradient of its own mean loss, unscaled
        local_loss = tf.reduce_mean(tf.square(model(local_x) - local_y))
    local = tape.gradient(local_loss, model.trainable_variables)
    before = [v.numpy() for v in model.trainable_variables]

    @tf.function
    def step(bx, by):
        def replica_step(bx, by):
            with tf.GradientTape() as tape:
                per_example = tf.reduce_mean(tf.square(model(bx) - by), axis=-1)
                # as Keras does: divided by the global batch, i.e. the local mean / num_replicas
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        strategy.run(replica_step, args=(bx, by))

    step(batch_x, batch_y)
    exchanged = [b - v.numpy() for b, v in zip(before, model.trainable_variables)]
    return {"local": [tf.convert_to_tensor(g).numpy().tolist() for g in local], "exchanged": [g.tolist() for g in exchanged],
            "sparse_locally": [isinstance(g, tf.IndexedSlices) for g in local]}


def adasum_fit(strategy):
    """A short fit with op='adasum' on a linear problem: the loss must fall."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(256, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 3)) + 0.01 * rng.normal(size=(256, 3))).astype("float32")
    with strategy.scope():
        keras.utils.set_random_seed(7 + strategy.rank)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    history = model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    return {"loss": history.history["loss"], "final": weights(model)}


def main():
    args = worker_parser(reference=True).parse_args()
    strategy = tfdist.HorovodStrategy(tuning=False)
    results = {"launch": launch_info(strategy), "average": average_fit(strategy)}
    if not args.reference:
        adasum = tfdist.HorovodStrategy(tuning=False, op="adasum")
        results["adasum_exchange"] = adasum_exchange(adasum)
        results["adasum_clipped_exchange"] = adasum_exchange(adasum, clip=ADASUM_CLIP)
        results["adasum_sparse_exchange"] = adasum_exchange(adasum, sparse=True)
        results["adasum_fit"] = adasum_fit(adasum)
        results["bf16_exchange"] = bf16_checks.exchange_checks()
    write_results(args.out, strategy.rank, results)


if __name__ == "__main__":
    main()
