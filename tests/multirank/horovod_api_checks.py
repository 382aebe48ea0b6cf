"""Horovod's own TensorFlow/Keras API on Keras 3 and tf-keras, with tfdist's Horovod build (its patches).

    horovodrun -np 2 --gloo python tests/multirank/horovod_api_checks.py --out DIR   (TF_USE_LEGACY_KERAS=0|1)

No tfdist strategy: this is a Horovod user's code. Each rank writes rank<R>.json with, per check,
what tests/test_horovod_api.py compares across ranks, with numpy references and across flavours:

- tape: DistributedGradientTape with a Keras layer's kernel registered as a local source,
  eagerly and in a tf.function (the local gradients next to the distributed ones);
- syncbn: SyncBatchNormalization in a Sequential model, each rank's own batch;
- fit / fit_bpps2: hvd.DistributedOptimizer(SGD) in fit() with BroadcastGlobalVariablesCallback,
  MetricAverageCallback and LearningRateWarmupCallback; ranks start from different weights; the
  second also with backward_passes_per_step=2;
- load_model: rank 0 saves, every rank hvd.load_model()s (and keras' own load_model on Keras 3);
- mixed_precision: DistributedOptimizer around a LossScaleOptimizer, a float16 overflow on one rank;
- keras_mnist / mnist: Horovod's two TF2 example flows on Keras 3 (hvd_keras_mnist.py,
  hvd_mnist.py), for a few steps, no dropout, each rank from its own initial weights.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import quiet_tensorflow, worker_parser, write_results  # noqa: E402

quiet_tensorflow()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod.tensorflow as hvd_tf  # noqa: E402
import horovod.tensorflow.keras as hvd  # noqa: E402
from horovod.tensorflow import util as hvd_util  # noqa: E402

FIT_EXAMPLES, FIT_BATCH, FIT_EPOCHS, FIT_LR = 32, 8, 2, 0.1  # per rank: 4 steps per epoch


def data(rank, n, features, seed):
    """Each rank's own inputs and targets (the ranks differ)."""
    rng = np.random.default_rng(seed + rank)
    x = rng.normal(loc=rank, size=(n, features)).astype("float32")
    return x, (x @ np.arange(1, features + 1, dtype="float32")[:, None] / features).astype("float32")


def initial_weights(model, rank):
    """Weights of `model`'s shapes, different on each rank, the same on both flavours."""
    rng = np.random.default_rng(100 + rank)
    return [(rng.normal(size=w.shape) * 0.1).astype(w.dtype) for w in model.get_weights()]


def check_tape(rank):
    x, y = data(rank, 16, 3, seed=1)
    layer = tf.keras.layers.Dense(2)
    layer.build((None, 3))
    layer.set_weights(initial_weights(layer, 0))  # the same weights everywhere
    out = {"x": x}

    def gradients(distributed):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(layer(x) - y))
        if distributed:
            tape = hvd_tf.DistributedGradientTape(tape)
            tape.register_local_source(layer.kernel)  # a Keras 3 variable on Keras 3
        return tape.gradient(loss, [layer.kernel, layer.bias])

    out["local"] = [g.numpy() for g in gradients(False)]
    out["eager"] = [g.numpy() for g in gradients(True)]
    out["function"] = [g.numpy() for g in tf.function(lambda: gradients(True))()]
    out["variable_type"] = type(layer.kernel).__module__ + "." + type(layer.kernel).__name__
    return out


def check_syncbn(rank):
    x, _ = data(rank, 8, 4, seed=2)
    model = tf.keras.Sequential([tf.keras.Input((4,)), hvd_tf.SyncBatchNormalization(momentum=0.0)])
    outputs = model(x, training=True)
    layer = model.layers[0]
    return {"x": x, "outputs": outputs.numpy(), "moving_mean": layer.moving_mean.numpy(),
            "moving_variance": layer.moving_variance.numpy(), "epsilon": layer.epsilon}


class RecordLearningRate(tf.keras.callbacks.Callback):
    """The learning rate each batch trains with (after the warmup callback set it)."""

    def __init__(self):
        super().__init__()
        self.rates = []

    def on_train_batch_begin(self, batch, logs=None):
        self.rates.append(float(np.asarray(self.model.optimizer.learning_rate)))


def check_fit(rank, backward_passes_per_step=1):
    x, y = data(rank, FIT_EXAMPLES, 4, seed=3)
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
    start = initial_weights(model, rank)  # rank 1 starts elsewhere: the broadcast must fix that
    model.set_weights(start)
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(FIT_LR), backward_passes_per_step=backward_passes_per_step,
                                   average_aggregated_gradients=True)
    model.compile(optimizer=opt, loss="mse")
    rates = RecordLearningRate()
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(),
                 hvd.callbacks.LearningRateWarmupCallback(initial_lr=FIT_LR, warmup_epochs=FIT_EPOCHS), rates]
    history = model.fit(x, y, batch_size=FIT_BATCH, epochs=FIT_EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)
    return {"x": x, "y": y, "start": start, "weights": model.get_weights(), "loss": history.history["loss"],
            "lr_logged": history.history["lr"], "rates": rates.rates, "iterations": int(opt.iterations.numpy()),
            "class": f"{type(opt).__module__}.{type(opt).__name__}"}


def check_load_model(rank, folder):
    keras3 = hvd._impl._is_keras3_optimizer(tf.keras.optimizers.SGD(0.1))
    path = os.path.join(folder, "saved.keras" if keras3 else "saved.h5")
    x, y = data(0, 16, 4, seed=4)
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
    model.set_weights(initial_weights(model, 0))
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.01)), loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    if rank == 0:
        model.save(path)
    hvd_tf.broadcast_object(0)  # a barrier: the file is there
    loaded = hvd.load_model(path)
    out = {"optimizer_class": type(loaded.optimizer).__name__,
           "distributed": hasattr(loaded.optimizer, "_allreduce_grads"),
           "iterations": int(loaded.optimizer.iterations.numpy()),
           "optimizer_variables": [np.asarray(v) for v in hvd_util.optimizer_variables(loaded.optimizer)],
           "saved_optimizer_variables": [np.asarray(v) for v in hvd_util.optimizer_variables(model.optimizer)]}
    loaded.fit(*data(rank, 16, 4, seed=5), batch_size=8, epochs=1, shuffle=False, verbose=0)
    out["weights_after_training_on"] = loaded.get_weights()  # each rank its own data: all-reduced
    if keras3:  # the saved optimizer loads without Horovod too, as the optimizer it wraps
        plain = tf.keras.models.load_model(path)
        out["plain_optimizer"] = f"{type(plain.optimizer).__module__}.{type(plain.optimizer).__name__}"
    return out


def check_mixed_precision(rank):
    """hvd.DistributedOptimizer(LossScaleOptimizer(SGD)) under mixed_float16: the first batch overflows
    float16 on rank 1 only; the loss scale sees the all-reduced (inf) gradient, so both ranks skip it."""
    x, y = np.ones((16, 4), "float32"), np.ones((16, 1), "float32")
    y[:8] = 3e4 if rank == 1 else 1.0  # scaled by 2**15, rank 1's first gradient is inf in float16
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
        model.set_weights([np.full((4, 1), 0.1, "float32"), np.zeros((1,), "float32")])
        inner = tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.SGD(0.01))
        model.compile(optimizer=hvd.DistributedOptimizer(inner), loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    return {"weights": model.get_weights(), "loss_scale": float(np.asarray(model.optimizer.dynamic_scale
                                                                             if hasattr(model.optimizer, "dynamic_scale")
                                                                             else model.optimizer.loss_scale))}


def run_examples(rank, folder):
    """Horovod's two TF2 example flows (hvd_keras_mnist.py, hvd_mnist.py) for a few steps, without
    dropout, each rank from its own initial weights (the broadcast must make them equal)."""
    import hvd_keras_mnist
    import hvd_mnist

    def set_weights(model):
        model.set_weights(initial_weights(model, rank))

    out = {}
    for key, run in (("keras_mnist", lambda f: hvd_keras_mnist.main(steps_per_epoch=4, epochs=2, dropout=(0.0, 0.0),
                                                                    set_weights=set_weights, folder=f)),
                     ("mnist", lambda f: hvd_mnist.main(steps=6, dropout=(0.0, 0.0), set_weights=set_weights, folder=f))):
        example_folder = os.path.join(folder, key)
        os.makedirs(example_folder)
        model, record = run(example_folder)
        out[key] = {"weights": model.get_weights(), "files": sorted(os.listdir(example_folder)),
                    **({"history": record.history} if key == "keras_mnist" else {"losses": record})}
    return out


def main():
    args = worker_parser().parse_args()
    if not hasattr(hvd_util, "var_ref"):
        raise SystemExit(f"Horovod at {os.path.dirname(hvd_tf.__file__)} was built without tfdist's patches "
                         "(tfdist/horovod_build/patches/): run `tfdist-install-horovod` (or scripts/bootstrap.sh)")
    hvd.init()
    rank = hvd.rank()
    folder = os.path.join(args.out, f"files-rank{rank}")
    os.makedirs(folder, exist_ok=True)
    shared = os.path.join(args.out, "shared")
    os.makedirs(shared, exist_ok=True)
    results = {"flavour": "tf_keras" if os.environ.get("TF_USE_LEGACY_KERAS") == "1" else "keras3", "size": hvd.size(),
               "tape": check_tape(rank), "syncbn": check_syncbn(rank), "fit": check_fit(rank),
               "fit_bpps2": check_fit(rank, backward_passes_per_step=2), "load_model": check_load_model(rank, shared),
               "mixed_precision": check_mixed_precision(rank)}
    results.update(run_examples(rank, folder))
    write_results(args.out, rank, results)


if __name__ == "__main__":
    main()
