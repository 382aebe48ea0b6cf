"""tf-keras optimizers that keep state for this rank's slices only (`shard_optimizer_state=True`).

The tf-keras counterpart of `tfdist.keras.sharded_optimizer`, installed by
`HorovodStrategy(shard_optimizer_state=True)` when tf-keras is in use. tf-keras sums gradients in
`apply_gradients` (`aggregate_gradients`) and updates in `_internal_apply_gradients`; the hooks
on `tf_keras.optimizers.Optimizer`:

- `build`, `add_variable_from_reference`, `_var_key`: as on Keras 3 (slots of shape [k], the
  working copy finds its variable's slots; EMA averages stay whole);
- `apply_gradients`: no allreduce; the gradients reach `_internal_apply_gradients` as each rank's
  own, or already summed by the caller (`skip_gradients_aggregation=True`), or already this
  rank's slices (the loss-scaling hook), and it says which;
- `_clip_gradients`: deferred to the slices; `_internal_apply_gradients`: reduce-scatter, clip,
  update the slices (`_update_step`), allgather (`sharded_optimizer.sharded_update_step`);
- `save_own_variables` / `load_own_variables`: whole (`tfdist.keras.sharded_saves`); TensorFlow
  checkpoints of its slots (tf.Variables) go through `tfdist.rank_variables`.

`LossScaleOptimizerV3.apply_gradients` reduce-scatters first and, when any rank's slice holds
inf/nan, makes every rank's slices NaN (one tiny allreduce), so that every rank's own finite check
skips the same step.
"""

from __future__ import annotations

import contextlib
import threading

import tensorflow as tf

from tfdist import _compat, collectives
from tfdist.exchange import sharded
from tfdist.keras import sharded_optimizer

HOOK = sharded_optimizer.HOOK
_apply = threading.local()  # .mode: how the gradients reaching _internal_apply_gradients stand
_installed = []


def install():
    """Install the hooks (once); raises `KerasHookError` naming the hook if tf-keras moved a method."""
    if _installed:
        return
    optimizer, loss_scaled = _compat.tf_keras_optimizer_classes(HOOK)
    _compat.require_methods(optimizer, ["build", "add_variable_from_reference", "_var_key", "apply_gradients",
                                        "_clip_gradients", "_deduplicate_sparse_grad", "_internal_apply_gradients",
                                        "_update_step",
                                        "save_own_variables", "load_own_variables"], HOOK, "tf_keras")
    _compat.require_methods(loss_scaled, ["apply_gradients"], HOOK, "tf_keras")
    patch = [("build", _wrap_build), ("add_variable_from_reference", _wrap_add_slot),
             ("_var_key", sharded_optimizer.wrap_var_key), ("apply_gradients", _wrap_apply),
             ("_clip_gradients", sharded_optimizer.wrap_clip), ("_deduplicate_sparse_grad", _wrap_deduplicate),
             ("_internal_apply_gradients", _wrap_internal_apply), ("save_own_variables", sharded_optimizer.wrap_save),
             ("load_own_variables", sharded_optimizer.wrap_load)]
    for name, wrap in patch:
        _compat.patch_method(optimizer, name, wrap, HOOK, "tf_keras")
    _compat.patch_method(loss_scaled, "apply_gradients", _wrap_loss_scaled_apply, HOOK, "tf_keras")
    _installed.append(True)


@contextlib.contextmanager
def _gradients_are(mode):
    outer, _apply.mode = getattr(_apply, "mode", None), mode
    try:
        yield
    finally:
        _apply.mode = outer


def _wrap_build(original):
    def build(self, var_list):
        sharded_optimizer.state_for(self)
        with sharded_optimizer.inside_base_build():
            return original(self, var_list)
    return build


def _wrap_add_slot(original):
    def add_variable_from_reference(self, model_variable, variable_name, shape=None, initial_value=None):
        if sharded_optimizer.in_base_build() or shape is not None or sharded_optimizer.state_for(self) is None:
            return original(self, model_variable, variable_name, shape=shape, initial_value=initial_value)
        state = sharded.state_of(self)
        variable_slice = state.slice_of(self._var_key(model_variable), model_variable)
        if initial_value is not None:
            initial_value = variable_slice.take(initial_value)
        slot = original(self, model_variable, variable_name, shape=variable_slice.slice_shape, initial_value=initial_value)
        state.add_slot(slot, variable_slice)
        return slot
    return add_variable_from_reference


def _wrap_apply(original):
    def apply_gradients(self, grads_and_vars, name=None, skip_gradients_aggregation=False, **kwargs):
        grads_and_vars = list(grads_and_vars)
        if grads_and_vars:
            with tf.init_scope():
                self.build([v for _, v in grads_and_vars])
        if sharded.state_of(self) is None:
            return original(self, grads_and_vars, name, skip_gradients_aggregation, **kwargs)
        summed = skip_gradients_aggregation or not kwargs.pop("experimental_aggregate_gradients", True)
        mode = "slices" if sharded.is_scattered_already() else "whole" if summed else "local"
        with _gradients_are(mode):
            return original(self, grads_and_vars, name, skip_gradients_aggregation=True, **kwargs)
    return apply_gradients


def _wrap_deduplicate(original):
    def _deduplicate_sparse_grad(self, grads):
        if sharded.state_of(self) is None or getattr(_apply, "deduplicate", False):
            return original(self, grads)
        return grads  # after the gather and the clip, in _internal_apply_gradients: as one process orders them
    return _deduplicate_sparse_grad


def _wrap_internal_apply(original):
    def _internal_apply_gradients(self, grads_and_vars):
        state = sharded.state_of(self)
        if state is None:
            return original(self, grads_and_vars)
        grads, variables = zip(*grads_and_vars)

        def update_one(grad, copy):
            # tf-keras sums a sparse gradient's repeated rows after clipping it (every rank's rows, here)
            # (through the optimizer's own method, so a subclass that overrides it is followed)
            if isinstance(grad, tf.IndexedSlices):
                _apply.deduplicate = True
                try:
                    grad = self._deduplicate_sparse_grad([grad])[0]
                finally:
                    _apply.deduplicate = False
            return self._update_step(grad, copy)

        sharded_optimizer.sharded_update_step(self, state, list(grads), list(variables),
                                              getattr(_apply, "mode", None) or "local", update_one)
        return self.iterations.assign_add(1)
    return _internal_apply_gradients


def _wrap_loss_scaled_apply(original):
    def apply_gradients(self, grads_and_vars, skip_gradients_aggregation=False, **kwargs):
        grads_and_vars = list(grads_and_vars)
        inner = getattr(self, "inner_optimizer", None)
        if grads_and_vars and inner is not None:
            with tf.init_scope():
                self.build([v for _, v in grads_and_vars])  # (so the inner optimizer's sharding has started)
        # tfdist's gradient accumulation (accumulate_gradients) sums whole gradients: as unsharded
        if (inner is None or sharded.state_of(inner) is None or skip_gradients_aggregation
                or hasattr(inner, "accumulation_steps")):
            return original(self, grads_and_vars, skip_gradients_aggregation=skip_gradients_aggregation, **kwargs)
        grads_and_vars = [(g, v) for g, v in grads_and_vars if g is not None]
        slices = tf.distribute.get_strategy().extended.reduce_scatter(*zip(*grads_and_vars))
        local = tf.cast(tf.reduce_all([tf.reduce_all(tf.math.is_finite(sharded.entries(s))) for s in slices]), tf.int32)
        finite_everywhere = collectives.allreduce([1 - local], op="sum", scope="tfdist_loss_scale_agreement")[0]
        poison = tf.where(tf.equal(finite_everywhere, 0), 0.0, float("nan"))
        slices = [tf.IndexedSlices(s.values + tf.cast(poison, s.dtype), s.indices, s.dense_shape)
                  if isinstance(s, tf.IndexedSlices) else s + tf.cast(poison, s.dtype) for s in slices]
        with sharded.scattered_already():
            return original(self, list(zip(slices, [v for _, v in grads_and_vars])),
                            skip_gradients_aggregation=True, **kwargs)
    return apply_gradients
