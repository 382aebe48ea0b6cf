"""Opt-in fast path: Keras 3 `BatchNormalization` layers run TensorFlow's fused FusedBatchNormV3 kernel.

Example::

    import numpy as np, keras
    from tfdist.keras import fused_batchnorm as keras_fused_batchnorm

    keras_fused_batchnorm.install()          # every keras.layers.BatchNormalization, old and new
    layer = keras.layers.BatchNormalization()
    y = layer(np.random.rand(8, 4, 4, 3).astype("float32"), training=True)
    keras_fused_batchnorm.uninstall()        # back to Keras' own call

Keras 3's TensorFlow backend normalizes with `ops.moments` and `tf.nn.batch_normalization`: about a
dozen element-wise and reduction ops per layer, each a pass over the activations, forward and
backward. tf-keras calls one FusedBatchNormV3 kernel (and FusedBatchNormGradV3 for the gradient).
Once installed, a layer takes the fused kernel whenever that computes what Keras computes:

- a 4-D input normalized over its last axis (NHWC), or over axis 1 (NCHW) where TensorFlow's CPU
  kernel supports that layout;
- no mask, `synchronized=False`, `renorm=False`, `epsilon >= 1.001e-5` (the fused op's minimum),
  `_moments` not overridden by a subclass, and a Python (not tensor) `training` flag;
- inputs that Keras computes in float32 (float32, float16 and bfloat16 inputs: Keras upcasts them,
  and so does this path; the output is cast to the layer's compute dtype, as Keras does). One
  exception: in a CPU-only process whose kernel takes bfloat16 (TensorFlow 2.21's does), bfloat16
  inputs go to the kernel as they are. It reads them, computes the statistics and the normalization
  in float32, and rounds the output to bfloat16 once, as Keras' upcast-and-cast does, without
  writing and reading a float32 copy of every activation (ResNet50 in `mixed_bfloat16`: 1.08x).

Anything else runs Keras' own `call`, unchanged. `center=False`/`scale=False` pass zeros/ones. In
training (`training=True` and `layer.trainable`) the batch statistics come from the kernel, and the
moving mean and variance are updated as Keras does (`moving * momentum + batch * (1 - momentum)`,
with the biased batch variance: the kernel's variance is Bessel-corrected, so it is rescaled by
(n - 1) / n). In inference the kernel normalizes with the moving statistics. The fused ops have
registered gradients (w.r.t. input, gamma and beta). tf-keras layers are not touched: they are
fused already.
"""

import tensorflow as tf

from tfdist import _compat
from tfdist.errors import KerasHookError

HOOK = "fused batch normalization"

_MIN_EPSILON = 1.001e-5  # tf.compat.v1.nn.fused_batch_norm raises a smaller epsilon to this
_kernel_runs = {}  # cache of _cpu_kernel_runs()


def install():
    """Make `keras.layers.BatchNormalization` use the fused kernel where exactly equivalent.

    Installing twice is a no-op. Raises `KerasHookError` (naming the hook and the Keras version) if
    Keras moved or changed the layer.
    """
    cls = _compat.keras3_batch_normalization(HOOK)
    if _compat.hook_of(vars(cls)["call"]) == HOOK:
        return
    keras_moments = cls._moments
    _compat.patch_method(cls, "call", lambda keras_call: _make_call(keras_call, keras_moments), HOOK)


def uninstall():
    """Restore Keras' own `BatchNormalization.call` (a no-op if not installed). Functions traced
    while installed (e.g. a compiled model's train function) keep the fused ops until retraced."""
    cls = _installed_class()
    if cls is not None:
        cls.call = vars(cls)["call"].tfdist_original


def is_installed():
    """Whether `install()` is in effect."""
    return _installed_class() is not None


def _installed_class():
    try:
        cls = _compat.keras3_batch_normalization(HOOK)
    except KerasHookError:
        return None
    return cls if _compat.hook_of(vars(cls).get("call")) == HOOK else None


def _make_call(keras_call, keras_moments):
    def call(self, inputs, training=None, mask=None):
        data_format = _fused_data_format(self, inputs, training, mask, keras_moments)
        if data_format is None:
            return keras_call(self, inputs, training=training, mask=mask)
        return _fused_call(self, inputs, bool(training and self.trainable), data_format)

    call.__doc__ = keras_call.__doc__
    return call


def _fused_data_format(layer, inputs, training, mask, keras_moments):
    """"NHWC" or "NCHW" if the fused kernel computes exactly what Keras' call would, else None."""
    if mask is not None or layer.synchronized or getattr(layer, "renorm", False):
        return None
    if not isinstance(training, (bool, type(None))) or type(layer)._moments is not keras_moments:
        return None
    if len(inputs.shape) != 4 or layer.epsilon < _MIN_EPSILON:
        return None
    import keras

    if keras.backend.result_type(inputs.dtype, "float32") != "float32":  # e.g. float64 inputs
        return None
    axis = layer.axis % 4
    if axis == 3:
        return "NHWC"
    if axis == 1 and _nchw_supported():
        return "NCHW"
    return None


def _nchw_supported():
    """Whether TensorFlow's CPU FusedBatchNormV3 kernel runs (and differentiates) NCHW inputs."""
    return _cpu_kernel_runs(tf.float32, "NCHW")


def _bfloat16_in_kernel():
    """Whether this process normalizes bfloat16 activations inside the kernel: a CPU-only process whose
    FusedBatchNormV3 (and its gradient) take bfloat16 (statistics in float32, as Keras' upcast does)."""
    return _cpu_kernel_runs(tf.bfloat16, "NHWC", cpu_only=True)


def _cpu_kernel_runs(dtype, data_format, cpu_only=False):
    """Whether TensorFlow's CPU FusedBatchNormV3 and its gradient run on a tiny `dtype` input laid out
    as `data_format`, the gradient coming back in `dtype` and the input's shape. Asked once per
    process (eagerly; False where that is impossible, or with `cpu_only` where a GPU is visible)."""
    key = (dtype, data_format, cpu_only)
    if key not in _kernel_runs:
        ok = False
        with tf.init_scope():
            if tf.executing_eagerly() and not (cpu_only and tf.config.list_logical_devices("GPU")):
                try:
                    with tf.device("/CPU:0"):
                        x = tf.constant([[[[1.0, 2.0]], [[3.0, 5.0]]]], dtype)  # (1, 2, 1, 2): 2 channels either way
                        y, _, _, mean, inv, space = tf.raw_ops.FusedBatchNormV3(
                            x=x, scale=tf.ones([2]), offset=tf.zeros([2]), mean=tf.zeros([0]),
                            variance=tf.zeros([0]), data_format=data_format, is_training=True)
                        dx = tf.raw_ops.FusedBatchNormGradV3(
                            y_backprop=y, x=x, scale=tf.ones([2]), reserve_space_1=mean,
                            reserve_space_2=inv, reserve_space_3=space, data_format=data_format)[0]
                        ok = dx.dtype == dtype and dx.shape == x.shape
                except (tf.errors.OpError, ValueError, TypeError):
                    ok = False
        _kernel_runs[key] = bool(ok)
    return _kernel_runs[key]


def _fused(x, scale, offset, mean, variance, epsilon, data_format, training):
    return tf.compat.v1.nn.fused_batch_norm(
        x, scale, offset, mean=mean, variance=variance, epsilon=epsilon,
        data_format=data_format, is_training=training)


def _fused_call(layer, inputs, training, data_format):
    if inputs.dtype == tf.bfloat16 and _bfloat16_in_kernel():
        x = inputs  # the kernel reads bfloat16 and computes in float32: no float32 copy of x
    else:
        x = tf.cast(inputs, tf.float32)  # Keras computes in result_type(inputs.dtype, float32)
    channels = layer.moving_mean.shape[0]
    gamma = tf.cast(layer.gamma, tf.float32) if layer.scale else tf.ones([channels], tf.float32)
    beta = tf.cast(layer.beta, tf.float32) if layer.center else tf.zeros([channels], tf.float32)
    moving_mean = tf.cast(layer.moving_mean, tf.float32)
    moving_variance = tf.cast(layer.moving_variance, tf.float32)
    if training:
        outputs, mean, variance = _fused(x, gamma, beta, None, None, layer.epsilon, data_format, True)
        # The kernel's batch variance is Bessel-corrected (divided by n - 1); Keras' moving variance
        # is updated with the biased one (divided by n). multiply_no_nan: n == 1 gives 0, not NaN.
        n = tf.cast(tf.size(x, out_type=tf.int64) // channels, tf.float32)
        variance = tf.math.multiply_no_nan(variance, (n - 1.0) / n)
        momentum = layer.momentum
        layer.moving_mean.assign(moving_mean * momentum + mean * (1.0 - momentum))
        layer.moving_variance.assign(moving_variance * momentum + variance * (1.0 - momentum))
    else:
        outputs = _fused(x, gamma, beta, moving_mean, moving_variance, layer.epsilon, data_format,
                         False)[0]
    return tf.cast(outputs, layer.compute_dtype)
