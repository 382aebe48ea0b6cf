"""Optimizer state sharded across ranks (`shard_optimizer_state=True`): N ranks against one process.

    horovodrun -np 2 --gloo python tests/multirank/sharded_checks.py --out DIR --part train
    horovodrun -np 4 --gloo python tests/multirank/sharded_checks.py --out DIR --part train --part save
    horovodrun -np 2 --gloo python tests/multirank/sharded_checks.py --out DIR --part resume --saved DIR4
    python tests/multirank/sharded_checks.py --out DIR --reference --saved DIR4   # one process, no strategy

`train`: every case fits the same model on the same data at the same global batch (by
`model.fit`, or all together in one custom loop of `optimizer.apply_gradients`); each rank writes
its final weights, the bytes of its optimizer's variables and how many of its slots are sharded.
`save`: one epoch of Adam, saved by model.save, ModelCheckpoint, BackupAndRestore, tfdist's
Checkpointer and tf.train.Checkpoint. `resume`: each save resumed on this job's rank count for
the second epoch. The reference trains every case (the clipped ones also unclipped), both epochs
of the save case, and loads the sharded job's `model.keras` in one process.
tests/test_sharded.py compares.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import keras_module, quiet_tensorflow, worker_parser, write_results  # noqa: E402

quiet_tensorflow()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

keras = keras_module()
from tfdist.optimizers import LARC, LARS, accumulate_gradients  # noqa: E402

TF_KERAS = keras.__name__ == "tf_keras"

GLOBAL_BATCH, EXAMPLES, EPOCHS = 32, 128, 2
K = keras.optimizers
LSO = keras.mixed_precision.LossScaleOptimizer
# Trained by model.fit, each its own: name -> (optimizer factory, extra compile arguments, strategy options)
FIT_CASES = {
    "adam": (lambda: K.Adam(0.01), {}, {}),
    "adam_loss_scaled": (lambda: LSO(K.Adam(0.01)), {}, {}),
    "loss_scaled_accumulated": (lambda: LSO(accumulate_gradients(K.Adam(0.01), 2)), {}, {}),
    "adam_jit": (lambda: K.Adam(0.01), {"jit_compile": True}, {}),
    "lars_global_clipnorm_jit": (lambda: LARS(0.5, momentum=0.9, global_clipnorm=0.05), {"jit_compile": True}, {}),
    "adam_ema": (lambda: K.Adam(0.01, use_ema=True, ema_overwrite_frequency=3), {}, {}),
    "adam_buckets": (lambda: K.Adam(0.01), {}, {"bucket_mb": 0.0005}),
}
# Trained together in one custom loop (optimizer.apply_gradients in strategy.run; one trace for all)
LOOP_CASES = {
    "sgd_momentum": lambda: K.SGD(0.1, momentum=0.9),
    "adamw": lambda: K.AdamW(0.01, weight_decay=0.1),
    "lars": lambda: LARS(0.5, momentum=0.9, weight_decay=1e-3, eta=0.02),
    "larc": lambda: LARC(K.SGD(0.1, momentum=0.9), mode="scale", weight_decay=1e-4),
    "adam_clipnorm": lambda: K.Adam(0.01, clipnorm=0.05),
    "sgd_global_clipnorm": lambda: K.SGD(0.1, momentum=0.9, global_clipnorm=0.05),
    "sgd_clipvalue": lambda: K.SGD(0.1, momentum=0.9, clipvalue=0.01),
    "adam_accumulated": lambda: accumulate_gradients(K.Adam(0.01), 2),
    "sgd_global_clipnorm_accumulated": lambda: accumulate_gradients(K.SGD(0.1, momentum=0.9, global_clipnorm=0.05), 2),
    "rmsprop": lambda: K.RMSprop(0.01, momentum=0.5, centered=True),
    "adagrad": lambda: K.Adagrad(0.1),
    "adamax": lambda: K.Adamax(0.01),
    "nadam": lambda: K.Nadam(0.01),
    "adadelta": lambda: K.Adadelta(1.0),
    "ftrl": lambda: K.Ftrl(0.1, l1_regularization_strength=0.01, l2_shrinkage_regularization_strength=0.01),
    "lion": lambda: K.Lion(0.003),
    "sgd": lambda: K.SGD(0.1),
}
# On a model whose embedding's gradient is a tf.IndexedSlices with repeated ids (the optimizer's own
# sparse update: Adam's per-entry squares) and whose Dense on a 3-D input has a (None, units) gradient
SPARSE_CASES = {
    "sparse_adam": lambda: K.Adam(0.01),
    "sparse_adamw": lambda: K.AdamW(0.01, weight_decay=0.1),
    "sparse_sgd_momentum": lambda: K.SGD(0.1, momentum=0.9),
    "sparse_sgd": lambda: K.SGD(0.1),
    "sparse_adagrad": lambda: K.Adagrad(0.1),
    "sparse_lars": lambda: LARS(0.5, momentum=0.9, weight_decay=1e-3, eta=0.02),
    "sparse_adam_clipnorm": lambda: K.Adam(0.01, clipnorm=0.05),
    "sparse_adam_global_clipnorm": lambda: K.Adam(0.01, global_clipnorm=0.05),
    "sparse_sgd_clipvalue": lambda: K.SGD(0.1, momentum=0.9, clipvalue=0.01),
}
if TF_KERAS:  # its EMA is refused under sharding (tests/test_sharded.py checks the message)
    del FIT_CASES["adam_ema"]

    class _OwnDeduplication(K.Adam):
        """An Adam whose subclass overrides tf-keras' summing of repeated rows (and calls it)."""

        tfdist_shardable = True  # a subclass of a shardable optimizer says so itself (LIMITS.md)

        def _deduplicate_sparse_grad(self, grads):
            return super()._deduplicate_sparse_grad(grads)

    SPARSE_CASES["sparse_adam_own_deduplication"] = lambda: _OwnDeduplication(0.01)


class ChangedRowsAdam(K.Adam):
    """Adam sent as changed rows (it changes every row it ever touched, so tfdist gathers its
    whole slices): the rows are exact whatever the optimizer."""

    tfdist_shardable = True
    tfdist_row_local = True


SPARSE_CASES["sparse_adam_changed_rows"] = lambda: ChangedRowsAdam(0.01)
CLIPPED = ("adam_clipnorm", "sgd_global_clipnorm", "sgd_clipvalue")
ON_FOUR_RANKS = ("adam", "lars", "sgd_global_clipnorm", "adam_accumulated", "sparse_adam", "sparse_adam_clipnorm",
                 "sparse_sgd")  # (50 rows on 4 ranks are cut flat: rows split between ranks)
WHOLE_SLOTS = ("adam_accumulated", "sgd_global_clipnorm_accumulated", "loss_scaled_accumulated", "adam_ema")


def unclipped(make):
    def make_unclipped():
        optimizer = make()
        return type(optimizer).from_config({**optimizer.get_config(), "clipnorm": None, "global_clipnorm": None,
                                            "clipvalue": None})
    return make_unclipped


def data(kind="dense"):
    rng = np.random.default_rng(1)
    if kind == "sparse":  # 5 ids an example out of 50: ids repeat within every batch
        ids = rng.integers(0, 50, size=(EXAMPLES, 5)).astype("int32")
        return ids, (np.sin(ids).sum(axis=1, keepdims=True)).astype("float32")
    x = rng.normal(size=(EXAMPLES, 8)).astype("float32")
    return x, (x @ rng.normal(size=(8, 1)) * 3).astype("float32")


def loop_model(kind):
    if kind == "sparse":
        return keras.Sequential([keras.Input((5,), dtype="int32"), keras.layers.Embedding(50, 4),
                                 keras.layers.Dense(6, activation="tanh"), keras.layers.GlobalAveragePooling1D(),
                                 keras.layers.Dense(1)])
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(1)])


def build(make_optimizer, strategy, compile_args=None):
    keras.utils.set_random_seed(5)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="tanh"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=make_optimizer(), loss="mse", **(compile_args or {}))
    return model


def optimizer_facts(optimizer):
    """(bytes of its variables, how many of them are sharded slots) on this rank."""
    from tfdist.keras import sharded_saves

    variables = list(optimizer.variables)
    return (sum(np.asarray(v).nbytes for v in variables),
            sum(sharded_saves.slice_of(v) is not None for v in variables))


def train_case(name, strategies):
    make, compile_args, options = FIT_CASES[name]
    started = time.monotonic()
    model = build(make, strategies(options), compile_args)
    x, y = data()
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return describe(name, model, model.optimizer, time.monotonic() - started)


def describe(name, model, optimizer, seconds):
    nbytes, sharded_slots = optimizer_facts(optimizer)
    return {"weights": [np.asarray(w).tolist() for w in model.weights], "bytes": nbytes,
            "sharded_slots": sharded_slots, "whole_slots": name in WHOLE_SLOTS, "seconds": seconds}


def loop_cases(strategy, cases, kind="dense", densify=False):
    """`cases` (name -> optimizer factory), each on its own `kind` of model, trained in one custom
    loop (`densify`: with every gradient made dense first)."""
    if not cases:
        return {}
    started = time.monotonic()
    x, y = data(kind)
    pairs = {}
    for name, make in cases.items():
        keras.utils.set_random_seed(5)
        with strategy.scope():
            model = loop_model(kind)
            optimizer = make()
            optimizer.build(model.trainable_variables)
        pairs[name] = (model, optimizer)

    def replica_step(xb, yb):
        for model, optimizer in pairs.values():
            with tf.GradientTape() as tape:
                per_example = tf.reduce_mean(tf.square(model(xb, training=True) - yb), axis=-1)
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
            variables = model.trainable_variables
            grads = tape.gradient(loss, variables)
            optimizer.apply_gradients(zip([tf.convert_to_tensor(g) for g in grads] if densify else grads, variables))

    step = tf.function(lambda batch: strategy.run(replica_step, args=batch))
    batches = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH))
    for _ in range(EPOCHS):
        for batch in batches:
            step(batch)
    seconds = (time.monotonic() - started) / len(pairs)
    rows_gathers = sum("tfdist_sharded_rows_allgather" in op.name and "Allgather" in op.type
                       for op in step.get_concrete_function(batch).graph.get_operations())  # in the step, all cases
    return {name: {**describe(name, model, optimizer, seconds), "rows_gathers_in_step": rows_gathers}
            for name, (model, optimizer) in pairs.items()}


def loss_scale_skip(strategy):
    """One rank's slice overflows: every rank must skip that step (one decision for all slices).

    The second branch's kernel has one element, so its slice is rank 0's alone; its gradient is
    inf only through the example at index 20, which rank 1 (or the second half of the batch) reads.
    """
    keras.utils.set_random_seed(5)
    x, y = data()
    b = np.ones((EXAMPLES, 1), "float32")
    b[20] = 1e20
    with strategy.scope():
        a_in, b_in = keras.Input((8,)), keras.Input((1,))
        first = keras.layers.Dense(1)(keras.layers.Dense(32, activation="tanh")(a_in))
        second = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")(b_in)
        model = keras.Model([a_in, b_in], [first, second])
        model.compile(optimizer=LSO(K.Adam(0.01)), loss=["mse", "mse"])
    model.fit([x, b], [y, y], batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    return {"weights": [np.asarray(w).tolist() for w in model.weights],
            "scale": float(np.asarray(model.optimizer.loss_scale if TF_KERAS else model.optimizer.dynamic_scale))}


def refusals(strategy):
    """What the sharded strategy refuses, by message: an optimizer it cannot shard exactly."""
    import tfdist

    refused = {}
    makers = {"adafactor": lambda: K.Adafactor(0.01)}
    if TF_KERAS:
        makers["tf_keras_ema"] = lambda: K.Adam(0.01, use_ema=True)
    for name, make in makers.items():
        try:
            model = build(make, strategy)
            x, y = data()
            model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0)
            refused[name] = "trained"
        except tfdist.ShardedStateError as e:
            refused[name] = str(e)
    return refused


def save_case(strategy, out):
    """One epoch of Adam, then every kind of save (every rank calls them, as Keras' callbacks do)."""
    from tfdist.callbacks import Checkpointer

    model = build(lambda: K.Adam(0.01), strategy)
    x, y = data()
    callbacks = [keras.callbacks.ModelCheckpoint(os.path.join(out, "checkpoint.keras")),
                 keras.callbacks.BackupAndRestore(os.path.join(out, "backup"), delete_checkpoint=False),
                 Checkpointer(os.path.join(out, "checkpointer"), strategy=strategy)]
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    model.save(os.path.join(out, "model.keras"))
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(os.path.join(out, "tf_checkpoint"))
    return {"bytes": optimizer_facts(model.optimizer)[0]}


class CountBatches(keras.callbacks.Callback):
    trained = 0

    def on_train_batch_end(self, batch, logs=None):
        self.trained += 1


def resume_cases(strategy, saved):
    """Each save of the sharded job resumed here for the second epoch: the final weights, and the
    batches the resumed fit trained (one epoch's, or it did not resume)."""
    from tfdist.callbacks import Checkpointer

    x, y = data()
    counted = CountBatches()
    fit = {"batch_size": GLOBAL_BATCH, "shuffle": False, "verbose": 0}
    results, batches = {}, {}
    with strategy.scope():
        loaded = keras.models.load_model(os.path.join(saved, "model.keras"))
    loaded.fit(x, y, epochs=1, callbacks=[counted], **fit)
    results["model.save"], batches["model.save"] = loaded, counted.trained
    with strategy.scope():
        loaded = keras.models.load_model(os.path.join(saved, "checkpoint.keras"))
    loaded.fit(x, y, epochs=1, callbacks=[counted], **fit)
    results["ModelCheckpoint"], batches["ModelCheckpoint"] = loaded, counted.trained - sum(batches.values())
    model = build(lambda: K.Adam(0.01), strategy)
    backup = keras.callbacks.BackupAndRestore(os.path.join(saved, "backup"), delete_checkpoint=False)
    model.fit(x, y, epochs=EPOCHS, callbacks=[backup, counted], **fit)
    results["BackupAndRestore"], batches["BackupAndRestore"] = model, counted.trained - sum(batches.values())
    model = build(lambda: K.Adam(0.01), strategy)
    checkpointer = Checkpointer(os.path.join(saved, "checkpointer"), strategy=strategy if hasattr(strategy, "rank") else None)
    model.fit(x, y, epochs=EPOCHS, callbacks=[checkpointer, counted], **fit)
    results["Checkpointer"], batches["Checkpointer"] = model, counted.trained - sum(batches.values())
    model = build(lambda: K.Adam(0.01), strategy)
    model.optimizer.build(model.trainable_variables)
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).read(os.path.join(saved, "tf_checkpoint")).expect_partial()
    model.fit(x, y, epochs=1, callbacks=[counted], **fit)
    results["tf.train.Checkpoint"], batches["tf.train.Checkpoint"] = model, counted.trained - sum(batches.values())
    return {"weights": {name: [np.asarray(w).tolist() for w in m.weights] for name, m in results.items()},
            "batches": batches}


def reference_saves(saved, resume):
    """One process: both epochs of the save case, the sharded job's model.keras loaded here and,
    with `resume`, each of its saves resumed here for the second epoch."""
    strategy = tf.distribute.get_strategy()
    model = build(lambda: K.Adam(0.01), strategy)
    x, y = data()
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    state = [np.asarray(v) for v in model.optimizer.variables]
    loaded = keras.models.load_model(os.path.join(saved, "model.keras"))
    loaded_state = [np.asarray(v) for v in loaded.optimizer.variables]
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    return {"weights": [np.asarray(w).tolist() for w in model.weights],
            "loaded_state_difference": max(float(np.max(np.abs(a - b))) for a, b in zip(state, loaded_state)),
            "shapes_equal": [list(a.shape) for a in state] == [list(b.shape) for b in loaded_state],
            "state_changed": max(float(np.max(np.abs(a))) for a in state[2:]),
            "bytes": optimizer_facts(model.optimizer)[0],
            "resumed": resume_cases(strategy, saved) if resume else None}


def main():
    parser = worker_parser(reference=True)
    parser.add_argument("--part", action="append", default=[])
    parser.add_argument("--saved")
    args = parser.parse_args()
    selected = os.environ["SHARDED_CASES"].split(",") if os.environ.get("SHARDED_CASES") else None  # debugging
    if args.reference:
        strategy = tf.distribute.get_strategy()
        fits = [n for n in FIT_CASES if selected is None or n in selected]
        loops = {n: m for n, m in LOOP_CASES.items() if selected is None or n in selected}
        loops.update({f"{n} unclipped": unclipped(LOOP_CASES[n]) for n in CLIPPED if n in loops})
        sparse = {n: m for n, m in SPARSE_CASES.items() if selected is None or n in selected}
        results = {"cases": {**{n: train_case(n, lambda options: strategy) for n in fits}, **loop_cases(strategy, loops),
                             **loop_cases(strategy, sparse, "sparse")},
                   "loss_scale_skip": loss_scale_skip(strategy),
                   "densified": loop_cases(strategy, {"sparse_adam": SPARSE_CASES["sparse_adam"]}, "sparse", densify=True)}
        results["unclipped"] = {n: results["cases"].pop(f"{n} unclipped") for n in CLIPPED if n in loops}
        if args.saved:
            results["saves"] = reference_saves(args.saved, "resume" in args.part)
        write_results(args.out, 0, results)
        return
    import tfdist

    made = {}

    def strategies(options):
        key = tuple(sorted(options.items()))
        if key not in made:
            made[key] = tfdist.HorovodStrategy(tuning=False, shard_optimizer_state=True, **options)
        return made[key]

    strategy = strategies({})
    results = {}
    if "train" in args.part:
        names = selected or (list(FIT_CASES) + list(LOOP_CASES) + list(SPARSE_CASES) if strategy.size == 2
                             else ON_FOUR_RANKS)
        results["cases"] = {n: train_case(n, strategies) for n in names if n in FIT_CASES}
        results["cases"].update(loop_cases(strategy, {n: LOOP_CASES[n] for n in names if n in LOOP_CASES}))
        results["cases"].update(loop_cases(strategy, {n: SPARSE_CASES[n] for n in names if n in SPARSE_CASES}, "sparse"))
        if strategy.size == 2:
            results["loss_scale_skip"] = loss_scale_skip(strategy)
        results["refusals"] = refusals(strategy)
    if "save" in args.part:
        results["save"] = save_case(strategy, args.out)
    if "resume" in args.part:
        results["resume"] = resume_cases(strategy, args.saved)
    write_results(args.out, strategy.rank, results)


if __name__ == "__main__":
    main()
