"""A Horovod Keras training script as a Horovod user writes it, on Keras 3 with tfdist's Horovod build.

It follows the flow of Horovod's TF2 Keras example (examples/tensorflow2/tensorflow2_keras_mnist.py,
v0.28.1; this is our own code, not a copy): `hvd.DistributedOptimizer` around Adam at a learning
rate scaled by the rank count, Horovod's broadcast, metric-average and warm-up callbacks, a
checkpoint written by rank 0, and fit's progress on rank 0. scikit-learn's 8x8 digits stand in for
the MNIST download. The one change Keras 3 asks of that example (docs/MIGRATING.md) is marked
`Keras 3:`; the same file runs on tf-keras (TF_USE_LEGACY_KERAS=1).

    horovodrun -np 2 --gloo python tests/multirank/hvd_keras_mnist.py

tests/multirank/horovod_api_checks.py calls `main()` with few steps, no dropout and set weights.
"""

import os

import tensorflow as tf
from sklearn.datasets import load_digits

import horovod.tensorflow.keras as hvd


def digits(rank):
    """The digits as MNIST-like float images in [0, 1] and int64 labels, shuffled per rank, repeated."""
    images, labels = load_digits(return_X_y=True)
    images = tf.cast(images.reshape(-1, 8, 8, 1) * 16 / 255.0, tf.float32)
    return tf.data.Dataset.from_tensor_slices((images, tf.cast(labels, tf.int64))).repeat().shuffle(10000, seed=rank)


def convnet(dropout=(0.25, 0.5)):
    """The example's network: two convolutions, pooling, a dense layer, dropout, softmax."""
    layers = tf.keras.layers
    return tf.keras.Sequential([
        layers.Conv2D(32, (3, 3), activation="relu"), layers.Conv2D(64, (3, 3), activation="relu"),
        layers.MaxPooling2D((2, 2)), layers.Dropout(dropout[0]), layers.Flatten(),
        layers.Dense(128, activation="relu"), layers.Dropout(dropout[1]), layers.Dense(10, activation="softmax"),
    ])


def pin_gpu():
    """One GPU per local rank, with memory growth (the example's GPU lines; nothing on a CPU)."""
    gpus = tf.config.experimental.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")


def model_for_this_rank(dropout, set_weights):
    """After hvd.init(): this rank's GPU, then the network (with a test's starting weights, if given)."""
    pin_gpu()
    model = convnet(dropout)
    if set_weights is not None:
        model.build((None, 8, 8, 1))
        set_weights(model)
    return model


def main(steps_per_epoch=None, epochs=24, dropout=(0.25, 0.5), set_weights=None, folder="."):
    """Train; returns (model, History). `set_weights(model)`: a test's starting weights per rank."""
    hvd.init()
    model = model_for_this_rank(dropout, set_weights)
    learning_rate = 0.001 * hvd.size()  # the effective batch grows with the ranks
    optimizer = hvd.DistributedOptimizer(tf.optimizers.Adam(learning_rate), backward_passes_per_step=1,
                                         average_aggregated_gradients=True)
    # Keras 3: compile has no `experimental_run_tf_function` (the example passes False); fit calls the
    # DistributedOptimizer as it is.
    model.compile(loss=tf.losses.SparseCategoricalCrossentropy(), optimizer=optimizer, metrics=["accuracy"])
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),  # everyone starts from rank 0's weights
                 hvd.callbacks.MetricAverageCallback(),  # before any callback that reads metrics
                 hvd.callbacks.LearningRateWarmupCallback(initial_lr=learning_rate, warmup_epochs=3, verbose=1)]
    if hvd.rank() == 0:  # one writer
        callbacks.append(tf.keras.callbacks.ModelCheckpoint(os.path.join(folder, "checkpoint-{epoch}.h5")))
    history = model.fit(digits(hvd.rank()).batch(128), steps_per_epoch=steps_per_epoch or 500 // hvd.size(),
                        epochs=epochs, callbacks=callbacks, verbose=1 if hvd.rank() == 0 else 0)
    return model, history


if __name__ == "__main__":
    main()
