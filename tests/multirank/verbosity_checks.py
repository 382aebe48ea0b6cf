"""fit / evaluate / predict at Keras' default verbosity (or `--verbose N` on every rank), then fit
at verbose=2 (3 epochs) and verbose=1 (4 epochs), printing nothing of its own to stdout: what the
job prints is Keras', TensorFlow's and tfdist's.

    tfdist-run -np 2 python tests/multirank/verbosity_checks.py --out DIR [--verbose 1]

Leaves TF_CPP_MIN_LOG_LEVEL as the job sets it (no `quiet_tensorflow()`), and fits a tf.data
dataset with shuffle=True, which makes Keras 3 warn that the argument is ignored. Each rank writes
DIR/rank<R>.json with its TF_CPP_MIN_LOG_LEVEL and the startup record.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import keras_module, worker_parser, write_results  # noqa: E402

import numpy as np  # noqa: E402

import tfdist  # noqa: E402

keras = keras_module()


def main():
    parser = worker_parser()
    parser.add_argument("--verbose", type=int, help="passed to fit/evaluate/predict (default: not passed)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import tensorflow as tf

    strategy = tfdist.HorovodStrategy()
    verbose = {} if args.verbose is None else {"verbose": args.verbose}
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    model.fit(dataset, epochs=2, shuffle=True, **verbose)
    model.evaluate(x, y, batch_size=16, **verbose)
    model.predict(x, batch_size=16, **verbose)
    model.fit(dataset, epochs=3, verbose=2)  # one line an epoch: "Epoch 1/3", "4/4 - ..."
    model.fit(dataset, epochs=4, verbose=1)
    write_results(args.out, strategy.rank, {"tf_cpp_min_log_level": os.environ.get("TF_CPP_MIN_LOG_LEVEL"),
                                            "startup": tfdist.tuning.startup.state()})


if __name__ == "__main__":
    main()
