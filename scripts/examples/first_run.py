"""A first tfdist training script: a small Keras model on scikit-learn's digits, data-parallel.

    tfdist-run -np 2 python scripts/examples/first_run.py      # 2 ranks (horovodrun --gloo)
    python scripts/examples/first_run.py                       # 1 process

The README's Quick start shows this file as it is. `fit` takes the global batch (64) and the
strategy gives each rank its half of every batch; `evaluate` reports the accuracy over every
rank's examples, printed once by the chief.
"""

import tfdist  # first: sets this rank's threads before TensorFlow loads
import keras
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

strategy = tfdist.HorovodStrategy()               # one replica per process (rank)
x, y = load_digits(return_X_y=True)               # 1,797 8x8 handwritten digits, no download
x_train, x_test, y_train, y_test = train_test_split(x / 16, y, test_size=0.2, random_state=0)
with strategy.scope():                            # every rank starts from rank 0's weights
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
model.fit(x_train, y_train, batch_size=64, epochs=20, verbose=0)  # global batch, split across ranks
loss, accuracy = model.evaluate(x_test, y_test, verbose=0)        # over every rank's examples
if strategy.is_chief:
    print(f"ranks: {strategy.num_replicas_in_sync}, test accuracy: {accuracy:.3f}")
