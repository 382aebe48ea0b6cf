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

import math

import numpy as np

from tfdist import _compat
from tfdist.callbacks._keras import Callback, keras_module

keras = keras_module()
_schedules = keras.optimizers.schedules


def scale_learning_rate(base_lr, global_batch_size, reference_batch_size=256, rule="linear"):
    """`base_lr` scaled to `global_batch_size`: linear (x k) or square-root (x sqrt k) rule."""
    k = global_batch_size / reference_batch_size
    if rule == "linear":
        return base_lr * k
    if rule == "sqrt":
        return base_lr * math.sqrt(k)
    raise ValueError(f"rule={rule!r}: expected 'linear' or 'sqrt'")


def step_decay(learning_rate, boundary_epochs, steps_per_epoch, factor=0.1):
    """Multiply by `factor` from the first step of each epoch in `boundary_epochs` (e.g. 30, 60, 80)."""
    # PiecewiseConstantDecay switches after a boundary step, so the boundary is the step before.
    boundaries = [int(e * steps_per_epoch) - 1 for e in boundary_epochs]
    values = [learning_rate * factor**i for i in range(len(boundaries) + 1)]
    return _schedules.PiecewiseConstantDecay(boundaries, values)


def polynomial_decay(learning_rate, total_steps, end_learning_rate=0.0, power=2.0):
    """Polynomial decay to `end_learning_rate` (power 2 is the usual LARS companion)."""
    return _schedules.PolynomialDecay(learning_rate, total_steps, end_learning_rate, power=power)


@keras.saving.register_keras_serializable(package="tfdist")
class WarmupSchedule(_schedules.LearningRateSchedule):
    """Linear warmup from `start_learning_rate` to the `after` schedule's value at `warmup_steps`,
    then `after` (a float or any LearningRateSchedule, evaluated at the global step)."""

    def __init__(self, after, warmup_steps, start_learning_rate=0.0):
        self.after = after
        self.warmup_steps = int(warmup_steps)
        self.start_learning_rate = float(start_learning_rate)

    def _after(self, step):
        import tensorflow as tf

        if isinstance(self.after, _schedules.LearningRateSchedule):
            return tf.cast(self.after(step), tf.float32)
        return tf.constant(float(self.after), tf.float32)

    def __call__(self, step):
        import tensorflow as tf

        step = tf.cast(step, tf.float32)
        if self.warmup_steps <= 0:
            return self._after(step)
        target = self._after(tf.constant(float(self.warmup_steps)))
        fraction = step / float(self.warmup_steps)
        warm = self.start_learning_rate + (target - self.start_learning_rate) * fraction
        return tf.where(step < self.warmup_steps, warm, self._after(step))

    def get_config(self):
        after = self.after
        if isinstance(after, _schedules.LearningRateSchedule):
            after = _schedules.serialize(after)
        return {"after": after, "warmup_steps": self.warmup_steps,
                "start_learning_rate": self.start_learning_rate}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if isinstance(config["after"], dict):
            config["after"] = _schedules.deserialize(config["after"])
        return cls(**config)


class LearningRateWarmup(Callback):
    """Set the optimizer's (float) learning rate every step: linear warmup over `warmup_epochs`
    from `start_learning_rate` to `target_learning_rate` (default: the optimizer's rate at the
    start of training), then leave it there (or to the user's other callbacks).

    With `momentum_correction`, momentum buffers are rescaled by new_lr / old_lr whenever the
    rate changes, as Goyal et al. (2017) and Horovod's warmup callback do, so the velocity,
    which carries the old rate, does not jump. The rate is added to the epoch logs (`History`,
    TensorBoard) as `learning_rate`.
    """

    def __init__(self, warmup_epochs, steps_per_epoch, start_learning_rate=0.0,
                 target_learning_rate=None, momentum_correction=True):
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

    def learning_rate_at(self, epoch, batch):
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
    """Adds the learning rate used by each epoch's last step to that epoch's logs (a schedule is
    evaluated at that step), so `History` and `keras.callbacks.TensorBoard` (place this callback
    before it) record it, the same on Keras 3 and tf-keras."""

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
