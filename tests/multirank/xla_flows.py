"""XLA (`jit_compile=True`) as client code writes it, as conformance scenarios.

`xla_fit` compiles a Keras model with `jit_compile=True`; `xla_custom_loop` is the custom-loop
tutorial's step under `tf.function(jit_compile=True)`. Under HorovodStrategy on 2+ ranks tfdist
compiles around its allreduce (`tfdist.exchange.xla`); one process compiles the whole step. Each scenario
also reports what XLA compiled in this process, from the HLO modules it dumps (XLA_FLAGS
`--xla_dump_to`, set per worker by `dump_xla_modules` before the first compile), so a run that
silently left XLA out cannot pass.
"""

import glob
import os

import tensorflow as tf

from client_code import GLOBAL, build_model, keras, make_data, seed_for, weights_of

SUM = tf.distribute.ReduceOp.SUM
_DUMPS = []  # this process's dump folder, set by dump_xla_modules


def dump_xla_modules(folder):
    """Ask XLA to dump the HLO of every module it compiles into `folder` (before its first compile)."""
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={folder}".strip()
    _DUMPS.append(folder)


def compiled_since(before):
    """HLO modules XLA compiled since `before` (a listing): how many, and whether they hold a matmul."""
    modules = sorted(set(glob.glob(os.path.join(_DUMPS[0], "*before_optimizations.txt"))) - set(before))
    text = "".join(open(path).read() for path in modules)
    return {"modules": len(modules), "matmul": " dot(" in text, "horovod": "Horovod" in text}


def _listing():
    return glob.glob(os.path.join(_DUMPS[0], "*before_optimizations.txt")) if _DUMPS else []


def xla_fit(run):
    before = _listing()
    x, y = make_data(96, seed=9)
    with run.strategy.scope():
        model = build_model(seed_for(run, 41))
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], jit_compile=True)
    history = model.fit(x, y, batch_size=GLOBAL, epochs=2, shuffle=False, verbose=0)
    return {"final": weights_of(model), "history": history.history, "xla": compiled_since(before)}


def xla_custom_loop(run):
    before = _listing()
    strategy = run.strategy
    x, y = make_data(96, seed=10)
    with strategy.scope():
        model = build_model(seed_for(run, 43))
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    dist_dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL))

    def train_step(inputs):
        features, labels = inputs
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_object(labels, model(features, training=True)),
                                              global_batch_size=GLOBAL)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function(jit_compile=True)
    def distributed_train_step(inputs):
        return strategy.reduce(SUM, strategy.run(train_step, args=(inputs,)), axis=None)

    losses = [float(distributed_train_step(inputs)) for inputs in dist_dataset]
    return {"losses": losses, "final": weights_of(model), "xla": compiled_since(before)}


XLA_SCENARIOS = {"xla_fit": xla_fit, "xla_custom_loop": xla_custom_loop}
