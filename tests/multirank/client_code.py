"""Client-code helpers shared by the conformance scenarios: data, models and reads written once,
so that every runner (HorovodStrategy, MWMS, one process) runs the same code."""

import numpy as np

from common import keras_module

keras = keras_module()

GLOBAL = 16  # the global batch every scenario uses


def make_data(n, seed=7, features=4, classes=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = rng.integers(0, classes, size=n).astype("int32")
    return x, y


def initial_values(seed, shapes):
    """Starting weights from numpy, so they do not depend on the Keras flavour's random streams."""
    rng = np.random.default_rng(seed)
    return [rng.uniform(-0.6, 0.6, size=shape).astype("float32").tolist() for shape in shapes]


def dense(units, seed, inputs, **kwargs):
    kernel, bias = initial_values(seed, [(inputs, units), (units,)])
    return keras.layers.Dense(units, kernel_initializer=keras.initializers.Constant(kernel),
                              bias_initializer=keras.initializers.Constant(bias), **kwargs)


def build_model(seed, model_class=None):
    return (model_class or keras.Sequential)(
        [keras.Input((4,)), dense(8, seed, 4, activation="tanh"), dense(3, seed + 1, 8)])


def weights_of(model):
    return [w.tolist() for w in model.get_weights()]


def local(strategy, value):
    """This worker's part of a distributed value (its local replica), as numpy."""
    return [np.asarray(v).tolist() for v in strategy.experimental_local_results(value)]


def seed_for(run, base):
    # Every worker creates its variables with different initial values; the strategy must make
    # them start from the chief's (worker 0's), which are the single process's.
    return base + 1000 * run.worker
