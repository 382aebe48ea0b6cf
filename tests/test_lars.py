"""LARS against a plain numpy reference of its formulas; compile, fit, save and load with Keras."""

import numpy as np
import pytest
import tensorflow as tf

from tfdist.optimizers import LARS
from tfdist.callbacks._keras import keras_module

keras = keras_module()
LR, MOMENTUM, WD, ETA, EPS = 0.5, 0.9, 0.01, 0.02, 1e-9


def reference(w, grads, adapt):
    """Plain numpy LARS: trust ratio, momentum, weight decay (none for excluded variables)."""
    w, v = w.astype(np.float64), np.zeros_like(w, dtype=np.float64)
    for g in grads:
        if adapt:
            wn, gn = np.linalg.norm(w), np.linalg.norm(g)
            trust = ETA * wn / (gn + WD * wn + EPS) if wn > 0 and gn > 0 else 1.0
            direction = trust * (g + WD * w)
        else:
            direction = g
        v = MOMENTUM * v + LR * direction
        w = w - v
    return w


def make_variable(value, path):
    scope, name = path.split("/")
    if hasattr(keras, "Variable"):  # Keras 3: path = name scope / name
        with keras.name_scope(scope):
            return keras.Variable(value, name=name)
    return tf.Variable(value, name=path)


def test_steps_match_reference_with_excluded_and_zero_norm_variables():
    rng = np.random.default_rng(0)
    values = {
        "dense/kernel": rng.normal(size=(3, 4)).astype(np.float32),
        "dense/bias": rng.normal(size=(4,)).astype(np.float32),  # excluded: plain momentum
        "zero/kernel": np.zeros((4, 2), np.float32),  # ||w|| = 0: trust 1
    }
    variables = [make_variable(v, path) for path, v in values.items()]
    optimizer = LARS(LR, momentum=MOMENTUM, weight_decay=WD, eta=ETA, epsilon=EPS)
    grads = {path: [rng.normal(size=v.shape).astype(np.float32) for _ in range(4)] for path, v in values.items()}
    grads["dense/kernel"][2] *= 0  # a zero gradient: trust 1, only weight decay moves w
    for step in range(4):
        optimizer.apply_gradients([(tf.constant(grads[p][step]), v) for p, v in zip(values, variables)])
    assert [optimizer.adapts(v) for v in variables] == [True, False, True]
    for (path, initial), variable in zip(values.items(), variables):
        expected = reference(initial, grads[path], adapt=path != "dense/bias")
        np.testing.assert_allclose(np.asarray(variable), expected, rtol=1e-5, atol=1e-6, err_msg=path)


def test_compile_fit_save_and_load(tmp_path):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.BatchNormalization(),
                              keras.layers.Dense(1)])
    model.compile(optimizer=LARS(0.1, weight_decay=1e-3, eta=0.01), loss="mse")
    x, y = np.random.default_rng(2).normal(size=(16, 3)), np.ones((16, 1))
    history = model.fit(x, y, batch_size=8, epochs=3, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    path = str(tmp_path / "model.keras")
    model.save(path)
    restored = keras.models.load_model(path)
    assert isinstance(restored.optimizer, LARS)
    config = restored.optimizer.get_config()
    assert (config["weight_decay"], config["eta"], config["momentum"]) == (1e-3, 0.01, 0.9)
    for a, b in zip(model.optimizer.velocities, restored.optimizer.velocities):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(model.predict(x, verbose=0), restored.predict(x, verbose=0), rtol=1e-6)


def test_config_round_trip():
    optimizer = LARS(0.3, momentum=0.8, weight_decay=5e-4, eta=0.002, exclude_from_adaptation=["bias"])
    again = LARS.from_config(optimizer.get_config())
    assert again.get_config() == optimizer.get_config()
    assert again.exclude_from_adaptation == ("bias",)


def larc_reference(w, grads, lr, mode, tc=0.02, wd=0.01, eps=1e-8, adapt=True):
    """Plain numpy LARC around plain SGD (no momentum)."""
    w = w.astype(np.float64)
    for g in grads:
        if adapt:
            wn, gn = np.linalg.norm(w), np.linalg.norm(g)
            rate = tc * wn / (gn + wd * wn + eps) if wn > 0 and gn > 0 else 1.0
            if mode == "clip":
                rate = min(rate / lr, 1.0)
            g = (g + wd * w) * rate
        w = w - lr * g
    return w


@pytest.mark.parametrize("mode", ["clip", "scale"])
def test_larc_wraps_sgd_and_matches_reference(mode):
    from tfdist.optimizers import LARC

    rng = np.random.default_rng(4)
    values = {
        "dense/kernel": rng.normal(size=(3, 4)).astype(np.float32) * 0.01,  # small: clip engages
        "wide/kernel": rng.normal(size=(4, 4)).astype(np.float32) * 10,  # large: rate capped at 1
        "dense/bias": rng.normal(size=(4,)).astype(np.float32),
        "zero/kernel": np.zeros((4, 2), np.float32),
    }
    variables = [make_variable(v, path) for path, v in values.items()]
    optimizer = LARC(keras.optimizers.SGD(0.1), mode=mode, weight_decay=0.01)
    assert isinstance(optimizer, keras.optimizers.SGD)
    grads = {path: [rng.normal(size=v.shape).astype(np.float32) for _ in range(3)] for path, v in values.items()}
    for step in range(3):
        optimizer.apply_gradients([(tf.constant(grads[p][step]), v) for p, v in zip(values, variables)])
    for (path, initial), variable in zip(values.items(), variables):
        expected = larc_reference(initial, grads[path], 0.1, mode, adapt=path != "dense/bias")
        np.testing.assert_allclose(np.asarray(variable), expected, rtol=1e-5, atol=1e-6, err_msg=path)
    with pytest.raises(ValueError, match="LARC mode='both'"):
        LARC(keras.optimizers.SGD(0.1), mode="both")
