"""Gradient compression (PowerSGD, top-k, bf16) on real ranks: one launch, many checks.

    horovodrun -np 2 --gloo python tests/multirank/compression_checks.py --out DIR

Each rank writes DIR/rank<R>.json; tests/test_compression.py recomputes the compressors' steps
in numpy from both ranks' inputs and compares, compares the trained weights across ranks, and
checks that gradient clipping applies to the decompressed sum. compression="bf16": the bfloat16
allreduce against numpy (bf16_checks.py), the dtype the gradient allreduce sends, strategy.reduce
left exact, and the digits task trained with and without it.
"""

import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import keras_module, quiet_tensorflow, worker_parser, write_results  # noqa: E402

quiet_tensorflow()

import bf16_checks  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402
from tfdist.callbacks import Checkpointer  # noqa: E402
from tfdist.optimizers import accumulate_gradients  # noqa: E402
from tfdist.exchange.compression import PowerSGD, TopK  # noqa: E402

keras = keras_module()
SHAPES = [(12, 10), (3, 3, 4, 6), (10,)]  # a dense kernel, a conv kernel (36 x 6), a bias
STEPS = 2


def compressor_steps(compressor, rank, results, key):
    """Two steps of `compressor.reduce` on random gradients, from a given initial state."""
    rng = np.random.default_rng(100 + rank)
    variables = [tf.Variable(tf.zeros(s)) for s in SHAPES]
    initial = initial_state(compressor, rng)
    compressor.restore(initial)  # before the state exists: taken when the first step creates it
    step = tf.function(lambda grads: compressor.reduce(grads, variables))
    inputs, outputs = [], []
    for _ in range(STEPS):
        grads = [rng.normal(size=s).astype("float32") for s in SHAPES]
        inputs.append(grads)
        outputs.append([o.numpy() for o in step([tf.constant(g) for g in grads])])
    results[key] = {"initial": initial, "inputs": inputs, "outputs": outputs,
                    "state": [v.numpy() for v in compressor.state_variables()]}


def initial_state(compressor, rng):
    """A non-zero starting state, so that error feedback and warm start both show in step 1.

    The memories are this rank's own; PowerSGD's Q is the same on every rank (as it always is)."""
    shared, state = np.random.default_rng(5), []
    for shape in SHAPES:
        if isinstance(compressor, PowerSGD) and compressor.plan(list(shape)):
            rows, cols, rank = compressor.plan(list(shape))
            state += [rng.normal(size=(rows, cols)).astype("float32") * 0.1,
                      shared.normal(size=(cols, rank)).astype("float32")]
        elif isinstance(compressor, TopK) and compressor.plan(list(shape)):
            state.append(rng.normal(size=int(np.prod(shape))).astype("float32") * 0.1)
    return state


def data(n=64):
    rng = np.random.default_rng(7)
    x = rng.normal(size=(n, 12)).astype("float32")
    return x, (x[:, :3].sum(axis=1) > 0).astype("int32")


def model_for(strategy, optimizer, seed=3):
    with strategy.scope():
        keras.utils.set_random_seed(seed)
        model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)])
        model.compile(optimizer=optimizer(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def weights(model):
    return [w.tolist() for w in model.get_weights()]


def fit_checks(results):
    """fit with each compressor and exchange, loss scaling, accumulation and a custom loop."""
    x, y = data()
    sgd = lambda: keras.optimizers.SGD(0.1, momentum=0.9)  # noqa: E731
    cases = {
        "powersgd/ready": ("powersgd:2", None, sgd),
        "topk/bucketed": (TopK(0.1, min_entries=64), 1e-4, sgd),
        "powersgd/accumulation": ("powersgd:2", None, lambda: accumulate_gradients(sgd(), 2)),
        "none/ready": (None, None, sgd),
        "powersgd_full/ready": (PowerSGD(rank=64, min_compression_rate=0), None, sgd),
        "bf16/ready": ("bf16", None, sgd),
    }
    # Keras 3: tfdist's hook reduces before the finite check; tf-keras does so itself
    cases["topk/loss_scaling"] = (TopK(0.1, min_entries=64), None,
                                  lambda: keras.mixed_precision.LossScaleOptimizer(sgd()))
    for name, (compression, bucket_mb, optimizer) in cases.items():
        strategy = tfdist.HorovodStrategy(compression=compression, bucket_mb=bucket_mb, tuning=False)
        model = model_for(strategy, optimizer)
        initial = weights(model)
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        results[f"fit/{name}"] = {"initial": initial, "final": weights(model),
                                  "state": len(strategy.compressor.state_variables()) if strategy.compressor else 0}
    # a custom loop: strategy.run + optimizer.apply_gradients
    strategy = tfdist.HorovodStrategy(compression="powersgd:2", tuning=False)
    model = model_for(strategy, sgd)
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(16))
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    @tf.function
    def train_step(batch):
        def replica(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_object(yb, model(xb, training=True)), global_batch_size=16)
            grads = tape.gradient(loss, model.trainable_variables)
            model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        strategy.run(replica, batch)

    for batch in dataset:
        train_step(batch)
    results["custom_loop/powersgd"] = {"final": weights(model), "state": len(strategy.compressor.state_variables())}


CLIPS = {"global_clipnorm": 0.01, "clipvalue": 0.002}  # both far below this model's first gradient


def clip_checks(results):
    """One fit step of SGD(1.0) per compression and clip: the weights move by the applied gradient,
    which must be clipped as a whole (global norm = the clip; no entry above clipvalue), not per rank."""
    x, y = data()
    for name, compression in (("none", None), ("topk", TopK(0.1, min_entries=64)), ("powersgd", "powersgd:2")):
        for clip in ({}, *({key: value} for key, value in CLIPS.items())):
            strategy = tfdist.HorovodStrategy(compression=compression, tuning=False)
            model = model_for(strategy, lambda: keras.optimizers.SGD(1.0, **clip))
            before = model.get_weights()
            model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)  # one step
            applied = np.concatenate([(b - a).ravel() for b, a in zip(before, model.get_weights())])
            key = next(iter(clip), "unclipped")
            results[f"clip/{name}/{key}"] = {"global_norm": float(np.linalg.norm(applied)),
                                             "largest": float(np.abs(applied).max())}


def resume_checks(rank, out, results):
    """Checkpointer saves each rank's error memories: a resumed run continues exactly."""
    x, y = data()
    directory = os.path.join(out, "checkpoints")
    sgd = lambda: keras.optimizers.SGD(0.1, momentum=0.9)  # noqa: E731

    class WithoutRankState(Checkpointer):  # the control: what resuming without the memories gives
        def _restore_rank_state(self, path):
            pass

    def run(epochs, resume, checkpointer_class=Checkpointer):
        strategy = tfdist.HorovodStrategy(compression=TopK(0.1, min_entries=64), tuning=False)
        model = model_for(strategy, sgd)
        checkpointer = checkpointer_class(directory, keep=5)
        start = checkpointer.initial_epoch()
        callbacks = [checkpointer] if resume else []
        model.fit(x, y, batch_size=16, epochs=epochs, initial_epoch=start, shuffle=False, verbose=0,
                  callbacks=callbacks)
        return weights(model), strategy

    straight, strategy = run(3, resume=False)
    results["resume/straight"] = straight
    results["resume/state_variables"] = len(strategy.compressor.state_variables())
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    tfdist.collectives.allreduce([tf.constant(0)])  # everyone waits for the removal
    run(2, resume=True)  # epochs 1-2, checkpoints after each
    if rank == 0:
        shutil.rmtree(os.path.join(directory, "ckpt-000002"))  # resume from epoch 1: state must carry
    tfdist.collectives.allreduce([tf.constant(0)])
    results["resume/without_rank_state"], _ = run(3, resume=True, checkpointer_class=WithoutRankState)
    if rank == 0:  # the control saved epochs 2 and 3: back to epoch 1 again
        for epoch in (2, 3):
            shutil.rmtree(os.path.join(directory, f"ckpt-{epoch:06d}"))
    tfdist.collectives.allreduce([tf.constant(0)])
    results["resume/resumed"], _ = run(3, resume=True)


def bf16_strategy_checks(results):
    """compression="bf16" in the strategy: the dtype its gradient allreduce sends (read from the
    traced step's graph), and what strategy.reduce returns under bf16 and fp16."""
    x, y = data()
    strategy = tfdist.HorovodStrategy(compression="bf16", tuning=False)
    model = model_for(strategy, lambda: keras.optimizers.SGD(0.1))
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    @tf.function
    def step(bx, by):
        def replica(bx, by):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_object(by, model(bx, training=True)), global_batch_size=16)
            grads = tape.gradient(loss, model.trainable_variables)
            model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        strategy.run(replica, (bx, by))

    graph = step.get_concrete_function(tf.constant(x[:8]), tf.constant(y[:8])).graph.as_graph_def()
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    results["bf16/allreduce_dtypes"] = sorted(tf.dtypes.as_dtype(n.attr["T"].type).name for n in nodes
                                              if n.op in ("HorovodAllreduce", "HorovodGroupedAllreduce"))
    # strategy.reduce is no gradient sum: exact, where float16 overflows and bfloat16 rounds
    for name in ("bf16", "fp16"):
        other = tfdist.HorovodStrategy(compression=name, tuning=False)
        value = other.reduce(tf.distribute.ReduceOp.SUM, tf.constant([70000.0, 1.0 + 2.0 ** -10]), axis=None)
        results[f"{name}/strategy_reduce"] = value.numpy().tolist()


def digits_checks(results):
    """The README's digits model (sklearn's 8x8 digits, an MLP) on 2 ranks, with and without bf16; 60
    steps at global batch 256 (Adam 0.01) reach what the README's 460 at 64 do, in CI's time."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split((x / 16).astype("float32"), y, test_size=0.2, random_state=0)
    for name in ("none", "bf16"):
        strategy = tfdist.HorovodStrategy(compression=name, tuning=False)
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                                      keras.layers.Dense(10, activation="softmax")])
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                          metrics=["accuracy"])
        model.fit(x_train, y_train, batch_size=256, epochs=10, shuffle=False, verbose=0)
        _, accuracy = model.evaluate(x_test, y_test, verbose=0)
        results[f"digits/{name}"] = {"accuracy": float(accuracy), "final": weights(model)}


def main():
    args = worker_parser().parse_args()
    strategy = tfdist.HorovodStrategy(tuning=False)
    rank = strategy.rank
    results = {"keras": keras.__name__, "size": strategy.size}
    compressor_steps(PowerSGD(rank=2), rank, results, "powersgd")
    compressor_steps(TopK(density=0.1, min_entries=16), rank, results, "topk")
    compressor_steps(PowerSGD(rank=12, min_compression_rate=0), rank, results, "powersgd_full")
    fit_checks(results)
    results["bf16/exchange"] = bf16_checks.exchange_checks()
    bf16_strategy_checks(results)
    if keras.__name__ == "keras":  # an accuracy claim, not a flavour's behaviour: one launch is enough
        digits_checks(results)
    clip_checks(results)
    resume_checks(rank, args.out, results)
    write_results(args.out, rank, results)


if __name__ == "__main__":
    main()
