"""Large-batch learning rates: the scaling rule, gradual warmup (Goyal et al. 2017), hand-over.

```python
from tfdist.callbacks import WarmupSchedule, scale_learning_rate
import keras
lr = scale_learning_rate(0.1, global_batch_size=32 * strategy.size)      # 0.1 x global / 256
after = keras.optimizers.schedules.CosineDecay(lr, decay_steps=90 * steps_per_epoch)
optimizer = keras.optimizers.SGD(WarmupSchedule(after, warmup_steps=5 * steps_per_epoch), momentum=0.9)
```

`WarmupSchedule` is in-graph and works with any optimizer; `LearningRateWarmup` is the callback
form for code that keeps its own optimizer and float learning rate. Both continue where a
resumed run left off: the schedule reads the optimizer's restored step counter, the callback
the epoch Keras resumes at (`fit(initial_epoch=...)`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from tfdist import _compat
from tfdist.callbacks._keras import Callback, keras_module

if TYPE_CHECKING:
    import tensorflow as tf
    from keras.optimizers.schedules import LearningRateSchedule, PiecewiseConstantDecay, PolynomialDecay

keras = keras_module()
_schedules = keras.optimizers.schedules


def scale_learning_rate(base_lr: float, global_batch_size: int, reference_batch_size: int = 256,
                        rule: str = "linear") -> float:
    """`base_lr` scaled to `global_batch_size`: linear (x k) or square-root (x sqrt k) rule.

    Args:
        base_lr: the learning rate tuned for `reference_batch_size`.
        global_batch_size: the batch of one step over all ranks.
        reference_batch_size: the batch `base_lr` was tuned for; k = global / reference.
        rule: "linear" (Goyal et al. 2017) or "sqrt".

    Returns:
        The scaled learning rate.

    Raises:
        ValueError: `rule` is neither.

    Example:
        ```python
        from tfdist.callbacks import scale_learning_rate
        print(scale_learning_rate(0.1, global_batch_size=1024))                # 0.4
        print(scale_learning_rate(0.1, global_batch_size=1024, rule="sqrt"))   # 0.2
        ```
    """
    k = global_batch_size / reference_batch_size
    if rule == "linear":
        return base_lr * k
    if rule == "sqrt":
        return base_lr * math.sqrt(k)
    raise ValueError(f"rule={rule!r}: expected 'linear' or 'sqrt'")


def step_decay(learning_rate: float, boundary_epochs: Iterable[float], steps_per_epoch: int,
               factor: float = 0.1) -> PiecewiseConstantDecay:
    """Multiply by `factor` from the first step of each epoch in `boundary_epochs` (e.g. 30, 60, 80).

    Args:
        learning_rate: the rate before the first boundary.
        boundary_epochs: the epochs (counted from 0) whose first step decays the rate, ascending.
        steps_per_epoch: optimizer steps per epoch.
        factor: the multiplier at each boundary.

    Returns:
        A Keras schedule of the optimizer step.

    Example:
        ```python
        from tfdist.callbacks import step_decay
        schedule = step_decay(0.1, [30, 60, 80], steps_per_epoch=100)
        print(f"{float(schedule(2999)):.3g} {float(schedule(3000)):.3g}")   # 0.1 0.01
        ```
    """
    # PiecewiseConstantDecay switches after a boundary step, so the boundary is the step before.
    boundaries = [int(e * steps_per_epoch) - 1 for e in boundary_epochs]
    values = [learning_rate * factor**i for i in range(len(boundaries) + 1)]
    return _schedules.PiecewiseConstantDecay(boundaries, values)


def polynomial_decay(learning_rate: float, total_steps: int, end_learning_rate: float = 0.0,
                     power: float = 2.0) -> PolynomialDecay:
    """Polynomial decay to `end_learning_rate` (power 2 is the usual LARS companion).

    Args:
        learning_rate: the rate at step 0.
        total_steps: the step at which the rate reaches `end_learning_rate` (and stays).
        end_learning_rate: the final rate.
        power: the polynomial's power.

    Returns:
        A Keras schedule of the optimizer step.

    Example:
        ```python
        from tfdist.callbacks import polynomial_decay
        schedule = polynomial_decay(9.0, total_steps=1000)
        print(float(schedule(0)), float(schedule(500)), float(schedule(1000)))   # 9.0 2.25 0.0
        ```
    """
    return _schedules.PolynomialDecay(learning_rate, total_steps, end_learning_rate, power=power)


@keras.saving.register_keras_serializable(package="tfdist")
class WarmupSchedule(_schedules.LearningRateSchedule):
    """Linear warmup from `start_learning_rate` to the `after` schedule's value at `warmup_steps`.

    From `warmup_steps` on it is `after`, evaluated at the optimizer step. In-graph, so it works
    with any optimizer, and a resumed run continues where it left off (from the restored step).

    Args:
        after: the rate after warmup: a float, or any Keras `LearningRateSchedule`.
        warmup_steps: optimizer steps of warmup (0: none).
        start_learning_rate: the rate at step 0.

    Example:
        ```python
        import keras
        from tfdist.callbacks import WarmupSchedule
        schedule = WarmupSchedule(0.4, warmup_steps=100)
        print(f"{float(schedule(50)):.3g} {float(schedule(200)):.3g}")   # 0.2 0.4
        optimizer = keras.optimizers.SGD(schedule, momentum=0.9)
        ```
    """

    def __init__(self, after: float | LearningRateSchedule, warmup_steps: int, start_learning_rate: float = 0.0):
        self.after = after
        self.warmup_steps = int(warmup_steps)
        self.start_learning_rate = float(start_learning_rate)

    def _after(self, step):
        import tensorflow as tf

        if isinstance(self.after, _schedules.LearningRateSchedule):
            return tf.cast(self.after(step), tf.float32)
        return tf.constant(float(self.after), tf.float32)

    def __call__(self, step: int | tf.Tensor) -> tf.Tensor:
        """The learning rate at optimizer step `step` (float32)."""
        import tensorflow as tf

        step = tf.cast(step, tf.float32)
        if self.warmup_steps <= 0:
            return self._after(step)
        target = self._after(tf.constant(float(self.warmup_steps)))
        fraction = step / float(self.warmup_steps)
        warm = self.start_learning_rate + (target - self.start_learning_rate) * fraction
        return tf.where(step < self.warmup_steps, warm, self._after(step))

    def get_config(self) -> dict[str, Any]:
        """The schedule's arguments (`after` serialised when it is a schedule)."""
        after = self.after
        if isinstance(after, _schedules.LearningRateSchedule):
            after = _schedules.serialize(after)
        return {"after": after, "warmup_steps": self.warmup_steps,
                "start_learning_rate": self.start_learning_rate}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> WarmupSchedule:
        """The schedule `get_config` describes."""
        config = dict(config)
        if isinstance(config["after"], dict):
            config["after"] = _schedules.deserialize(config["after"])
        return cls(**config)


class LearningRateWarmup(Callback):
    """Set the optimizer's (float) learning rate every step: linear warmup over `warmup_epochs`.

    The rate goes from `start_learning_rate` to `target_learning_rate`, then stays there (or is
    left to the user's other callbacks). The rate is added to the epoch logs (`History`,
    TensorBoard) as `learning_rate`.

    Args:
        warmup_epochs: epochs of warmup (may be fractional).
        steps_per_epoch: optimizer steps per epoch.
        start_learning_rate: the rate at the first step.
        target_learning_rate: the rate at the end of warmup; default: the optimizer's rate at
            the start of training.
        momentum_correction: rescale momentum buffers by new_lr / old_lr whenever the rate
            changes, as Goyal et al. (2017) and Horovod's warmup callback do, so the velocity,
            which carries the old rate, does not jump.

    Example:
        ```python
        from tfdist.callbacks import LearningRateWarmup
        warmup = LearningRateWarmup(warmup_epochs=5, steps_per_epoch=plan.steps_per_epoch)
        model.fit(ds, epochs=90, steps_per_epoch=plan.steps_per_epoch, callbacks=[warmup])
        ```
    """

    def __init__(self, warmup_epochs: float, steps_per_epoch: int, start_learning_rate: float = 0.0,
                 target_learning_rate: float | None = None, momentum_correction: bool = True):
        super().__init__()
        self.warmup_epochs = warmup_epochs
        self.steps_per_epoch = steps_per_epoch
        self.start_learning_rate = start_learning_rate
        self.target_learning_rate = target_learning_rate
        self.momentum_correction = momentum_correction
        self._epoch = 0

    def on_train_begin(self, logs=None):
        if self.target_learning_rate is None:
            self.target_learning_rate = float(_get_lr(self.model.optimizer))

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def learning_rate_at(self, epoch: int, batch: int) -> float:
        """The warmup's rate at step `batch` of epoch `epoch` (`target_learning_rate` after it)."""
        progress = (epoch + batch / self.steps_per_epoch) / self.warmup_epochs
        if progress >= 1:
            return self.target_learning_rate
        return self.start_learning_rate + (self.target_learning_rate - self.start_learning_rate) * progress

    def on_train_batch_begin(self, batch, logs=None):
        if self._epoch >= self.warmup_epochs and batch > 0:
            return
        optimizer = self.model.optimizer
        old, new = float(_get_lr(optimizer)), self.learning_rate_at(self._epoch, batch)
        if new == old:
            return
        if self.momentum_correction and old > 0:
            for buffer in getattr(optimizer, "momentums", None) or []:
                buffer.assign(buffer * (new / old))
        _set_lr(optimizer, new)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["learning_rate"] = float(_get_lr(self.model.optimizer))


class LearningRateLogger(Callback):
    """Adds the learning rate used by each epoch's last step to that epoch's logs.

    A schedule is evaluated at that step, so `History` and `keras.callbacks.TensorBoard` (place
    this callback before it) record it as `learning_rate`, the same on Keras 3 and tf-keras.

    Example:
        ```python
        import keras
        from tfdist.callbacks import LearningRateLogger
        model.fit(ds, epochs=3, callbacks=[LearningRateLogger(), keras.callbacks.TensorBoard("runs/lr")])
        ```
    """

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        optimizer = self.model.optimizer
        schedule = _compat.optimizer_learning_rate(optimizer)
        if isinstance(schedule, _schedules.LearningRateSchedule):
            last_step = max(int(np.asarray(optimizer.iterations)) - 1, 0)
            logs["learning_rate"] = float(np.asarray(schedule(last_step)))
        else:
            logs["learning_rate"] = float(_get_lr(optimizer))


def _get_lr(optimizer):
    return np.asarray(optimizer.learning_rate)


def _set_lr(optimizer, value):
    lr = optimizer.learning_rate
    if hasattr(lr, "assign"):
        lr.assign(value)
    else:
        optimizer.learning_rate = value
