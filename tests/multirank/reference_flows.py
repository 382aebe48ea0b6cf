"""What the reference's own tf.distribute tests do (issue 35), as conformance scenarios.

Each one is client code Keras' or TensorFlow's tests write, run under every runner of
conformance_checks.py and compared with MultiWorkerMirroredStrategy (tf-keras) or one process:

- `iterator_in_function`: a custom step that makes its iterator inside the `tf.function`
  (`next(iter(dist_dataset))`, tf-keras' optimizer and custom-loop tests). It deadlocked on a
  rank pinned to one core, where TensorFlow's inter-op pool had one thread;
- `unknown_shape_predict`: `predict` on TFRecords decoded by `tf.io.parse_tensor` (element shape
  of unknown rank, tf-keras' distribute_strategy_test);
- `dataset_fn_fit`: `fit` on a `distribute_datasets_from_function` dataset (Keras 3's
  tf_dataset_adapter_test), each rank feeding its own part;
- `outside_scope_fit` (Keras 3): the same fit with the model built and compiled outside
  `strategy.scope()`, each rank from its own initial weights, then `evaluate`; and a second such
  model fitted inside the scope on a plain dataset. MirroredStrategy in one process takes both;
  the model adopts the strategy (`tfdist.keras.adopted_strategy`) and trains from rank 0's weights;
- `step_logs`: the values a custom `train_step` / `test_step` returns, reduced across replicas as
  Keras does it (Keras 3: the mean, as MirroredStrategy; tf-keras: the sum, as MWMS);
- `gather_errors` (last: a failed collective may end MWMS's collectives): gathering values whose
  rank differs across replicas raises InvalidArgumentError, as MWMS's does.
"""

import os

import numpy as np
import tensorflow as tf

from client_code import dense, keras, seed_for

SUM = tf.distribute.ReduceOp.SUM


def iterator_in_function(run):
    strategy = run.strategy
    x = np.arange(12, dtype="float32") / 12
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), dense(1, seed_for(run, 61), 1)])
        optimizer = keras.optimizers.SGD(0.5)

    def dataset_fn(context):
        ds = tf.data.Dataset.from_tensor_slices((x, 2 * x))
        ds = ds.shard(context.num_input_pipelines, context.input_pipeline_id)
        return ds.repeat().batch(context.get_per_replica_batch_size(4))  # global batch: x[0:4]

    dataset = strategy.distribute_datasets_from_function(dataset_fn)

    @tf.function
    def train_step(dataset):
        def replica_step(data):
            features, labels = data
            with tf.GradientTape() as tape:
                error = model(features[:, None])[:, 0] - labels
                loss = tf.nn.compute_average_loss(error ** 2, global_batch_size=4)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        strategy.run(replica_step, args=(next(iter(dataset)),))

    for _ in range(3):
        train_step(dataset)
    return {"iterations": int(optimizer.iterations.numpy()), "weights": [w.tolist() for w in model.get_weights()]}


def write_tensor_records(path, rows):
    with tf.io.TFRecordWriter(path) as writer:
        for row in rows:
            writer.write(tf.io.serialize_tensor(tf.constant(row)).numpy())


def unknown_shape_predict(run):
    strategy = run.strategy
    rows = (np.arange(16 * 3, dtype="float32").reshape(16, 3) / 48).tolist()
    os.makedirs(run.out, exist_ok=True)
    path = os.path.join(run.out, f"tensors-{run.worker}.tfrecord")  # every worker writes the same records
    write_tensor_records(path, rows)
    dataset = tf.data.TFRecordDataset(path).map(lambda record: tf.io.parse_tensor(record, tf.float32)).batch(8)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA  # one file
    dataset = dataset.with_options(options)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), dense(2, seed_for(run, 71), 3)])
    shapes = str(dataset.element_spec.shape)
    predictions = model.predict(dataset, verbose=0)
    return {"element_shape": shapes, "predictions": np.asarray(predictions).tolist()}


def dataset_fn_fit(run):
    strategy = run.strategy
    x = (np.arange(32, dtype="float32") / 32)[:, None]
    y = np.concatenate([x, 1 - x], axis=1)

    def dataset_fn(context):
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shard(context.num_input_pipelines, context.input_pipeline_id)
        return ds.batch(context.get_per_replica_batch_size(8)).repeat()

    with strategy.scope():
        # Not built before fit (no Input), as Keras' tf_dataset_adapter_test writes it: Keras 3 then
        # builds the model from a first batch, which is per-replica here.
        model = keras.Sequential([dense(2, seed_for(run, 81), 1)])
        model.compile(optimizer=keras.optimizers.SGD(0.2), loss="mse")
    # 32 rows at a global batch of 8 (tf-keras wants the steps of a distributed dataset)
    history = model.fit(strategy.distribute_datasets_from_function(dataset_fn), epochs=2, steps_per_epoch=4,
                        verbose=0)
    return {"loss": history.history["loss"], "weights": [w.tolist() for w in model.get_weights()]}


def outside_scope_fit(run):
    if keras.__name__ != "keras":
        return {"flavour": keras.__name__}  # tf-keras' fit stops with its own error, as under MWMS
    strategy = run.strategy
    x = (np.arange(32, dtype="float32") / 32)[:, None]
    y = np.concatenate([x, 1 - x], axis=1)

    def dataset_fn(context):
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shard(context.num_input_pipelines, context.input_pipeline_id)
        return ds.batch(context.get_per_replica_batch_size(8))

    # As tf_dataset_adapter_test writes it: no scope at all. The seed differs by rank; the chief's is
    # one process's.
    model = keras.Sequential([keras.Input((1,)), dense(2, seed_for(run, 85), 1)])
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    dataset = strategy.distribute_datasets_from_function(dataset_fn)
    history = model.fit(dataset, epochs=2, verbose=0)
    evaluated = model.evaluate(dataset, verbose=0)
    # Built outside, fitted inside the scope on a dataset batched by the global batch.
    other = keras.Sequential([keras.Input((1,)), dense(2, seed_for(run, 87), 1)])
    other.compile(optimizer=keras.optimizers.SGD(0.2), loss="mse")
    with strategy.scope():
        other_history = other.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), epochs=2, verbose=0)
    return {"loss": history.history["loss"], "weights": [w.tolist() for w in model.get_weights()],
            "evaluate": float(evaluated), "other_loss": other_history.history["loss"],
            "other_weights": [w.tolist() for w in other.get_weights()]}


def _replica_id():
    context = tf.distribute.get_replica_context()
    return tf.cast(context.replica_id_in_sync_group if context is not None else 0, tf.float32)


class StepLogsModel(keras.Model):
    """A model whose steps return their own values (not the metrics'), as multi_worker_test's."""

    def train_step(self, data):
        _, y = data
        share = tf.nn.compute_average_loss(tf.cast(y, tf.float32), global_batch_size=8)
        return {"loss": share, "replica": _replica_id() + 0.75}

    def test_step(self, data):
        _, y = data
        return {"loss": tf.nn.compute_average_loss(tf.cast(y, tf.float32), global_batch_size=8)}


def step_logs(run):
    strategy = run.strategy
    x = np.zeros((16, 1), "float32")
    y = np.arange(16, dtype="float32")  # global batches of 8 with increasing targets
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    with strategy.scope():
        inputs = keras.Input((1,))
        model = StepLogsModel(inputs, dense(1, seed_for(run, 91), 1)(inputs))
        model.compile(optimizer=keras.optimizers.SGD(0.1))
    batches = []
    recorder = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: batches.append({k: float(v) for k, v in logs.items()}))
    history = model.fit(dataset, epochs=1, verbose=0, callbacks=[recorder])
    evaluated = model.evaluate(dataset, verbose=0, return_dict=True)
    return {"batches": batches, "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
            "evaluate": {k: float(v) for k, v in evaluated.items()}}


def gather_errors(run):
    strategy = run.strategy
    results = {}
    cases = {
        "gather_rank": (lambda ctx: tf.ones(list(range(1, ctx.replica_id_in_sync_group + 2))), "gather"),
        "all_gather_rank": (lambda ctx: tf.ones(list(range(1, ctx.replica_id_in_sync_group + 2))), "all_gather"),
    }
    for name, (value_fn, how) in cases.items():
        values = strategy.experimental_distribute_values_from_function(value_fn)
        try:
            if how == "gather":
                strategy.gather(values, axis=0)
            else:
                strategy.run(lambda v: tf.distribute.get_replica_context().all_gather(tf.identity(v), axis=0),
                             args=(values,))
            results[name] = "no error"
        except Exception as e:  # noqa: BLE001 - the error's type is the result
            results[name] = type(e).__name__
            results[f"{name} says 'Shape mismatch'"] = "Shape mismatch" in str(e)  # strategy_gather_test's regex
    return results


REFERENCE_SCENARIOS = {
    "iterator_in_function": iterator_in_function,
    "unknown_shape_predict": unknown_shape_predict,
    "dataset_fn_fit": dataset_fn_fit,
    "outside_scope_fit": outside_scope_fit,
    "step_logs": step_logs,
}
LAST_SCENARIOS = {"gather_errors": gather_errors}  # after every other scenario (see module)
