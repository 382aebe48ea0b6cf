"""Gradient accumulation: k micro-batches per optimizer update, one allreduce per update.

```python
from tfdist.optimizers import accumulate_gradients
optimizer = accumulate_gradients(keras.optimizers.SGD(0.1, momentum=0.9), steps=4)
```

Keras 3 has this built in (`gradient_accumulation_steps`); this returns such a copy of the
optimizer. tf-keras has no such option: there the copy accumulates each micro-batch's local
gradient and, every k-th step, hands their mean to the optimizer's own `apply_gradients`, where the
allreduce happens. Either way ranks exchange gradients once per k steps, and k micro-batches of
size B give the update of one batch of size k*B.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import tensorflow as tf

from tfdist.keras.flavour import keras_module

if TYPE_CHECKING:
    from keras.optimizers import Optimizer

keras = keras_module()
_accumulating_classes = {}


class _AccumulatingMixin:
    def _accumulate(self, grads_and_vars):
        variables = [v for _, v in grads_and_vars]
        if not hasattr(self, "_accumulators"):
            with tf.init_scope():
                # ON_READ: replica-local sums, never broadcast by a strategy
                self._accumulators = [
                    tf.Variable(tf.zeros_like(v), trainable=False, name="accumulated_gradient",
                                synchronization=tf.VariableSynchronization.ON_READ,
                                aggregation=tf.VariableAggregation.NONE)
                    for v in variables
                ]
                self._micro_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="micro_steps",
                                                synchronization=tf.VariableSynchronization.ON_READ,
                                                aggregation=tf.VariableAggregation.NONE)
        updates = [acc.assign_add(tf.convert_to_tensor(g)) for (g, _), acc in zip(grads_and_vars, self._accumulators)]
        with tf.control_dependencies(updates):
            return self._micro_steps.assign_add(1), variables


def _accumulating_class(optimizer_class):
    if optimizer_class not in _accumulating_classes:
        def apply_gradients(self, grads_and_vars, *args, **kwargs):
            micro_steps, variables = self._accumulate(list(grads_and_vars))

            def apply():
                means = [acc.read_value() / self.accumulation_steps for acc in self._accumulators]
                optimizer_class.apply_gradients(self, list(zip(means, variables)), *args, **kwargs)
                with tf.control_dependencies(means):
                    return tf.group([acc.assign(tf.zeros_like(acc)) for acc in self._accumulators])

            return tf.cond(tf.equal(micro_steps % self.accumulation_steps, 0), apply, tf.no_op)

        _accumulating_classes[optimizer_class] = type(
            f"Accumulating{optimizer_class.__name__}", (_AccumulatingMixin, optimizer_class),
            {"apply_gradients": apply_gradients, "tfdist_shardable_inner": optimizer_class},
        )
    return _accumulating_classes[optimizer_class]


def accumulate_gradients(optimizer: Optimizer, steps: int) -> Optimizer:
    """A copy of `optimizer` that updates once every `steps` micro-batches (mean gradient).

    Args:
        optimizer: a Keras optimizer; its config (not its state) is copied.
        steps: micro-batches per update, at least 2.

    Returns:
        A new optimizer of `optimizer`'s class (Keras 3: with `gradient_accumulation_steps`;
            tf-keras: an accumulating subclass).

    Raises:
        ValueError: `steps` is below 2.

    Example:
        ```python
        import keras
        from tfdist.optimizers import accumulate_gradients
        optimizer = accumulate_gradients(keras.optimizers.SGD(0.1, momentum=0.9), steps=4)
        ```
    """
    if int(steps) < 2:
        raise ValueError(f"accumulate_gradients: steps={steps} must be an integer >= 2")
    config = optimizer.get_config()
    if keras.__name__ != "tf_keras":
        return type(optimizer).from_config({**config, "gradient_accumulation_steps": int(steps)})
    copy = _accumulating_class(type(optimizer)).from_config(config)
    copy.accumulation_steps = int(steps)
    return copy
