"""The code paths of TensorFlow's and Keras' own distributed-training tutorials, as conformance scenarios.

Written after (not copied from) tensorflow/docs `site/en/tutorials/distribute/` (`custom_training`,
`multi_worker_with_ctl`, `multi_worker_with_keras`) and keras-io's "Multi-GPU distributed training
with TensorFlow" guide: chief selection through `strategy.cluster_resolver`, per-worker save paths
(`write_filepath`), `model.save` + `load_model` on every worker, `CheckpointManager` with
per-worker directories, `BackupAndRestore`, `distribute_values_from_function`, a custom Keras
metric whose `result()` returns its variable, and metrics read in a custom loop. The client code
uses only public TensorFlow/Keras APIs; tests/test_conformance.py compares the runners.
"""

import os

import numpy as np
import tensorflow as tf

from client_code import GLOBAL, build_model, initial_values, keras, make_data, seed_for, weights_of

SUM = tf.distribute.ReduceOp.SUM


# --- the tutorials' helpers, as their readers write them ------------------------------------
def task_of(strategy):
    """(task_type, task_id) from the strategy's cluster resolver; (None, None) without one."""
    resolver = strategy.cluster_resolver
    return (resolver.task_type, resolver.task_id) if resolver is not None else (None, None)


def is_chief(task_type, task_id):
    return task_type is None or task_type == "chief" or (task_type == "worker" and task_id == 0)


def write_filepath(filepath, task_type, task_id):
    """Where this worker writes `filepath`: itself on the chief, a worker temp dir beside it elsewhere."""
    dirpath, base = os.path.dirname(filepath), os.path.basename(filepath)
    if not is_chief(task_type, task_id):
        dirpath = os.path.join(dirpath, f"workertemp_{task_id}")
        tf.io.gfile.makedirs(dirpath)
    return os.path.join(dirpath, base)


class ExampleCount(keras.metrics.Metric):
    """A custom metric in the style of Keras' guide: `result()` returns the state variable itself."""

    def __init__(self, name="examples", **kwargs):
        super().__init__(name=name, **kwargs)
        self.count = self.add_weight(name="count", initializer="zeros")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.count.assign_add(tf.cast(tf.shape(y_true)[0], self.dtype))

    def result(self):
        return self.count

    def reset_state(self):
        self.count.assign(0.0)


def saved_version(model, base, step):
    """Which version `base + step * i` the weights of `model` are (None: none of them, e.g. torn)."""
    offsets = [np.asarray(w) - np.asarray(b) for w, b in zip(model.get_weights(), base)]
    i = int(round(float(offsets[0].flat[0]) / step))
    return i if all(np.allclose(o, step * i, atol=1e-6) for o in offsets) else None


def compiled(run, seed):
    with run.strategy.scope():
        model = build_model(seed_for(run, seed))
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy", ExampleCount()])
    return model


# --- multi_worker_with_keras + keras-io guide ---------------------------------------------------
def tutorial_keras(run):
    strategy = run.strategy
    task_type, task_id = task_of(strategy)
    root = os.path.join(run.files, "tutorial_keras")
    x, y = make_data(96, seed=13)
    model = compiled(run, 61)
    history = model.fit(x, y, batch_size=GLOBAL, epochs=2, verbose=0, shuffle=False,
                        callbacks=[keras.callbacks.BackupAndRestore(os.path.join(root, "backup"))])
    # Save: the chief to the model path, the others to a worker temp dir they remove; then every
    # worker loads what the chief saved.
    trained = weights_of(model)
    model_path = os.path.join(root, "model.keras")
    write_model_path = write_filepath(model_path, task_type, task_id)
    model.save(write_model_path)
    if not is_chief(task_type, task_id):
        tf.io.gfile.rmtree(os.path.dirname(write_model_path))
    if run.kind == "mwms":
        # MWMS's save has no barrier, so the tutorial's load races the chief's write: a loaded CI
        # machine saw worker 1 read a half-written model.keras ("file signature not found"), after
        # which the workers' collectives diverged. tfdist's save ends with one; MWMS gets it here.
        strategy.reduce(SUM, strategy.run(lambda: tf.constant(1.0)), axis=None)
    loaded = keras.models.load_model(model_path, custom_objects={"ExampleCount": ExampleCount})
    # Code written for one process saves from every worker, to one path, again and again. (MWMS
    # corrupts that file: its workers all write it, so the MWMS runner skips this part.)
    versions = []
    if run.kind != "mwms":
        shared_path = os.path.join(root, "every_worker.keras")
        for i in range(5):
            model.set_weights([np.asarray(w) + 0.01 * i for w in trained])
            model.save(shared_path)
            again = keras.models.load_model(shared_path, custom_objects={"ExampleCount": ExampleCount})
            versions.append(saved_version(again, trained, 0.01))
    values = strategy.experimental_distribute_values_from_function(
        lambda context: tf.constant([context.replica_id_in_sync_group, context.num_replicas_in_sync]))
    resolver = strategy.cluster_resolver
    return {
        "task": [task_type, task_id],
        "is_chief": is_chief(task_type, task_id),
        "workers_in_cluster_spec": resolver.cluster_spec().num_tasks("worker") if resolver else None,
        "in_multi_worker_mode": bool(strategy.extended._in_multi_worker_mode()),
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
        "trained": trained,
        "loaded": weights_of(loaded),
        "versions_loaded": versions,
        "value_contexts": strategy.gather(values, axis=0).numpy().tolist(),
    }


# --- custom_training + multi_worker_with_ctl -----------------------------------------------------
def tutorial_custom_loop(run):
    strategy = run.strategy
    task_type, task_id = task_of(strategy)
    checkpoint_dir = os.path.join(run.files, "tutorial_ctl", "ckpt")
    x, y = make_data(96, seed=14)
    with strategy.scope():
        model = build_model(seed_for(run, 71))
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        train_accuracy = keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        test_loss = keras.metrics.Mean(name="test_loss")
        epoch = tf.Variable(initial_value=tf.constant(0, dtype=tf.int64), name="epoch")
    checkpoint = tf.train.Checkpoint(model=model, epoch=epoch)
    write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id)
    manager = tf.train.CheckpointManager(checkpoint, directory=write_checkpoint_dir, max_to_keep=1)
    dist_dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL))

    def train_step(inputs):
        features, labels = inputs
        with tf.GradientTape() as tape:
            logits = model(features, training=True)
            loss = tf.nn.compute_average_loss(loss_object(labels, logits), global_batch_size=GLOBAL)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        train_accuracy.update_state(labels, logits)
        return loss

    def test_step(inputs):
        features, labels = inputs
        test_loss.update_state(loss_object(labels, model(features, training=False)))

    @tf.function
    def distributed_train_step(inputs):
        return strategy.reduce(SUM, strategy.run(train_step, args=(inputs,)), axis=None)

    @tf.function
    def distributed_test_step(inputs):
        strategy.run(test_step, args=(inputs,))

    per_epoch = []
    while epoch.numpy() < 2:
        total, batches = 0.0, 0
        for inputs in dist_dataset:
            total += float(distributed_train_step(inputs))
            batches += 1
        for inputs in dist_dataset:
            distributed_test_step(inputs)
        # read outside strategy.run (cross-replica context): the aggregate over every worker
        per_epoch.append({"loss": total / batches, "train_accuracy": float(train_accuracy.result()),
                          "test_loss": float(test_loss.result())})
        train_accuracy.reset_state()
        test_loss.reset_state()
        epoch.assign_add(1)
        manager.save()
        if not is_chief(task_type, task_id):
            tf.io.gfile.rmtree(write_checkpoint_dir)
    # A restarted worker restores the chief's checkpoint.
    with strategy.scope():
        restored_model = build_model(seed_for(run, 81))
        restored_epoch = tf.Variable(initial_value=tf.constant(0, dtype=tf.int64), name="epoch")
    latest = tf.train.latest_checkpoint(checkpoint_dir)
    tf.train.Checkpoint(model=restored_model, epoch=restored_epoch).restore(latest).expect_partial()
    return {
        "per_epoch": per_epoch,
        "final": weights_of(model),
        "restored": weights_of(restored_model),
        "restored_epoch": int(restored_epoch.numpy()),
        "latest_checkpoint": os.path.basename(latest) if latest else None,
    }


# --- multi_worker_with_keras: one shuffled, repeated dataset across several fits ------------------
def mnist_shaped(seed, rows=256):
    """Synthetic MNIST-shaped data (28x28 floats in [0, 1), 10 classes), as the tutorial's dataset."""
    rng = np.random.default_rng(seed)
    return rng.random((rows, 28, 28), dtype=np.float32), rng.integers(0, 10, size=rows).astype("int64")


def tutorial_cnn(run, seed):
    """The tutorial's CNN, smaller (4 filters, stride 2), starting from numpy weights."""
    kernel, bias, dense_kernel, dense_bias = initial_values(seed_for(run, seed), [(3, 3, 1, 4), (4,), (676, 10), (10,)])
    constant = keras.initializers.Constant
    with run.strategy.scope():
        model = keras.Sequential([
            keras.Input((28, 28)), keras.layers.Reshape((28, 28, 1)),
            keras.layers.Conv2D(4, 3, strides=2, activation="relu", kernel_initializer=constant(kernel),
                                bias_initializer=constant(bias)),
            keras.layers.Flatten(),
            keras.layers.Dense(10, kernel_initializer=constant(dense_kernel), bias_initializer=constant(dense_bias))])
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer=keras.optimizers.SGD(0.05), metrics=["accuracy"])
    return model


def tutorial_data_order(run):
    """The tutorial re-uses one `.shuffle(60000).repeat()` dataset in every fit (plain, with
    ModelCheckpoint, with BackupAndRestore): each fit draws the next shuffle order, and every
    runner must draw the orders one process draws (seeded alike, as MWMS asks of its workers)."""
    task_type, task_id = task_of(run.strategy)
    root = os.path.join(run.files, "tutorial_data_order")
    tf.random.set_seed(2024)
    x, y = mnist_shaped(15)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(60000).repeat().batch(GLOBAL)
    model = tutorial_cnn(run, 91)
    fits = {"plain": model.fit(dataset, epochs=2, steps_per_epoch=5, verbose=0).history["loss"]}
    checkpoint = keras.callbacks.ModelCheckpoint(write_filepath(os.path.join(root, "ckpt.weights.h5"), task_type, task_id),
                                                 save_weights_only=True)
    fits["checkpoint"] = model.fit(dataset, epochs=2, steps_per_epoch=5, verbose=0, callbacks=[checkpoint]).history["loss"]
    with run.strategy.scope():
        restarted = tutorial_cnn(run, 91)
    backup = keras.callbacks.BackupAndRestore(os.path.join(root, "backup"))
    fits["backup"] = restarted.fit(dataset, epochs=2, steps_per_epoch=5, verbose=0, callbacks=[backup]).history["loss"]
    fits["evaluate"] = [float(model.evaluate(dataset, steps=3, verbose=0)[0])]
    fits["again"] = model.fit(dataset, epochs=1, steps_per_epoch=5, verbose=0).history["loss"]
    return {"losses": {k: [float(v) for v in vs] for k, vs in fits.items()}, "trained": weights_of(model)}


TUTORIAL_SCENARIOS = {"tutorial_keras": tutorial_keras, "tutorial_custom_loop": tutorial_custom_loop,
                      "tutorial_data_order": tutorial_data_order}
