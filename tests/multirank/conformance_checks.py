"""tf.distribute conformance: one client program, written as a MirroredStrategy /
MultiWorkerMirroredStrategy user writes it, run under three runners.

    horovodrun -np 2 --gloo python tests/multirank/conformance_checks.py --strategy horovod --out DIR   # or -np 4
    TF_CONFIG=... python tests/multirank/conformance_checks.py --strategy mwms --out DIR   # x 2 workers
    python tests/multirank/conformance_checks.py --strategy single --out DIR               # 1 process

`horovod` is `tfdist.HorovodStrategy()`, `mwms` is `tf.distribute.MultiWorkerMirroredStrategy()`
(workers from TF_CONFIG; tf-keras only, Keras 3's fit does not run under MWMS), `single` is one
process under the default strategy, fed the same global batches: the oracle.

Every scenario below is client code that only uses the `tf.distribute.Strategy` API; the runner
only picks the strategy. Each worker writes DIR/rank<W>.json with one entry per scenario (or
{"error": ...} if the scenario raised); tests/test_conformance.py compares the runners.
Datasets are batched by the GLOBAL batch (16), as the tf.distribute contract asks.

Scenarios: custom_loop (the "Custom training with tf.distribute.Strategy" tutorial flow),
keras_fit (fit on a dataset and on numpy), collectives (reduce, gather, all_reduce, all_gather,
InputContext), input (auto-shard policies; reduce/gather of iterator batches), evaluate_predict
(uneven data), callbacks (ModelCheckpoint, TensorBoard, EarlyStopping, BackupAndRestore: who
writes what), lazy_variables (variables created inside a traced strategy.run), variables
(initial value, aggregation, sync-on-read), the tutorials' flows (tutorial_flows.py) and XLA
(xla_flows.py) and what the reference's own tests do (reference_flows.py). `single` skips
the ones that need 2 replicas; `mwms` skips XLA. Any number of
ranks (the suite runs 2 and 4).

`--only SCENARIO ...` runs a subset (the suite's 4-rank tf-keras launch runs the XLA ones); `--batch-convention per_rank` builds
`HorovodStrategy(batch_convention="per_rank")`, which the suite must tell apart (its input and
row-count checks fail).
"""

import faulthandler
import json
import os
import signal
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import input_step_collectives, iterator_kinds, keras_module, quiet_tensorflow, worker_parser, write_results  # noqa: E402

quiet_tensorflow()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from client_code import GLOBAL, build_model, dense, initial_values, local, make_data, seed_for, weights_of  # noqa: E402
from reference_flows import LAST_SCENARIOS, REFERENCE_SCENARIOS  # noqa: E402
from tutorial_flows import TUTORIAL_SCENARIOS  # noqa: E402
from xla_flows import XLA_SCENARIOS, dump_xla_modules  # noqa: E402

keras = keras_module()

SUM, MEAN = tf.distribute.ReduceOp.SUM, tf.distribute.ReduceOp.MEAN
POLICIES = ("AUTO", "FILE", "DATA", "OFF")


class Run:
    """What the harness knows about this process: the strategy, this worker's index (from the
    launcher's environment; it stands for the data a worker holds), and the shared directory."""

    def __init__(self, kind, strategy, out):
        self.kind = kind
        self.strategy = strategy
        self.out = out
        if kind == "horovod":
            self.worker = int(os.environ.get("HOROVOD_RANK", "0"))
        elif kind == "mwms":
            self.worker = int(json.loads(os.environ["TF_CONFIG"])["task"]["index"])
        else:
            self.worker = 0
        self.files = os.path.join(out, "files")  # shared by all workers (same file system)
        self.writes = []  # this process's Python-level writes under self.files

    def barrier(self):
        """Every worker has reached this point (a cross-worker reduce of a plain tensor)."""
        return float(self.strategy.reduce(SUM, tf.constant(1.0), axis=None))


def make_strategy(kind, horovod_options=None):
    if kind == "horovod":
        import tfdist

        return tfdist.HorovodStrategy(**(horovod_options or {}))
    if kind == "mwms":
        return tf.distribute.MultiWorkerMirroredStrategy()
    return tf.distribute.get_strategy()


# --- 1. custom training loop (the TF tutorial flow) -----------------------------------------
def custom_loop(run):
    strategy = run.strategy
    x, y = make_data(96)
    with strategy.scope():
        model = build_model(seed_for(run, 11))
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)  # momentum slots created in the traced step
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    initial = weights_of(model)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)

    def train_step(inputs):
        features, labels = inputs
        with tf.GradientTape() as tape:
            logits = model(features, training=True)
            loss = tf.nn.compute_average_loss(loss_object(labels, logits), global_batch_size=GLOBAL)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss, tf.shape(features)[0]

    @tf.function
    def distributed_train_step(inputs):
        per_replica_loss, per_replica_rows = strategy.run(train_step, args=(inputs,))
        return strategy.reduce(SUM, per_replica_loss, axis=None), per_replica_rows

    losses, rows = [], []
    for inputs in dist_dataset:
        loss, per_replica_rows = distributed_train_step(inputs)
        losses.append(float(loss))
        rows.append(sum(local(strategy, per_replica_rows)))
    return {
        "losses": losses,
        "local_rows": rows,
        "initial": initial,
        "final": weights_of(model),
        "optimizer_variables": [np.asarray(v).tolist() for v in optimizer.variables
                                if np.asarray(v).ndim > 0],
    }


# --- 2. Keras fit, dataset and numpy ---------------------------------------------------------
class StepCounter(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.per_epoch = []

    def on_epoch_begin(self, epoch, logs=None):
        self.per_epoch.append(0)

    def on_train_batch_end(self, batch, logs=None):
        self.per_epoch[-1] += 1


ROWS_SEEN = []  # rows of every training step on this worker, appended by RowCountingModel


def _record_rows(n):
    ROWS_SEEN.append(int(n))
    return np.int64(n)


class RowCountingModel(keras.Sequential):
    """A Sequential model whose train_step records how many rows this worker's step got."""

    def train_step(self, data):
        tf.numpy_function(_record_rows, [tf.shape(data[0])[0]], tf.int64, stateful=True)
        return super().train_step(data)


def keras_fit(run):
    strategy = run.strategy
    x, y = make_data(96, seed=8)
    results = {}
    for source in ("dataset", "numpy"):
        with strategy.scope():
            model = build_model(seed_for(run, 21), RowCountingModel)
            model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"])
        initial = weights_of(model)
        ROWS_SEEN.clear()
        counter = StepCounter()
        if source == "dataset":
            dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL)
            history = model.fit(dataset, epochs=2, verbose=0, callbacks=[counter])
        else:
            history = model.fit(x, y, batch_size=GLOBAL, epochs=1, shuffle=False, verbose=0, callbacks=[counter])
        results[source] = {
            "steps_per_epoch": counter.per_epoch,
            "rows_per_step": list(ROWS_SEEN),
            "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
            "initial": initial,
            "final": weights_of(model),
        }
    return results


# --- 3. collectives --------------------------------------------------------------------------
def collectives(run):
    strategy = run.strategy
    w = run.worker  # stands for the data a worker holds: worker 0 and worker 1 hold different values
    even_value = tf.constant([[w + 1.0, 10.0 * (w + 1)], [100.0 * (w + 1), -1.0 - w]])  # 2x2 on every worker
    uneven_rows = 2 + w  # 2 rows on worker 0, 3 on worker 1
    uneven_value = tf.reshape(tf.range(uneven_rows * 2, dtype=tf.float32) + 10.0 * (w + 1), (uneven_rows, 2))

    def replica_even():
        return tf.identity(even_value)

    def replica_uneven():
        return tf.identity(uneven_value)

    def in_replica():
        ctx = tf.distribute.get_replica_context()
        x = tf.constant(42.0)
        c = tf.constant(w + 1.0)
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            y_sum = ctx.all_reduce(SUM, x) * c
            y_mean = ctx.all_reduce(MEAN, x) * c
        return {
            "all_reduce_sum": ctx.all_reduce(SUM, even_value),
            "all_reduce_mean": ctx.all_reduce(MEAN, even_value),
            "all_reduce_nested": ctx.all_reduce(SUM, {"a": tf.constant(w + 1.0), "b": even_value[0]}),
            "all_gather_axis0": ctx.all_gather(even_value, axis=0),
            "all_gather_axis1": ctx.all_gather(even_value, axis=1),
            "grad_all_reduce_sum": tape.gradient(y_sum, x),
            "grad_all_reduce_mean": tape.gradient(y_mean, x),
            "replica_id_in_sync_group": tf.cast(ctx.replica_id_in_sync_group, tf.int32),
            "num_replicas_in_sync": tf.cast(ctx.num_replicas_in_sync, tf.int32),
        }

    def in_replica_uneven_gather():
        ctx = tf.distribute.get_replica_context()
        return ctx.all_gather(uneven_value, axis=0)

    def cross_replica(call):
        even = call(replica_even)
        uneven = call(replica_uneven)
        return {
            "reduce_sum_none": strategy.reduce(SUM, even, axis=None),
            "reduce_mean_none": strategy.reduce(MEAN, even, axis=None),
            "reduce_sum_axis0": strategy.reduce(SUM, uneven, axis=0),
            "reduce_mean_axis0": strategy.reduce(MEAN, uneven, axis=0),
            "gather_axis0": strategy.gather(uneven, axis=0),
            "gather_axis1": strategy.gather(even, axis=1),
            "reduce_sum_plain_tensor": strategy.reduce(SUM, tf.constant(w + 1.0), axis=None),
            "reduce_mean_plain_tensor": strategy.reduce(MEAN, tf.constant(w + 1.0), axis=None),
        }

    results = {"num_replicas_in_sync": strategy.num_replicas_in_sync}
    for mode in ("eager", "function"):
        wrap = tf.function if mode == "function" else (lambda f: f)
        out = {}
        for name, fn in (
            ("cross_replica", wrap(lambda: cross_replica(strategy.run))),
            ("replica", wrap(lambda: strategy.run(in_replica))),
            ("replica_uneven_all_gather", wrap(lambda: strategy.run(in_replica_uneven_gather))),
        ):
            try:
                value = fn()
                out[name] = tf.nest.map_structure(
                    lambda v: [np.asarray(t).tolist() for t in strategy.experimental_local_results(v)], value)
            except Exception as e:  # noqa: BLE001 - recorded, compared across runners
                out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        out["local_results"] = local(strategy, strategy.run(replica_uneven))
        results[mode] = out

    contexts = []

    def dataset_fn(input_context):
        contexts.append({
            "num_input_pipelines": input_context.num_input_pipelines,
            "input_pipeline_id": input_context.input_pipeline_id,
            "num_replicas_in_sync": input_context.num_replicas_in_sync,
            "per_replica_batch_size": input_context.get_per_replica_batch_size(GLOBAL),
        })
        ds = tf.data.Dataset.range(40).shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        return ds.batch(input_context.get_per_replica_batch_size(GLOBAL))

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    seen = [local(strategy, batch) for batch in dist]
    results["input_context"] = contexts
    results["from_function_batches"] = seen
    return results


# --- 4. input: auto-shard policies --------------------------------------------------------
FILE_LINES = (10, 10, 10, 7)  # 37 elements: the last global batch is partial (16, 16, 5)


def write_text_files(directory):
    os.makedirs(directory, exist_ok=True)
    start = 0
    for i, n in enumerate(FILE_LINES):
        with open(os.path.join(directory, f"part-{i}.txt"), "w") as f:
            f.write("".join(f"{start + j}\n" for j in range(n)))
        start += n


def input_pipelines(run):
    strategy = run.strategy
    directory = os.path.join(run.out, f"text-w{run.worker}")  # each worker its own (identical) copy
    write_text_files(directory)
    total = sum(FILE_LINES)

    def files_dataset():
        ds = tf.data.Dataset.list_files(os.path.join(directory, "part-*.txt"), shuffle=False)
        ds = ds.interleave(tf.data.TextLineDataset, cycle_length=1)
        return ds.map(lambda line: tf.strings.to_number(line, tf.int64)).batch(GLOBAL)

    def slices_dataset():
        return tf.data.Dataset.from_tensor_slices(np.arange(total, dtype=np.int64)).batch(GLOBAL)

    results = {}
    for source, make in (("files", files_dataset), ("slices", slices_dataset)):
        for policy in POLICIES:
            dataset = make()
            options = tf.data.Options()
            options.experimental_distribute.auto_shard_policy = getattr(
                tf.data.experimental.AutoShardPolicy, policy)
            dataset = dataset.with_options(options)
            try:
                dist = strategy.experimental_distribute_dataset(dataset)
                results[f"{source}/{policy}"] = {"batches": [local(strategy, b)[0] for b in dist],
                                                 "step_collectives": input_step_collectives(dist)}
            except Exception as e:  # noqa: BLE001 - compared across runners
                results[f"{source}/{policy}"] = {"error": type(e).__name__, "message": str(e)[:300]}

    # Values straight from the iterator (PerReplica batches), reduced and gathered across workers
    # in a tf.function (eager reduce/gather are in `collectives`): 37 elements (unequal last
    # parts) and 32 (equal parts).
    batch_ops = {
        "reduce_sum_axis0": lambda b: strategy.reduce(SUM, b, axis=0),
        "reduce_mean_axis0": lambda b: strategy.reduce(MEAN, b, axis=0),
        "gather_axis0": lambda b: strategy.gather(b, axis=0),
        "reduce_sum_rows": lambda b: strategy.reduce(SUM, strategy.run(lambda t: tf.shape(t)[0], args=(b,)), axis=None),
        "reduce_sum_none": lambda b: strategy.reduce(SUM, b, axis=None),  # needs equal shapes: 32 only
    }
    for mode in ("function",):
        wrap = tf.function
        for n, ops in ((total, [op for op in batch_ops if op != "reduce_sum_none"]), (32, ["reduce_sum_none"])):
            functions = {op: wrap(batch_ops[op]) for op in ops}
            outputs = {op: [] for op in ops}
            dist = strategy.experimental_distribute_dataset(
                tf.data.Dataset.from_tensor_slices(np.arange(n, dtype=np.float64)).batch(GLOBAL))
            for batch in dist:
                for op in ops:
                    if isinstance(outputs[op], list):
                        try:
                            outputs[op].append(np.asarray(functions[op](batch)).tolist())
                        except Exception as e:  # noqa: BLE001
                            outputs[op] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            for op in ops:
                results[f"batch_values/{op}/{mode}"] = outputs[op]
    # How batches reach the replica: TF's MultiDeviceIterator, or a plain iterator (tfdist on a CPU rank)
    results["iterator_kinds"] = {
        "dataset": sorted(iterator_kinds(strategy.experimental_distribute_dataset(slices_dataset()))),
        "from_function": sorted(iterator_kinds(strategy.distribute_datasets_from_function(
            lambda ctx: slices_dataset().shard(ctx.num_input_pipelines, ctx.input_pipeline_id)))),
    }
    return results


# --- 5. evaluate and predict on uneven data -------------------------------------------------
def evaluate_predict(run):
    strategy = run.strategy
    x, y = make_data(53, seed=9)
    with strategy.scope():
        model = build_model(seed_for(run, 31))
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL)
    return {
        "evaluate_numpy": model.evaluate(x, y, batch_size=GLOBAL, verbose=0, return_dict=True),
        "evaluate_dataset": model.evaluate(dataset, verbose=0, return_dict=True),
        "predict_numpy": model.predict(x, batch_size=GLOBAL, verbose=0),
        "predict_dataset": model.predict(tf.data.Dataset.from_tensor_slices(x).batch(GLOBAL), verbose=0),
        "weights": weights_of(model),
    }


# --- 6. callbacks ------------------------------------------------------------------------
def listing(root):
    """Files under `root` (relative paths), or None if it does not exist."""
    if not os.path.isdir(root):
        return None
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


class ListAfterEpoch(keras.callbacks.Callback):
    """After every worker finished the epoch's callbacks: what the requested directory holds."""

    def __init__(self, run, root):
        super().__init__()
        self.run, self.root, self.per_epoch = run, root, []

    def on_epoch_end(self, epoch, logs=None):
        self.run.barrier()
        self.per_epoch.append(listing(self.root))


def callbacks_fit(run):
    """ModelCheckpoint + TensorBoard + EarlyStopping in one fit, BackupAndRestore in a second."""
    strategy = run.strategy
    x, y = make_data(32, seed=10)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL)
    ckpt_dir, tb_dir, backup_dir = (os.path.join(run.files, d) for d in ("ckpt", "tb", "backup"))

    def compiled_model():
        with strategy.scope():
            model = build_model(seed_for(run, 41))
            model.compile(optimizer=keras.optimizers.SGD(0.05),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    results = {"pid": os.getpid()}
    # (a) checkpoints every epoch, TensorBoard logs, and early stopping: epochs 0-1 learn, then a
    # far too large learning rate makes the loss rise, and EarlyStopping(patience=0) stops there.
    model = compiled_model()
    stopper = keras.callbacks.EarlyStopping(monitor="loss", patience=0)
    try:
        history = model.fit(dataset, epochs=8, verbose=0, callbacks=[
            keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.05 if epoch < 2 else 40.0),
            keras.callbacks.ModelCheckpoint(os.path.join(ckpt_dir, "model-{epoch:02d}.keras")),
            keras.callbacks.TensorBoard(tb_dir, profile_batch=0, write_graph=False),
            keras.callbacks.CSVLogger(os.path.join(run.files, "log.csv"), append=True),
            stopper,
        ])
        print(f"worker {run.worker}: the checkpoint fit ran {len(history.epoch)} epochs, losses "
              f"{history.history['loss']}", flush=True)  # (a rank that stops alone leaves the others waiting)
        results["checkpoint_tensorboard_earlystop"] = {
            "completed": True,
            "epochs_run": len(history.epoch),
            "stopped_epoch": int(stopper.stopped_epoch),
            "loss": [float(v) for v in history.history["loss"]],
        }
    except Exception as e:  # noqa: BLE001
        print(f"worker {run.worker}: the checkpoint fit raised:\n{traceback.format_exc()}", flush=True)
        results["checkpoint_tensorboard_earlystop"] = {"error": f"{type(e).__name__}: {str(e)[:300]}",
                                                       "traceback": traceback.format_exc()[-2000:]}
    run.barrier()
    results["ckpt_listing"] = listing(ckpt_dir)
    results["tb_listing"] = listing(tb_dir)
    csv_path = os.path.join(run.files, "log.csv")
    results["csv"] = open(csv_path).read().splitlines() if os.path.exists(csv_path) else None
    # (b) BackupAndRestore: the backup exists while training, and is removed at the end.
    model = compiled_model()
    lister = ListAfterEpoch(run, backup_dir)
    try:
        history = model.fit(dataset, epochs=2, verbose=0, callbacks=[
            keras.callbacks.BackupAndRestore(backup_dir), lister])
        results["backup_and_restore"] = {"completed": True, "epochs_run": len(history.epoch)}
    except Exception as e:  # noqa: BLE001
        results["backup_and_restore"] = {"error": f"{type(e).__name__}: {str(e)[:300]}",
                                         "traceback": traceback.format_exc()[-2000:]}
    run.barrier()
    results["backup_listing_per_epoch"] = lister.per_epoch
    results["backup_listing_after"] = listing(backup_dir)
    results["writes"] = sorted(set(run.writes))
    return results


def install_write_audit(run):
    """Record this process's Python-level file writes under run.files (zipfile, json, h5 metadata)."""
    root = os.path.realpath(run.files) + os.sep
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def note(path):
        if isinstance(path, (str, bytes, os.PathLike)):
            full = os.path.realpath(os.fsdecode(path))
            if full.startswith(root):
                run.writes.append(os.path.relpath(full, root))

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                    mode is None and isinstance(flags, int) and flags & write_flags):
                note(path)
        elif event in ("os.rename", "os.replace"):
            note(args[1])
        elif event in ("os.mkdir", "os.remove"):
            note(args[0])

    sys.addaudithook(hook)


# --- 7. variables created lazily inside strategy.run -----------------------------------------
def lazy_variables(run):
    strategy = run.strategy
    x, _ = make_data(32, seed=12)
    with strategy.scope():
        # Not built: their variables appear on the first call, inside the traced step. `fixed`
        # starts from worker-dependent numpy values (comparable with the single process), `drawn`
        # from Keras' random initializer under a worker-dependent seed.
        fixed = dense(3, seed_for(run, 51), 4)
        keras.utils.set_random_seed(seed_for(run, 52))
        drawn = keras.layers.Dense(2)
        optimizer = keras.optimizers.Adam(0.01)  # slots also created inside the step
    dist_dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(x).batch(GLOBAL))

    def replica_step(features):
        with tf.GradientTape() as tape:
            per_example = (tf.reduce_sum(tf.square(fixed(features) - 1.0), axis=1)
                           + tf.reduce_sum(tf.square(drawn(features)), axis=1))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL)
        variables = fixed.trainable_variables + drawn.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss

    @tf.function
    def step(features):
        return strategy.reduce(SUM, strategy.run(replica_step, args=(features,)), axis=None)

    after = []
    for features in dist_dataset:
        loss = step(features)
        after.append({
            "loss": float(loss),
            "fixed": [np.asarray(v).tolist() for v in fixed.weights],
            "drawn": [np.asarray(v).tolist() for v in drawn.weights],
            "optimizer": [np.asarray(v).tolist() for v in optimizer.variables if np.asarray(v).ndim > 0],
        })
    return {"steps": after, "initial_fixed": initial_values(51, [(4, 3), (3,)]),
            "variable_types": sorted({type(v).__name__ for v in fixed.weights + drawn.weights})}


# --- 7b. variables created in scope: initial value, aggregation, synchronization -------------
AGGREGATIONS = ("SUM", "MEAN", "ONLY_FIRST_REPLICA", "NONE")


def variable_semantics(run):
    strategy = run.strategy
    w = run.worker
    with strategy.scope():
        initial = tf.Variable(10.0 * (w + 1))  # created with a different value on each worker
        mirrored = {name: tf.Variable(0.0, aggregation=getattr(tf.VariableAggregation, name))
                    for name in AGGREGATIONS}
        on_read = tf.Variable(0.0, synchronization=tf.VariableSynchronization.ON_READ,
                              aggregation=tf.VariableAggregation.SUM)
    results = {"initial": float(initial.numpy())}
    # ONLY_FIRST_REPLICA and NONE are recorded, not compared: under MWMS with one replica per
    # worker they leave each worker with its own update (1.0 and 2.0), i.e. no contract to follow.
    for name, variable in mirrored.items():
        @tf.function
        def update(variable=variable):
            strategy.run(lambda: variable.assign_add(tf.constant(w + 1.0)))

        try:
            update()
            results[f"assign_add/{name}"] = [float(v) for v in strategy.experimental_local_results(variable)]
        except Exception as e:  # noqa: BLE001 - MWMS refuses NONE in replica context
            results[f"assign_add/{name}"] = {"error": type(e).__name__}

    @tf.function
    def add_on_read():
        strategy.run(lambda: on_read.assign_add(tf.constant(w + 1.0)))

    add_on_read()
    results["on_read/read_value"] = float(on_read.read_value())  # cross-replica read: aggregated
    results["on_read/local"] = [float(v) for v in strategy.experimental_local_results(on_read)]
    return results


SCENARIOS = {
    "custom_loop": custom_loop,
    "keras_fit": keras_fit,
    "collectives": collectives,
    "input": input_pipelines,
    "evaluate_predict": evaluate_predict,
    "callbacks": callbacks_fit,
    "lazy_variables": lazy_variables,
    "variables": variable_semantics,
    **TUTORIAL_SCENARIOS,
    **XLA_SCENARIOS,
    **REFERENCE_SCENARIOS,
    **LAST_SCENARIOS,
}
SINGLE_SKIPS = ("collectives", "input", "variables", *LAST_SCENARIOS)  # one replica: nothing to compare with; MWMS is the reference
MWMS_SKIPS = tuple(XLA_SCENARIOS)  # the oracle for XLA is one process, which compiles the whole step


def main():
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # stacks on demand, for a job that hangs
    parser = worker_parser()
    parser.add_argument("--strategy", choices=("horovod", "mwms", "single"), required=True)
    parser.add_argument("--only", nargs="*", help="run only these scenarios (debugging)")
    parser.add_argument("--batch-convention", help="horovod only: HorovodStrategy(batch_convention=...), "
                        "e.g. per_rank, to check that the suite tells the conventions apart")
    args = parser.parse_args()
    options = {"batch_convention": args.batch_convention} if args.batch_convention else {}
    strategy = make_strategy(args.strategy, options)
    run = Run(args.strategy, strategy, args.out)
    dump_xla_modules(os.path.join(args.out, f"xla-{run.worker}"))
    install_write_audit(run)
    results = {
        "meta": {
            "keras": keras.__name__,
            "strategy": type(strategy).__name__,
            "worker": run.worker,
            "num_replicas_in_sync": strategy.num_replicas_in_sync,
            "pid": os.getpid(),
        },
        "seconds": {},
    }
    for name, scenario in SCENARIOS.items():
        if args.only and name not in args.only:
            continue
        if name in {"single": SINGLE_SKIPS, "mwms": MWMS_SKIPS}.get(args.strategy, ()):
            continue
        start = time.time()
        print(f"worker {run.worker}: scenario {name}", flush=True)  # a hang's job log names the scenario
        try:
            results[name] = scenario(run)
        except Exception as e:  # noqa: BLE001 - one failing scenario must not hide the others
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:500]}",
                             "traceback": traceback.format_exc()[-3000:]}
            print(f"worker {run.worker}: scenario {name} failed:\n{traceback.format_exc()}", flush=True)
        results["seconds"][name] = round(time.time() - start, 2)
    write_results(args.out, run.worker, results)


if __name__ == "__main__":
    main()
