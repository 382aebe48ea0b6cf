"""A Horovod custom training loop as a Horovod user writes it, on Keras 3 with tfdist's Horovod build.

It follows the flow of Horovod's TF2 example (examples/tensorflow2/tensorflow2_mnist.py, v0.28.1;
our own code, not a copy): a `tf.function` step with `hvd.DistributedGradientTape`, the model's
and the optimizer's variables broadcast from rank 0 after the first step, Adam at a learning rate
scaled by the rank count, steps divided by the rank count, a `tf.train.Checkpoint` saved by rank 0.
The one change Keras 3 asks of that example (docs/MIGRATING.md) is marked `Keras 3:`; the same
file runs on tf-keras (TF_USE_LEGACY_KERAS=1).

    horovodrun -np 2 --gloo python tests/multirank/hvd_mnist.py

tests/multirank/horovod_api_checks.py calls `main()` with few steps, no dropout and set weights.
"""

import os

import tensorflow as tf

import horovod.tensorflow as hvd
from hvd_keras_mnist import digits, model_for_this_rank


def main(steps=None, dropout=(0.25, 0.5), set_weights=None, folder="."):
    """Train; returns (model, the losses of every step). `set_weights(model)`: a test's starting weights."""
    hvd.init()
    model = model_for_this_rank(dropout, set_weights)
    loss_fn = tf.losses.SparseCategoricalCrossentropy()
    optimizer = tf.optimizers.Adam(0.001 * hvd.size())
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)

    @tf.function
    def step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape)  # the gradients, averaged over the ranks
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        if first_batch:  # after the optimizer made its slots, so they are broadcast too
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(optimizer.variables, root_rank=0)  # Keras 3: a list (the example calls variables())
        return loss

    losses = []
    for index, (images, labels) in enumerate(digits(hvd.rank()).batch(128).take(steps or 10000 // hvd.size())):
        losses.append(float(step(images, labels, index == 0)))
        if index % 10 == 0 and hvd.rank() == 0:
            print(f"Step #{index}\tLoss: {losses[-1]:.6f}")
    if hvd.rank() == 0:
        checkpoint.save(os.path.join(folder, "checkpoints"))
    return model, losses


if __name__ == "__main__":
    main()
