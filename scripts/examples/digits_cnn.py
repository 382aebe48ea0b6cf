"""The classic Keras MNIST CNN, trained data-parallel with tfdist on scikit-learn's 8x8 digits.

    horovodrun -np 2 --gloo python scripts/examples/digits_cnn.py        # 2 ranks
    python scripts/examples/digits_cnn.py                                # 1 process

Real data with no download (1,797 handwritten digits bundled with scikit-learn). Written as a
MirroredStrategy user writes it: every rank loads the same arrays, `fit` takes the global batch
and the strategy gives each rank its part of every batch. The test accuracy printed is global.
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import tfdist  # noqa: E402
from tfdist.keras.flavour import keras_module  # noqa: E402

keras = keras_module()


def load_digits_split():
    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]  # 8x8x1 in [0, 1]
    y = digits.target.astype("int32")
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    return (x_train, y_train), (x_test, y_test)


def mnist_cnn(num_classes=10):
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Dropout(0.25),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(num_classes, activation="softmax"),
        ]
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32, help="per replica (rank)")
    parser.add_argument("--lr", type=float, default=1e-3, help="for one rank; scaled by the rank count")
    parser.add_argument("--out", help="directory for a JSON result per rank")
    args = parser.parse_args()

    strategy = tfdist.HorovodStrategy()
    (x_train, y_train), (x_test, y_test) = load_digits_split()
    global_batch = args.batch_size * strategy.num_replicas_in_sync

    with strategy.scope():
        model = mnist_cnn()
        model.compile(
            optimizer=keras.optimizers.Adam(args.lr * strategy.num_replicas_in_sync),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
    model.fit(x_train, y_train, batch_size=global_batch, epochs=args.epochs)  # progress: from rank 0 only
    result = model.evaluate(x_test, y_test, batch_size=128, verbose=0, return_dict=True)
    if strategy.is_chief:
        print(f"test accuracy: {result['accuracy']:.4f} (loss {result['loss']:.4f}) "
              f"on {strategy.size} rank(s), global batch {global_batch}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"rank{strategy.rank}.json"), "w") as f:
            json.dump({"test": result, "train_records": int(len(x_train)), "global_batch": global_batch}, f)


if __name__ == "__main__":
    main()
