"""Multi-rank training checks, one horovodrun launch for many of them.

    horovodrun -np 2 --gloo python tests/multirank/train_checks.py --out DIR
    python tests/multirank/train_checks.py --out DIR --reference   # 1 process, batch x 2

Each rank writes DIR/rank<R>.json; tests/test_multirank.py compares the files with each other
and with the single-process reference.
"""

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import LogMessages, keras_module, quiet_tensorflow, worker_parser, write_results  # noqa: E402

quiet_tensorflow()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402
from tfdist.callbacks import WarmupSchedule  # noqa: E402
from tfdist.optimizers import LARC, LARS, accumulate_gradients  # noqa: E402

keras = keras_module()

OPTIMIZERS = ("sgd_momentum", "adam", "adamw", "lars", "larc_sgd", "sgd_warmup")
PER_RANK_BATCH = 8
STEPS = 5
RANKS = 2  # the reference run stands in for this many ranks


def make_data(kind, n):
    rng = np.random.default_rng(7)
    if kind == "embedding":
        x = rng.integers(0, 20, size=(n, 5)).astype("int32")
    else:
        x = rng.normal(size=(n, 6)).astype("float32")
    y = rng.integers(0, 3, size=n).astype("int32")
    return x, y


def build_model(kind, seed):
    keras.utils.set_random_seed(seed)
    if kind == "embedding":
        layers = [
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(20, 4),
            keras.layers.GlobalAveragePooling1D(),
        ]
    else:
        layers = [keras.Input((6,)), keras.layers.Dense(8, activation="tanh")]
    return keras.Sequential(layers + [keras.layers.Dense(3)])


def make_optimizer(name, lr=0.05):
    if name == "sgd_momentum":
        return keras.optimizers.SGD(lr, momentum=0.9)
    if name == "adam":
        return keras.optimizers.Adam(lr / 10)
    if name == "adamw":
        return keras.optimizers.AdamW(lr / 10, weight_decay=0.01)
    if name == "lars":
        return LARS(lr * 10, momentum=0.9, weight_decay=1e-3, eta=0.01)
    if name == "larc_sgd":
        return LARC(keras.optimizers.SGD(lr, momentum=0.9), mode="clip", weight_decay=1e-3)
    if name == "sgd_warmup":
        return keras.optimizers.SGD(WarmupSchedule(lr, warmup_steps=4, start_learning_rate=lr / 10), momentum=0.9)
    raise ValueError(name)


def loss_fn():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def rank_slice(x, rank, size, batch):
    """Horovod's per-rank convention: step t of `size` ranks covers records [t*size*batch,
    (t+1)*size*batch), and rank r reads its r-th part (what the global convention does itself)."""
    steps = len(x) // (size * batch)
    idx = [t * size * batch + rank * batch + i for t in range(steps) for i in range(batch)]
    return x[idx]


def weights_of(model):
    return [w.tolist() for w in model.get_weights()]


def equivalence_checks(strategy, reference, results):
    """Train each (model, optimizer) for STEPS steps at one global batch: 2 ranks or 1 process.

    Every rank passes the same full arrays, as a MirroredStrategy user would: the strategy splits
    each global batch of 16 into 8 per rank.
    """
    rank = strategy.rank
    batch = PER_RANK_BATCH * RANKS
    for kind in ("dense", "embedding"):
        x, y = make_data(kind, batch * STEPS)
        for opt in OPTIMIZERS:
            with strategy.scope():
                model = build_model(kind, seed=1000 + 17 * rank)  # different seed per rank
                model.compile(optimizer=make_optimizer(opt), loss=loss_fn())
            initial = weights_of(model)
            model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
            results[f"{kind}/{opt}"] = {"initial": initial, "final": weights_of(model)}


def sync_batchnorm_check(strategy, results):
    """BatchNormalization(synchronized=True): moving statistics of the global batch's last step."""
    rows = np.arange(1, 33, dtype="float32")[:, None]  # rank 1's halves have larger values
    x = np.random.default_rng(0).normal(size=(32, 3)).astype("float32") * rows
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization(synchronized=True, momentum=0.0),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    model.fit(x, np.zeros((32, 1), "float32"), batch_size=PER_RANK_BATCH * RANKS, shuffle=False, verbose=0)
    results["sync_batchnorm"] = [w.tolist() for w in model.layers[0].get_weights()[2:]]


def per_rank_convention_check(reference, results):
    """HorovodStrategy(batch_convention="per_rank"): each rank's own slices, batched per rank."""
    strategy = tfdist.HorovodStrategy(batch_convention="per_rank", tuning=False)
    rank, size = strategy.rank, strategy.size
    x, y = make_data("dense", PER_RANK_BATCH * RANKS * STEPS)
    with strategy.scope():
        model = build_model("dense", seed=1000 + 17 * rank)
        model.compile(optimizer=make_optimizer("sgd_momentum"), loss=loss_fn())
    if reference:
        model.fit(x, y, batch_size=PER_RANK_BATCH * RANKS, epochs=1, shuffle=False, verbose=0)
    else:
        model.fit(rank_slice(x, rank, size, PER_RANK_BATCH), rank_slice(y, rank, size, PER_RANK_BATCH),
                  batch_size=PER_RANK_BATCH, epochs=1, shuffle=False, verbose=0)
    results["per_rank_convention"] = {"final": weights_of(model),
                                      "steps": int(model.optimizer.iterations.numpy())}


def accumulation_and_compression_checks(strategy, reference, results):
    """Gradient accumulation (2 micro-steps) and fp16-compressed gradients.

    Global batch 2B accumulated over 2 micro-batches per update; reference: one process, batch 4B.
    """
    x, y = make_data("dense", PER_RANK_BATCH * RANKS * 2 * STEPS)
    with strategy.scope():
        model = build_model("dense", seed=3)
        optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
        model.compile(optimizer=optimizer if reference else accumulate_gradients(optimizer, 2), loss=loss_fn())
    batch = PER_RANK_BATCH * RANKS * (2 if reference else 1)
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    results["accumulation"] = weights_of(model)
    # fp16 compression on the ranks; the reference trains uncompressed, both at global batch 2B
    compressed = tfdist.HorovodStrategy(compression="fp16")
    with compressed.scope():
        model = build_model("dense", seed=1000)
        model.compile(optimizer=make_optimizer("sgd_momentum"), loss=loss_fn())
    model.fit(x, y, batch_size=PER_RANK_BATCH * RANKS, epochs=1, shuffle=False, verbose=0)
    results["fp16_compression"] = weights_of(model)


def bucket_checks(reference, results):
    """HorovodStrategy(bucket_mb=...): gradients exchanged in buckets train exactly as one collective,
    and the traced step holds one grouped allreduce per bucket (each can start on its own)."""
    strategy = tfdist.HorovodStrategy(bucket_mb=1e-4, tuning=False)  # tinier than any gradient: 1 each
    x, y = make_data("dense", PER_RANK_BATCH * RANKS * STEPS)
    with strategy.scope():
        model = build_model("dense", seed=1000 + 17 * strategy.rank)
        model.compile(optimizer=make_optimizer("adam"), loss=loss_fn())
    model.fit(x, y, batch_size=PER_RANK_BATCH * RANKS, epochs=1, shuffle=False, verbose=0)
    results["bucketed/adam"] = {"final": weights_of(model)}
    if reference:
        return
    results["bucketed/allreduce_ops"] = allreduce_ops_per_step(strategy, model, x, y)
    results["bucketed/variables"] = len(model.trainable_variables)
    # the default schedule: each gradient its own collective, enqueued as soon as it exists
    ready = tfdist.HorovodStrategy(tuning=False)
    with ready.scope():
        model = build_model("dense", seed=1000 + 17 * ready.rank)
    results["ready/allreduce_ops"] = allreduce_ops_per_step(ready, model, x, y)


def allreduce_ops_per_step(strategy, model, x, y):
    """Grouped allreduces in one traced gradient sum under `strategy`."""
    @tf.function
    def step(xb, yb):
        def replica(xb, yb):  # noqa: ARG001
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(model(xb, training=True))  # any scalar: only the graph's ops matter
            grads = tape.gradient(loss, model.trainable_variables)
            return tf.distribute.get_replica_context().all_reduce("sum", grads)
        return strategy.run(replica, (xb, yb))

    graph = step.get_concrete_function(tf.constant(x[:PER_RANK_BATCH]), tf.constant(y[:PER_RANK_BATCH])).graph
    return sum(op.type == "HorovodGroupedAllreduce" for op in graph.get_operations())


def metric_checks(strategy, results):
    """History, evaluate() and predict() against values computed by hand from all the data."""
    x, y = make_data("dense", 400)
    with strategy.scope():
        model = build_model("dense", seed=5)
        # lr 0 keeps the weights fixed, so the epoch's running loss is a plain mean we can recompute.
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss=loss_fn(), metrics=["accuracy"])
    steps = []
    count = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: steps.append(batch))
    fit_x, fit_y = x[:96], y[:96]
    history = model.fit(fit_x, fit_y, batch_size=PER_RANK_BATCH * RANKS, epochs=1, shuffle=False,
                        verbose=0, callbacks=[count])

    # Uneven evaluation: 53 records at global batch 16 end with a partial batch split 3 + 2.
    ev_x, ev_y = x[100:153], y[100:153]
    evaluated = model.evaluate(ev_x, ev_y, batch_size=PER_RANK_BATCH * RANKS, verbose=0, return_dict=True)
    predicted = model.predict(ev_x, batch_size=PER_RANK_BATCH * RANKS, verbose=0)

    def by_hand(xs, ys):
        logits = model(xs, training=False).numpy()  # this process alone, every record
        per_example = loss_fn().__class__(from_logits=True, reduction="none")(ys, logits).numpy()
        correct = (np.argmax(logits, axis=-1) == ys).astype("float32")
        return {"loss": float(per_example.mean()), "accuracy": float(correct.mean()),
                "count": int(len(per_example)), "logits": logits}

    ev_by_hand = by_hand(ev_x, ev_y)
    # Fewer records than one global batch: Keras makes a batch of 5, split 3 + 2 (a warning).
    with strategy.scope():
        fresh = build_model("dense", seed=5)
        fresh.compile(optimizer=keras.optimizers.SGD(0.0), loss=loss_fn(), metrics=["accuracy"])
    tiny = fresh.evaluate(x[:5], y[:5], batch_size=PER_RANK_BATCH * RANKS, verbose=0, return_dict=True)
    results["metrics"] = {
        "history": {k: float(v[0]) for k, v in history.history.items()},
        "fit_steps": len(steps),
        "fit_by_hand": {k: v for k, v in by_hand(fit_x, fit_y).items() if k != "logits"},
        "evaluate": {k: float(v) for k, v in evaluated.items()},
        "evaluate_by_hand": {k: v for k, v in ev_by_hand.items() if k != "logits"},
        "tiny_evaluate": {k: float(v) for k, v in tiny.items()},
        "tiny_by_hand": {k: v for k, v in by_hand(x[:5], y[:5]).items() if k != "logits"},
        "predict_rows": int(len(predicted)),
        "predict_max_error": float(np.abs(predicted - ev_by_hand["logits"]).max()),
    }


def shuffle_check(strategy, results):
    """fit(x, y, shuffle=True) with no seed set: which example ids each rank trains on, per epoch."""
    seen = []

    def record(ids):
        seen.extend(int(v) for v in ids.numpy()[:, 0])
        return ids

    class Recorder(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

        def train_step(self, data):
            tf.py_function(record, [data[0]], [tf.float32])
            return {"n": tf.constant(0.0)}

    ids = np.arange(96, dtype="float32")[:, None]
    with strategy.scope():
        model = Recorder()
        model.compile(optimizer="sgd", loss="mse")
    model.fit(ids, ids, batch_size=PER_RANK_BATCH * RANKS, epochs=2, verbose=0, shuffle=True)
    results["shuffled_ids"] = [seen[:48], seen[48:]]


def strategy_facts(strategy, results):
    results["facts"] = {
        "rank": strategy.rank,
        "size": strategy.size,
        "local_rank": strategy.local_rank,
        "local_size": strategy.local_size,
        "is_chief": strategy.is_chief,
        "num_replicas_in_sync": strategy.num_replicas_in_sync,
        "should_checkpoint": strategy.extended.should_checkpoint,
        "chief_path_is_own": strategy.chief_path("/tmp/ckpt/model.keras") == "/tmp/ckpt/model.keras",
        "tuning": strategy.tuning_plan.as_dict(),
        "affinity_now": sorted(os.sched_getaffinity(0)),
        "intra_op_now": tf.config.threading.get_intra_op_parallelism_threads(),
        "transport": tfdist.collectives.transport(strategy.extended.worker_devices[0]),
    }
    rank_tensor = tf.constant([[float(strategy.rank)] * 2])
    results["facts"]["gathered"] = strategy.gather(rank_tensor, axis=0).numpy().tolist()
    results["facts"]["gathered_axis1"] = strategy.gather(rank_tensor, axis=1).numpy().tolist()
    results["facts"]["reduced_sum"] = float(
        strategy.reduce(tf.distribute.ReduceOp.SUM, tf.constant(strategy.rank + 1.0), axis=None)
    )
    # object exchanges of any size: 200 kB from rank 0, and lists whose lengths differ by rank
    big = {"text": "x" * 200_000, "rank": strategy.rank} if strategy.rank == 0 else None
    received = tfdist.collectives.broadcast_object(big)
    results["facts"]["broadcast_object"] = [len(received["text"]), received["rank"]]
    results["facts"]["allgather_object"] = tfdist.collectives.allgather_object(list(range(strategy.rank * 3000)))
    results["facts"]["after_uneven_eager_work"] = collectives_after_uneven_eager_work(strategy)
    contexts = []

    def dataset_fn(ctx):
        contexts.append((ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync))
        return tf.data.Dataset.range(10).shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(2)

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    seen = [int(v) for batch in dist for v in strategy.experimental_local_results(batch)[0].numpy()]
    results["facts"]["input_context"] = list(contexts[0])
    results["facts"]["records_seen"] = seen


def collectives_after_uneven_eager_work(strategy):
    """Collectives in a tf.function on tensors it captures, after rank 0 alone ran eager ops.

    Chief-only work (a log line, a save) is everywhere; it shifts the process-wide counter that
    names captured eager tensors, so Horovod's default collective names would differ by rank and
    the job would wait forever.
    """
    if strategy.rank == 0:
        _ = [tf.constant(float(i)) * 2.0 for i in range(7)]
    captured = tf.constant([strategy.rank + 1.0, 10.0 * (strategy.rank + 1)])

    def replica_fn():
        ctx = tf.distribute.get_replica_context()
        return (ctx.all_reduce(tf.distribute.ReduceOp.SUM, captured), ctx.all_gather(captured, axis=0))

    @tf.function
    def step():
        summed, gathered = strategy.run(replica_fn)
        return summed, gathered, strategy.reduce(tf.distribute.ReduceOp.MEAN, captured, axis=None)

    summed, gathered, mean = step()
    return {"sum": summed.numpy().tolist(), "gather": gathered.numpy().tolist(), "mean": mean.numpy().tolist()}


def uneven_batch_warning_checks(strategy, results):
    """fit at global batches 2 ranks do not divide (arrays, tensors, tf.data): what each rank warns."""
    handler = LogMessages(logging.WARNING)
    logger = logging.getLogger("tfdist")
    logger.addHandler(handler)
    x, y = make_data("dense", 60)
    with strategy.scope():
        model = build_model("dense", 3)
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss_fn())
    model.fit(x, y, batch_size=15, epochs=2, verbose=0)  # numpy arrays
    model.fit(x, y, batch_size=15, epochs=1, verbose=0)  # the same batch again: warned already
    model.fit(tf.constant(x), tf.constant(y), batch_size=13, epochs=1, verbose=0)  # tensors
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(11), epochs=1, verbose=0)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # divisible (16, 16, 16, 12): no warning
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=1, verbose=0)
    logger.removeHandler(handler)
    results["uneven_warnings"] = [t for t in handler.texts if "global batch" in t]


def cycle_checks(strategy, results):
    """Horovod's cycle (tfdist's CPU default: the job leaves it unset): each enqueued collective
    starts one (allreduces far shorter than a 400 ms cycle); then, as where Horovod cannot, after
    a fit of 16 steps: what tfdist measured and chose, what Horovod reports, what the chief printed."""
    import contextlib, ctypes, io, time

    import horovod.tensorflow as hvd

    from tfdist import _compat_state
    from tfdist.keras import step_clock
    from tfdist.tuning import cycle

    x, y = make_data("dense", 128)
    with strategy.scope():
        model = build_model("dense", 5)
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss_fn())
    library = _compat_state.horovod_ctypes_library()
    library.horovod_cycle_time_ms.restype = ctypes.c_double
    results["cycle_before"] = {"choice": cycle.choice(), "horovod_reports_ms": library.horovod_cycle_time_ms(),
                               "starts_on_enqueue": cycle.starts_on_enqueue()}
    cycle.set_cycle_ms(400)
    results["allreduce_ms_at_400_ms_cycle"] = times = []
    for i in range(5):
        start = time.perf_counter()
        hvd.allreduce(tf.ones([1000]), name=f"on_enqueue_{i}").numpy()
        times.append((time.perf_counter() - start) * 1000)
    cycle.set_cycle_ms(10)
    cycle.follow_steps(library.horovod_cycle_time_ms())  # as where Horovod waits for its cycle
    step_clock.install()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    results["cycle"] = {"choice": cycle.choice(), "horovod_reports_ms": library.horovod_cycle_time_ms(),
                        "printed": [line for line in printed.getvalue().splitlines() if "Horovod cycle" in line]}


def main():
    args = worker_parser(reference=True).parse_args()
    strategy = tfdist.HorovodStrategy()
    results = {"keras": keras.__name__}
    if not args.reference:
        shuffle_check(strategy, results)  # first: before the other checks set per-rank seeds
    equivalence_checks(strategy, args.reference, results)
    per_rank_convention_check(args.reference, results)
    sync_batchnorm_check(strategy, results)
    accumulation_and_compression_checks(strategy, args.reference, results)
    bucket_checks(args.reference, results)
    if not args.reference:
        metric_checks(strategy, results)
        strategy_facts(strategy, results)
        uneven_batch_warning_checks(strategy, results)
        cycle_checks(strategy, results)
    write_results(args.out, strategy.rank, results)


if __name__ == "__main__":
    main()
