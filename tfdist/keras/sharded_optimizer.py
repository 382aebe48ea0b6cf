"""Keras 3 optimizers that keep state for this rank's slices only (`shard_optimizer_state=True`).

Installed by `HorovodStrategy(shard_optimizer_state=True)` on 2+ ranks, these hooks on Keras 3's
TensorFlow optimizer (`TFOptimizer`) route an optimizer built under that strategy through
`tfdist.exchange.sharded`:

- `build`: the optimizer class is checked (its update must be exact on a slice, below) and its
  sharding starts; slots the base class makes (gradient accumulators, EMA averages) stay whole;
- `add_variable_from_reference`: the slots each optimizer makes in its `build` (momentum,
  Adam's moments, ...) get shape [k], this rank's slice;
- `_var_key`: a working copy (this rank's slice of a variable, which `update_step` updates)
  finds its variable's slots;
- `_clip_gradients`: deferred to after the reduce-scatter, with norms over every slice;
- `_backend_update_step`: reduce-scatter, clip, update the slices, allgather (the step; a
  table under plain SGD or Adagrad gathers only its changed rows, `tfdist.exchange.changed_rows`);
- `save_own_variables` / `load_own_variables` and `keras.Variable`'s checkpoint methods: the
  whole state is written, and each rank loads its slice (`tfdist.keras.sharded_saves`).

Each hook raises `KerasHookError` naming itself when Keras moved what it wraps. Optimizers are
sharded when their update is elementwise (a slice's update needs only that slice): Keras' SGD,
Adam, AdamW, Adamax, Nadam, RMSprop, Adagrad, Adadelta, Ftrl and Lion; tfdist's LARS and LARC
(their trust ratio reads whole norms, summed over slices); and any class that declares
`tfdist_shardable = True`. Others raise `ShardedStateError` naming the class.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import tensorflow as tf

from tfdist import _compat, collectives
from tfdist.errors import ShardedStateError
from tfdist.exchange import changed_rows, sharded
from tfdist.keras import recognise, sharded_saves
from tfdist.keras.flavour import legacy_requested

log = logging.getLogger("tfdist")

HOOK = "sharded optimizer state"
ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "Nadam", "RMSprop", "Adagrad", "Adadelta", "Ftrl", "Lion")
WRAPPERS = ("LossScaleOptimizer", "LossScaleOptimizerV3")  # no per-variable state; the inner one is checked
KERAS_MODULES = ("keras.src.optimizers.", "tf_keras.src.optimizers.")
_base_build = threading.local()  # .depth: inside Keras' base build (its slots stay whole)
_installed = []


def refusal(optimizer_class):
    """Why `optimizer_class` cannot be sharded exactly (a message naming it), or None when it can."""
    inner = getattr(optimizer_class, "tfdist_shardable_inner", None)
    if inner is not None:
        return refusal(inner)
    if getattr(optimizer_class, "tfdist_shardable", False):
        return None
    name, module = optimizer_class.__name__, optimizer_class.__module__
    if module.startswith(KERAS_MODULES) and name in ELEMENTWISE + WRAPPERS:
        return None
    return (f"HorovodStrategy(shard_optimizer_state=True) cannot shard the state of optimizer "
            f"{module}.{name}: tfdist shards optimizers whose update of an element reads only that "
            f"element's gradient and state (Keras' {', '.join(ELEMENTWISE)}; tfdist's LARS and LARC), so "
            "that a rank's slice of each variable updates exactly as in one process. An update that reads "
            "a whole variable (Adafactor's factored moments, Lamb's trust ratio, Muon's orthogonalisation) "
            "would differ. Use shard_optimizer_state=False with this optimizer; for your own optimizer "
            "whose update_step is elementwise, set `tfdist_shardable = True` on its class.")


def _sharding_strategy(optimizer):
    """The tfdist strategy that shards `optimizer`'s state, or None."""
    strategy = getattr(optimizer, "_distribution_strategy", None)
    if not recognise.is_tfdist_strategy(strategy):
        strategy = tf.distribute.get_strategy()
    if (recognise.is_tfdist_strategy(strategy) and strategy.extended.shard_optimizer_state
            and collectives.size() > 1):
        return strategy
    return None


def state_for(optimizer):
    """`optimizer`'s ShardedState, started now if its strategy shards state; None for whole state."""
    state = sharded.state_of(optimizer)
    if state is not None or type(optimizer).__name__ in WRAPPERS or _sharding_strategy(optimizer) is None:
        return state
    problem = refusal(type(optimizer))
    if not problem and getattr(optimizer, "use_ema", False) and legacy_requested():
        problem = ("HorovodStrategy(shard_optimizer_state=True) does not shard a tf-keras optimizer with "
                   "use_ema=True (its moving averages are updated with the variables it updates); use Keras 3, "
                   "or use_ema=False")
    if problem:
        raise ShardedStateError(problem)
    return sharded.start(optimizer, collectives.size(), collectives.rank())


def check_before_fit(model):
    """Refuse, before `fit` traces anything, an optimizer of `model` that its strategy would shard
    and cannot (tf-keras builds optimizers inside the first step's trace, where the error would
    reach the user wrapped in TensorFlow's StagingError)."""
    optimizer = getattr(model, "optimizer", None)
    while optimizer is not None and type(optimizer).__name__ in WRAPPERS:
        optimizer = getattr(optimizer, "inner_optimizer", None)
    if optimizer is not None and not isinstance(optimizer, str) and _installed:
        with model.distribute_strategy.scope():
            state_for(optimizer)


def install():
    """Install the hooks (once); raises `KerasHookError` naming the hook if Keras moved a method."""
    if _installed:
        return
    cls = _compat.keras3_tf_optimizer_class(HOOK)
    methods = ["build", "add_variable_from_reference", "_var_key", "_clip_gradients", "_backend_update_step",
               "save_own_variables", "load_own_variables", "update_step"]
    _compat.require_methods(cls, methods, HOOK)
    variable = _compat.keras3_tf_variable_class(HOOK)
    _compat.patch_method(cls, "build", _wrap_build, HOOK)
    _compat.patch_method(cls, "add_variable_from_reference", _wrap_add_slot, HOOK)
    _compat.patch_method(cls, "_var_key", wrap_var_key, HOOK)
    _compat.patch_method(cls, "_clip_gradients", wrap_clip, HOOK)
    _compat.patch_method(cls, "_backend_update_step", _wrap_update_step, HOOK)
    _compat.patch_method(cls, "save_own_variables", wrap_save, HOOK)
    _compat.patch_method(cls, "load_own_variables", wrap_load, HOOK)
    _compat.patch_method(variable, "_serialize_to_tensors", _wrap_serialize, HOOK)
    _compat.patch_method(variable, "_restore_from_tensors", _wrap_restore, HOOK)
    _installed.append(True)


@contextlib.contextmanager
def inside_base_build():
    _base_build.depth = getattr(_base_build, "depth", 0) + 1
    try:
        yield
    finally:
        _base_build.depth -= 1


def _wrap_build(original):
    def build(self, variables):
        state_for(self)  # refuses an optimizer it cannot shard before any slot exists
        with inside_base_build():
            return original(self, variables)
    return build


def in_base_build():
    """Whether Keras' base `build` is running (its slots, accumulators and EMA averages, stay whole)."""
    return getattr(_base_build, "depth", 0) > 0


def _wrap_add_slot(original):
    def add_variable_from_reference(self, reference_variable, name=None, initializer="zeros"):
        if in_base_build() or state_for(self) is None:
            return original(self, reference_variable, name=name, initializer=initializer)
        state = sharded.state_of(self)
        variable_slice = state.slice_of(self._var_key(reference_variable), reference_variable)
        path = getattr(reference_variable, "path", None) or str(reference_variable.name).replace(":", "_")
        slot = self.add_variable(shape=tuple(variable_slice.slice_shape), initializer=initializer,
                                 dtype=reference_variable.dtype, name=f"{path.replace('/', '_')}_{name or 'var'}")
        state.add_slot(slot, variable_slice)
        return slot
    return add_variable_from_reference


def wrap_var_key(original):
    """`_var_key` that maps a working copy to its variable's key (Keras 3 and tf-keras alike)."""
    def _var_key(self, variable):
        state = sharded.state_of(self)
        key = state.key_of_copy(variable) if state is not None else None
        return original(self, variable) if key is None else key
    return _var_key


def wrap_clip(original):
    """`_clip_gradients` that leaves a sharded optimizer's clipping to the sharded step (both flavours)."""
    def _clip_gradients(self, grads):
        if sharded.state_of(self) is not None:
            return grads  # clipped after the reduce-scatter, with norms over every rank's slice
        return original(self, grads)
    return _clip_gradients


def _wrap_update_step(original):
    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        state = sharded.state_of(self)
        if state is None:
            return original(self, grads, trainable_variables, learning_rate)
        mode = "slices" if sharded.is_scattered_already() else "local"
        return sharded_update_step(self, state, list(grads), list(trainable_variables), mode,
                                   lambda grad, copy: self.update_step(grad, copy, learning_rate))
    return _backend_update_step


def sharded_update_step(optimizer, state, grads, variables, mode, update_one):
    """Reduce-scatter, clip, update this rank's slices with the optimizer's own update
    (`update_one(grad, copy)`), allgather into the variables. `mode`: the gradients are each rank's
    own ("local": reduce-scattered here), already summed ("whole": sliced here) or this rank's
    slices of the sum ("slices")."""
    strategy = tf.distribute.get_strategy()
    keys = [optimizer._var_key(v) for v in variables]
    slices = [state.slice_of(k, v) for k, v in zip(keys, variables)]
    if mode == "local":
        grads = strategy.extended.reduce_scatter(grads, variables)
    elif mode == "whole":
        grads = [sharded.owned_entries(g, s.shape, s.ranks, s.rank) if isinstance(g, tf.IndexedSlices) else s.take(g)
                 for s, g in zip(slices, grads)]
    row_local = changed_rows.row_local(optimizer)
    by_rows = [row_local and isinstance(g, tf.IndexedSlices) and changed_rows.supported(s) for g, s in zip(grads, slices)]
    grads = sharded.clip(grads, optimizer.clipnorm, optimizer.global_clipnorm, optimizer.clipvalue)
    copies = [state.working_copy(k) for k in keys]
    before = [s.take(s.variable) for s in slices]  # set_weights, weight decay, restores
    for copy, value in zip(copies, before):
        copy.assign(value)
    reads_norms = getattr(type(optimizer), "tfdist_whole_norms", False)
    with sharded.whole_norms_known(copies, grads) if reads_norms else contextlib.nullcontext():
        _compat.merge_call(_update_copies, strategy, grads, copies, update_one)
    rows_at = [i for i, rows in enumerate(by_rows) if rows]  # tables under plain SGD, Adagrad: changed rows travel
    sent = [changed_rows.changed(before[i], copies[i], slices[i]) for i in rows_at]
    received = changed_rows.gathered(sent) if sent else []
    whole_at = [i for i, rows in enumerate(by_rows) if not rows]
    gathered = strategy.extended.allgather_slices([copies[i] for i in whole_at])
    _compat.merge_call(_assign_whole, strategy, [variables[i] for i in whole_at],
                       [slices[i].whole(g) for i, g in zip(whole_at, gathered)])
    _compat.merge_call(_write_rows, strategy, [variables[i] for i in rows_at], [slices[i] for i in rows_at], received)


def _update_copies(distribution, grads, copies, update_one):
    for grad, copy in zip(grads, copies):
        distribution.extended.update(copy, lambda c, g: update_one(g, c), args=(grad,), group=False)


def _write_rows(distribution, variables, variable_slices, received):
    for variable, variable_slice, rows in zip(variables, variable_slices, received):
        distribution.extended.update(variable, changed_rows.write, args=(rows, variable_slice), group=False)


def _assign_whole(distribution, variables, values):
    for variable, value in zip(variables, values):
        distribution.extended.update(variable, lambda v, x: v.assign(x), args=(value,), group=False)


def wrap_save(original):
    def save_own_variables(self, store):
        variables = self.variables
        if not any(sharded_saves.slice_of(v) is not None for v in variables):
            return original(self, store)
        for i, variable in enumerate(variables):
            whole = sharded_saves.whole_value(variable, required=True)
            store[str(i)] = variable.numpy() if whole is None else whole
    return save_own_variables


def wrap_load(original):
    def load_own_variables(self, store):
        variables = self.variables
        if len(store.keys()) != len(variables) or all(sharded_saves.slice_of(v) is None for v in variables):
            return original(self, store)  # (Keras warns about a count mismatch itself)
        for i, variable in enumerate(variables):
            mine = sharded_saves.slice_for_load(variable, store[str(i)])
            variable.assign(store[str(i)] if mine is None else mine)
    return load_own_variables


def _wrap_serialize(original):
    def _serialize_to_tensors(self):
        whole = sharded_saves.whole_value(self)  # (None while TensorFlow restores: it asks for the tensors too)
        return original(self) if whole is None else {"VARIABLE_VALUE": tf.constant(whole)}
    return _serialize_to_tensors


def _wrap_restore(original):
    def _restore_from_tensors(self, restored_tensors):
        variable_slice = sharded_saves.slice_of(self)
        if variable_slice is None:
            return original(self, restored_tensors)
        return self.value.assign(variable_slice.take(restored_tensors["VARIABLE_VALUE"]))
    return _restore_from_tensors
