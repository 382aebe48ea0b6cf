"""tfdist.keras.fused_batchnorm: Keras 3 BatchNormalization on the fused FusedBatchNormV3 kernel
computes what Keras' own call computes (outputs, gradients, moving statistics, under `fit` and
mixed precision), takes Keras' own path everywhere else, and refuses to install on a moved Keras.

Single process, tiny tensors; each test restores Keras' own call.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist.keras import fused_batchnorm as kfb
from tfdist.errors import KerasHookError

FUSED, FUSED_GRAD = "FusedBatchNormV3", "FusedBatchNormGradV3"
BN = keras.layers.BatchNormalization


@pytest.fixture(autouse=True)
def _keras_own_call():
    kfb.uninstall()
    yield
    kfb.uninstall()
    keras.config.set_dtype_policy("float32")


def _set(installed):
    (kfb.install if installed else kfb.uninstall)()
    assert kfb.is_installed() == installed


def _layer(shape, **kwargs):
    layer = BN(momentum=0.9, **kwargs)
    layer.build(shape)
    rng = np.random.default_rng(1)
    for w in layer.weights:  # gamma, beta, moving statistics all away from their initial values
        w.assign(rng.uniform(0.5, 1.5, w.shape).astype(w.dtype))
    return layer


def _run(installed, x, training, mask=None, steps=3, **kwargs):
    """Outputs, gradients (input, gamma, beta) of the last of `steps` calls, and moving statistics."""
    _set(installed)
    layer = _layer(x.shape, **kwargs)
    x = tf.constant(x)
    weights = tf.constant(np.random.default_rng(2).normal(size=x.shape), tf.float32)
    for _ in range(steps):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=training, mask=mask)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * weights)
        grads = tape.gradient(loss, [x] + layer.trainable_weights)
    result = {"y": y, "dx": grads[0], "mean": layer.moving_mean, "var": layer.moving_variance}
    result.update({f"d{w.name}": g for w, g in zip(layer.trainable_weights, grads[1:])})
    return {k: np.asarray(v.numpy(), np.float32) for k, v in result.items()}


def _op_types(installed, shape, training, mask=None, **kwargs):
    """Op types of a traced training step (forward and gradient) of a BatchNormalization layer."""
    layer = _layer(shape, **kwargs)  # built before install: the patch is on the class
    _set(installed)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=training, mask=mask)
        return tape.gradient(tf.reduce_sum(tf.cast(y, tf.float32)), [x] + layer.trainable_weights)

    graph = step.get_concrete_function(tf.TensorSpec(shape, layer.compute_dtype)).graph
    return {op.type for op in graph.get_operations()}


def _assert_close(keras_own, fused, rtol):
    assert keras_own.keys() == fused.keys()
    for key in keras_own:
        scale = np.max(np.abs(keras_own[key])) or 1.0
        np.testing.assert_allclose(fused[key], keras_own[key], rtol=rtol, atol=rtol * scale, err_msg=key)


def _input(shape, dtype="float32"):
    return np.random.default_rng(0).normal(2.0, 3.0, shape).astype(dtype)


# (id, layer kwargs, input shape, input dtype, tolerance)
EQUIVALENT = [
    ("nhwc", {}, (4, 5, 5, 6), "float32", 1e-5),
    ("nhwc axis=3", {"axis": 3}, (4, 5, 5, 6), "float32", 1e-5),
    ("nchw", {"axis": 1}, (4, 6, 5, 5), "float32", 1e-5),
    ("no center", {"center": False}, (4, 5, 5, 6), "float32", 1e-5),
    ("no scale", {"scale": False}, (4, 5, 5, 6), "float32", 1e-5),
    ("neither", {"axis": 1, "center": False, "scale": False}, (4, 6, 5, 5), "float32", 1e-5),
    ("one value per channel", {}, (1, 1, 1, 6), "float32", 1e-5),  # biased variance 0, not NaN
    ("mixed_float16", {"dtype": "mixed_float16"}, (4, 5, 5, 6), "float16", 2e-3),
    ("mixed_bfloat16", {"dtype": "mixed_bfloat16"}, (4, 5, 5, 6), "bfloat16", 2e-2),
    ("float16 variables", {"dtype": "float16"}, (4, 5, 5, 6), "float16", 2e-3),
]


@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("kwargs,shape,dtype,rtol", [c[1:] for c in EQUIVALENT], ids=[c[0] for c in EQUIVALENT])
def test_fused_matches_keras(kwargs, shape, dtype, rtol, training):
    x = _input(shape, dtype)
    keras_own, fused = _run(False, x, training, **kwargs), _run(True, x, training, **kwargs)
    _assert_close(keras_own, fused, rtol)
    # Moving statistics: computed in float32 from the same inputs, whatever the compute dtype.
    _assert_close({k: keras_own[k] for k in ("mean", "var")}, {k: fused[k] for k in ("mean", "var")},
                  1e-5 if kwargs.get("dtype") != "float16" else 1e-3)
    assert FUSED in _op_types(True, shape, training, **kwargs)


def test_frozen_layer_runs_inference():
    x = _input((4, 5, 5, 6))
    _set(True)
    layer = _layer(x.shape)
    layer.trainable = False
    before = layer.moving_mean.numpy()
    y = layer(x, training=True)
    np.testing.assert_array_equal(layer.moving_mean.numpy(), before)
    np.testing.assert_allclose(y, _layer(x.shape)(x, training=False), rtol=1e-5, atol=1e-5)


# (id, layer kwargs, input shape, input dtype, mask shape): each takes Keras' own call.
FALLBACK = [
    ("axis=1 on a 2-D input", {"axis": 1}, (8, 5), "float32", None),
    ("synchronized", {"synchronized": True}, (4, 5, 5, 6), "float32", None),
    ("mask", {}, (4, 5, 5, 6), "float32", (4, 5, 5)),
    ("axis=2", {"axis": 2}, (4, 5, 6, 5), "float32", None),
    ("renorm", {"renorm": True}, (4, 5, 5, 6), "float32", None),
    ("epsilon below the fused minimum", {"epsilon": 1e-6}, (4, 5, 5, 6), "float32", None),
    ("float64", {"dtype": "float64"}, (4, 5, 5, 6), "float64", None),
    ("5-D", {}, (2, 3, 3, 3, 4), "float32", None),
]


@pytest.mark.parametrize("kwargs,shape,dtype,mask_shape", [c[1:] for c in FALLBACK], ids=[c[0] for c in FALLBACK])
def test_fallback_takes_keras_path(kwargs, shape, dtype, mask_shape):
    x = _input(shape, dtype)
    mask = None if mask_shape is None else tf.constant(np.random.default_rng(3).random(mask_shape) > 0.3)
    keras_own, patched = _run(False, x, True, mask, **kwargs), _run(True, x, True, mask, **kwargs)
    for key in keras_own:
        np.testing.assert_array_equal(patched[key], keras_own[key], err_msg=key)
    assert FUSED not in _op_types(True, shape, True, mask, **kwargs)


def _model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(inputs)  # BN cancels a bias
    x = keras.layers.ReLU()(BN(momentum=0.8)(x))
    x = keras.layers.Conv2D(8, 3, strides=2, use_bias=False)(x)
    x = keras.layers.ReLU()(BN(momentum=0.9, center=False)(x))
    outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(x))
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    return model


def _fit_weights(policy, installed):
    rng = np.random.default_rng(4)
    x, y = rng.normal(1.0, 2.0, (32, 8, 8, 3)).astype("float32"), rng.integers(0, 3, 32)
    keras.config.set_dtype_policy(policy)
    _set(installed)
    try:
        model = _model()
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)  # 8 steps
        return {f"{i} {w.name}": np.asarray(w.numpy(), np.float32) for i, w in enumerate(model.weights)}
    finally:
        keras.config.set_dtype_policy("float32")


def _distance(a, b):
    """The largest difference of any weight, relative to that weight's largest magnitude."""
    return max(float(np.max(np.abs(a[k] - b[k])) / (np.max(np.abs(a[k])) or 1.0)) for k in a)


def test_fit_matches_keras():
    keras_own, fused = _fit_weights("float32", False), _fit_weights("float32", True)
    assert any("moving_variance" in path for path in keras_own)
    _assert_close(keras_own, fused, 1e-5)


def test_bfloat16_activations_enter_the_kernel_as_bfloat16():
    """mixed_bfloat16 on a CPU-only process: no float32 copy of the activations (ResNet50: 1.08x)."""
    if not kfb._bfloat16_in_kernel():
        pytest.skip(f"TensorFlow {tf.__version__}'s CPU FusedBatchNormV3 takes no bfloat16 here")
    layer = _layer((4, 5, 5, 6), dtype="mixed_bfloat16")
    _set(True)
    weights = tf.constant(np.random.default_rng(2).normal(size=(4, 5, 5, 6)), tf.float32)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * weights)
        return y, tape.gradient(loss, x)

    graph = step.get_concrete_function(tf.TensorSpec((4, 5, 5, 6), tf.bfloat16)).graph
    kernels = [op for op in graph.get_operations() if op.type in (FUSED, FUSED_GRAD)]
    assert {op.type for op in kernels} == {FUSED, FUSED_GRAD}
    assert all(op.get_attr("T") == tf.bfloat16 and op.get_attr("U") == tf.float32 for op in kernels)
    assert {t.dtype for t in step.get_concrete_function(tf.TensorSpec((4, 5, 5, 6), tf.bfloat16)).outputs} == {tf.bfloat16}


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_fit_in_mixed_precision_is_as_close_to_float32_as_keras(policy):
    # float16 rounding after 8 momentum steps depends on the CPU. On an Intel Xeon with native
    # float16 arithmetic (AVX512-FP16) Keras' own mixed-precision weights differ from its float32
    # ones by 9% and the fused kernel's by 5% (measured), so the two differ by 8.5%; on the AVX2
    # machines of earlier sessions they stayed within 0.5% of each other. The fused path must
    # therefore be no further from float32 than Keras' own path is.
    float32 = _fit_weights("float32", False)
    keras_own, fused = _fit_weights(policy, False), _fit_weights(policy, True)
    assert keras_own.keys() == fused.keys()
    bound = max(1.5 * _distance(float32, keras_own), 5e-3)
    assert _distance(float32, fused) <= bound, (_distance(float32, fused), _distance(float32, keras_own))


def test_traced_training_step_has_fused_ops_only_when_installed():
    keras.utils.set_random_seed(0)
    model = _model()  # built before install
    types = {}
    for installed in (False, True, False):
        _set(installed)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = model.compute_loss(x=x, y=y, y_pred=model(x, training=True))
            return tape.gradient(loss, model.trainable_weights)

        graph = step.get_concrete_function(tf.TensorSpec([None, 8, 8, 3]), tf.TensorSpec([None], tf.int64)).graph
        types[installed] = {op.type for op in graph.get_operations()}
        assert (FUSED in types[installed], FUSED_GRAD in types[installed]) == (installed, installed)


def test_install_twice_is_a_no_op_and_uninstall_restores():
    original = vars(BN)["call"]
    kfb.install()
    patched = vars(BN)["call"]
    assert patched is not original and kfb.is_installed()
    kfb.install()
    assert vars(BN)["call"] is patched
    kfb.uninstall()
    assert vars(BN)["call"] is original and not kfb.is_installed()
    kfb.uninstall()
    assert vars(BN)["call"] is original


BROKEN = [
    ("class gone", lambda mp: mp.delattr(keras.layers, "BatchNormalization")),
    ("call inherited", lambda mp: mp.delattr(BN, "call")),
    ("call signature changed", lambda mp: mp.setattr(BN, "call", lambda self, inputs, training=None: inputs)),
    ("_moments gone", lambda mp: mp.delattr(BN, "_moments")),
]


@pytest.mark.parametrize("brk", [b[1] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_broken_hook_raises_naming_it(monkeypatch, brk):
    brk(monkeypatch)
    with pytest.raises(KerasHookError) as error:
        kfb.install()
    message = str(error.value)
    assert repr(kfb.HOOK) in message and f"keras {keras.__version__}" in message, message
    assert not kfb.is_installed()
