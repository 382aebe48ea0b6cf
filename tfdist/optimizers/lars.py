"""LARS (You, Gitman, Ginsburg 2017) and the LARC wrapper, for Keras 3 and tf-keras.

```python
from tfdist.optimizers import LARS
from tfdist.callbacks import WarmupSchedule, polynomial_decay
optimizer = LARS(WarmupSchedule(polynomial_decay(9.0, total_steps), warmup_steps), momentum=0.9,
                 weight_decay=5e-4)
model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
```

For each variable w with gradient g (a "layer"):

    trust    = eta * ||w|| / (||g|| + weight_decay * ||w|| + epsilon)   (1 if ||w|| or ||g|| is 0)
    velocity = momentum * velocity + learning_rate * trust * (g + weight_decay * w)
    w        = w - velocity

Variables whose path contains one of `exclude_from_adaptation` (default: biases and
BatchNorm/LayerNorm parameters) get plain momentum updates: trust 1, no weight decay.

`LARC(inner_optimizer, mode="clip"|"scale")` applies the layer-wise rate to any optimizer: each
gradient becomes `(g + weight_decay * w) * rate`, with
`rate = trust_coefficient * ||w|| / (||g|| + weight_decay * ||w|| + epsilon)` ("scale"), or
`min(rate / learning_rate, 1)` ("clip": the layer's effective rate never exceeds the global one).
It acts in the optimizer's update step, i.e. on the all-reduced gradient, so under
`HorovodStrategy` it sees the same global gradient as a single process would.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from tfdist.exchange import sharded
from tfdist.keras.flavour import keras_module

if TYPE_CHECKING:
    from keras.optimizers import Optimizer
    from keras.optimizers.schedules import LearningRateSchedule

keras = keras_module()
DEFAULT_EXCLUDE = ("bias", "beta", "gamma", "batch_norm", "batchnorm", "layer_norm", "layernorm")


def lars_direction(w: tf.Tensor, g: tf.Tensor, weight_decay: tf.Tensor | float, eta: tf.Tensor | float,
                   epsilon: tf.Tensor | float, adapt: bool, norms: tuple | None = None) -> tf.Tensor:
    """The LARS update direction (before momentum and learning rate) for one variable.

    Args:
        w: the variable's value.
        g: its gradient.
        weight_decay: the L2 weight decay.
        eta: the trust coefficient.
        epsilon: added to the trust ratio's denominator.
        adapt: apply the trust ratio and weight decay; False returns `g`.
        norms: (||w||, ||g||) of the whole variable when `w` and `g` are one rank's slices of it
            (`shard_optimizer_state=True`); default: those of `w` and `g`.

    Returns:
        `trust * (g + weight_decay * w)` (trust 1 if `w` or `g` is 0), or `g`.
    """
    if not adapt:
        return g
    w_norm, g_norm = norms if norms is not None else (tf.norm(w), tf.norm(g))
    trust = tf.where(
        tf.logical_and(w_norm > 0, g_norm > 0),
        eta * w_norm / (g_norm + weight_decay * w_norm + epsilon),
        tf.ones_like(w_norm),
    )
    return trust * (g + weight_decay * w)


def _variable_path(variable):
    return (getattr(variable, "path", None) or variable.name).lower()


class _LarsMixin:
    """Hyperparameters, exclusion and config shared by both Keras flavours' classes."""

    tfdist_shardable = True  # shard_optimizer_state=True: elementwise but for the whole norms,
    tfdist_whole_norms = True  # which the sharded update sums over the ranks' slices

    def _init_lars(self, momentum, weight_decay, eta, epsilon, exclude_from_adaptation):
        self.momentum = float(momentum)
        self.lars_weight_decay = float(weight_decay)
        self.eta = float(eta)
        self.epsilon = float(epsilon)
        self.exclude_from_adaptation = tuple(exclude_from_adaptation)

    def adapts(self, variable: Any) -> bool:
        """Whether `variable` gets the trust ratio (its path contains no `exclude_from_adaptation`)."""
        path = _variable_path(variable)
        return not any(pattern in path for pattern in self.exclude_from_adaptation)

    def _lars_update(self, gradient, variable, velocity, learning_rate):
        dtype = variable.dtype
        w, g = tf.convert_to_tensor(variable), tf.cast(gradient, dtype)
        direction = lars_direction(
            w, g, tf.cast(self.lars_weight_decay, dtype), tf.cast(self.eta, dtype), tf.cast(self.epsilon, dtype),
            self.adapts(variable), sharded.whole_norms(variable, w, g),
        )
        new_velocity = self.momentum * tf.convert_to_tensor(velocity) + tf.cast(learning_rate, dtype) * direction
        velocity.assign(new_velocity)
        variable.assign_sub(new_velocity)

    def _lars_config(self):
        return {
            "momentum": self.momentum,
            "weight_decay": self.lars_weight_decay,
            "eta": self.eta,
            "epsilon": self.epsilon,
            "exclude_from_adaptation": list(self.exclude_from_adaptation),
        }


# The Keras flavours differ in the optimizer API; `LARS` below adds the one constructor to either.
if keras.__name__ == "tf_keras":

    class _LarsOptimizer(_LarsMixin, keras.optimizers.Optimizer):
        def _init_optimizer(self, learning_rate, name, **kwargs):
            super().__init__(name=name, **kwargs)
            self._learning_rate = self._build_learning_rate(learning_rate)

        def build(self, var_list):
            super().build(var_list)
            if getattr(self, "_built", False):
                return
            self._built = True
            self.velocities = [self.add_variable_from_reference(v, "velocity") for v in var_list]

        def update_step(self, gradient, variable):
            velocity = self.velocities[self._index_dict[self._var_key(variable)]]
            self._lars_update(gradient, variable, velocity, self.learning_rate)

        def get_config(self):
            config = super().get_config()
            config.update({"learning_rate": self._serialize_hyperparameter(self._learning_rate)})
            config.update(self._lars_config())
            return config

else:  # Keras 3

    class _LarsOptimizer(_LarsMixin, keras.optimizers.Optimizer):
        def _init_optimizer(self, learning_rate, name, **kwargs):
            # weight decay is part of the LARS update, not Keras' decoupled decay
            super().__init__(learning_rate=learning_rate, name=name, **kwargs)

        def build(self, var_list):
            if self.built:
                return
            super().build(var_list)
            self.velocities = [self.add_variable_from_reference(v, "velocity") for v in var_list]

        def update_step(self, gradient, variable, learning_rate):
            velocity = self.velocities[self._get_variable_index(variable)]
            self._lars_update(gradient, variable, velocity, learning_rate)

        def get_config(self):
            config = super().get_config()
            config.update(self._lars_config())
            return config


@keras.saving.register_keras_serializable(package="tfdist")
class LARS(_LarsOptimizer):
    """LARS: momentum SGD with a layer-wise trust ratio (You, Gitman, Ginsburg 2017).

    For each variable w with gradient g (a "layer"):

        trust    = eta * ||w|| / (||g|| + weight_decay * ||w|| + epsilon)   (1 if ||w|| or ||g|| is 0)
        velocity = momentum * velocity + learning_rate * trust * (g + weight_decay * w)
        w        = w - velocity

    Variables whose path contains one of `exclude_from_adaptation` get plain momentum updates:
    trust 1, no weight decay. Registered for Keras serialisation (`tfdist>LARS`).

    Args:
        learning_rate: a float or a Keras `LearningRateSchedule` (e.g. `WarmupSchedule`).
        momentum: the velocity's decay.
        weight_decay: L2 weight decay, part of the LARS update (Keras' decoupled weight decay
            stays off).
        eta: the trust coefficient.
        epsilon: added to the trust ratio's denominator.
        exclude_from_adaptation: lower-case substrings of variable paths that get plain
            momentum updates; default: biases and BatchNorm/LayerNorm parameters.
        name: the optimizer's name.
        **kwargs: other Keras optimizer arguments (`clipnorm`, `global_clipnorm`, ...).

    Example:
        ```python
        from tfdist.callbacks import WarmupSchedule, polynomial_decay
        from tfdist.optimizers import LARS
        schedule = WarmupSchedule(polynomial_decay(9.0, total_steps=10_000), warmup_steps=500)
        optimizer = LARS(schedule, momentum=0.9, weight_decay=5e-4)
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
        ```
    """

    def __init__(self, learning_rate: float | LearningRateSchedule = 0.1, momentum: float = 0.9,
                 weight_decay: float = 1e-4, eta: float = 0.001, epsilon: float = 1e-9,
                 exclude_from_adaptation: Iterable[str] = DEFAULT_EXCLUDE, name: str = "LARS", **kwargs: Any):
        self._init_optimizer(learning_rate, name, **kwargs)
        self._init_lars(momentum, weight_decay, eta, epsilon, exclude_from_adaptation)


LARC_MODES = ("clip", "scale")


class _LarcMixin:
    """Rewrites each gradient with the layer-wise rate, then runs the inner optimizer's update."""

    def _init_larc(self, trust_coefficient, mode, weight_decay, epsilon, exclude_from_adaptation):
        if mode not in LARC_MODES:
            raise ValueError(f"LARC mode={mode!r}: expected one of {LARC_MODES}")
        self.trust_coefficient = float(trust_coefficient)
        self.larc_mode = mode
        self.larc_weight_decay = float(weight_decay)
        self.larc_epsilon = float(epsilon)
        self.exclude_from_adaptation = tuple(exclude_from_adaptation)

    def _larc_gradient(self, gradient, variable, learning_rate):
        path = _variable_path(variable)
        if any(pattern in path for pattern in self.exclude_from_adaptation):
            return gradient
        dtype = variable.dtype
        w = tf.convert_to_tensor(variable)
        g = tf.cast(tf.convert_to_tensor(gradient), dtype)
        wd = tf.cast(self.larc_weight_decay, dtype)
        w_norm, g_norm = sharded.whole_norms(variable, w, g)
        rate = tf.where(
            tf.logical_and(w_norm > 0, g_norm > 0),
            self.trust_coefficient * w_norm / (g_norm + wd * w_norm + self.larc_epsilon),
            tf.ones_like(w_norm),
        )
        if self.larc_mode == "clip":
            rate = tf.minimum(rate / tf.cast(learning_rate, dtype), 1.0)
        return (g + wd * w) * rate


_larc_classes = {}


def _larc_class(optimizer_class):
    if optimizer_class not in _larc_classes:
        if keras.__name__ == "tf_keras":
            def update_step(self, gradient, variable):
                lr = self.learning_rate
                return optimizer_class.update_step(self, self._larc_gradient(gradient, variable, lr), variable)
        else:
            def update_step(self, gradient, variable, learning_rate):
                gradient = self._larc_gradient(gradient, variable, learning_rate)
                return optimizer_class.update_step(self, gradient, variable, learning_rate)
        _larc_classes[optimizer_class] = type(
            f"LARC{optimizer_class.__name__}", (_LarcMixin, optimizer_class),
            {"update_step": update_step, "tfdist_shardable_inner": optimizer_class, "tfdist_whole_norms": True})
    return _larc_classes[optimizer_class]


def LARC(inner_optimizer: Optimizer, trust_coefficient: float = 0.02, mode: str = "clip",
         weight_decay: float = 0.0, epsilon: float = 1e-8,
         exclude_from_adaptation: Iterable[str] = DEFAULT_EXCLUDE) -> Optimizer:
    """A copy of `inner_optimizer` (same class and config) whose updates use LARC's layer-wise rate.

    Each gradient becomes `(g + weight_decay * w) * rate`, with
    `rate = trust_coefficient * ||w|| / (||g|| + weight_decay * ||w|| + epsilon)` ("scale"), or
    `min(rate / learning_rate, 1)` ("clip"). Give weight decay to LARC, not to the inner
    optimizer. The result is a subclass of the inner optimizer's class; it is not registered for
    Keras serialisation, so save weights or checkpoints (the optimizer state is saved as usual)
    rather than the compiled model.

    Args:
        inner_optimizer: any Keras optimizer; its config (not its state) is copied.
        trust_coefficient: the trust coefficient.
        mode: "clip" (a layer's effective rate never exceeds the global one) or "scale".
        weight_decay: L2 weight decay, added to each gradient before the rate.
        epsilon: added to the rate's denominator.
        exclude_from_adaptation: lower-case substrings of variable paths whose gradients pass
            unchanged; default: biases and BatchNorm/LayerNorm parameters.

    Returns:
        The new optimizer.

    Raises:
        ValueError: `mode` is neither.

    Example:
        ```python
        import keras
        from tfdist.optimizers import LARC
        optimizer = LARC(keras.optimizers.SGD(0.1, momentum=0.9), mode="clip", weight_decay=5e-4)
        ```
    """
    optimizer = _larc_class(type(inner_optimizer)).from_config(inner_optimizer.get_config())
    optimizer._init_larc(trust_coefficient, mode, weight_decay, epsilon, exclude_from_adaptation)
    return optimizer
