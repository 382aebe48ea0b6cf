"""Every private TensorFlow, Keras and Horovod internal that tfdist uses, in one place.

Checked against: TensorFlow 2.21.0, Keras 3.15.1 (as shipped with TensorFlow 2.21), tf-keras
2.21.0 and Horovod 0.28.1. After an upgrade of any of them, this module (and
tests/test_keras_hooks.py, which checks every Keras hook) is what to re-check.

Other tfdist modules reach these internals only through the names below:

- TensorFlow (lazy: `tfdist-run` never imports it): the `tensorflow.python` modules
  `distribute_utils`, `one_device_strategy`, `input_util` (`HorovodStrategy` is built from them),
  `distributed_values`, `distributed_values_util`, `saveable_object` (`tfdist.rank_variables`'
  one-component variables), `global_batch_size`; `in_xla_context`, `tf_function_class`,
  `tf_function_jit_compile`, `tf_function_settings` (`tfdist.exchange.xla` retraces), `global_seed`,
  `compute_batch_size`, `onednn_enabled`, `rank_local_variable`, `merge_call`; tf.data's private
  `dataset_inputs`, `dataset_graph_def`; the saves `tfdist.keras.chief_saves` wraps and a
  `CheckpointManager`'s private settings. (`HorovodExtended` overrides `StrategyExtended`'s private
  methods, as every `tf.distribute.Strategy` must; `tfdist.optimizers.lars` subclasses through each
  Keras' API: `_var_key`, ...)
- Keras: the classes tfdist patches (found through public names where one exists), the private
  methods it patches (`KERAS3_SAVE_MODEL`, `TF_KERAS_SUPPORTED_STRATEGIES`), `patch_method` (raises
  `KerasHookError` naming the Keras version and the hook), `has_hook`, and private optimizer state
  (`optimizer_learning_rate`, `optimizer_built`). Where `fit` resumes and what `BackupAndRestore`
  records are in `tfdist._compat_state`.
- Horovod: its rendezvous HTTP server and slot plan (`horovod.runner`), in `rendezvous_classes`.
"""

import importlib
import os
import sys

from tfdist.errors import KerasHookError
from tfdist.keras.flavour import legacy_requested

CHECKED_AGAINST = "TensorFlow 2.21.0, Keras 3.15.1, tf-keras 2.21.0, Horovod 0.28.1"

# --- TensorFlow -----------------------------------------------------------------------------------

_TF_MODULES = {
    "distribute_utils": "tensorflow.python.distribute.distribute_utils",
    "distribute_lib": "tensorflow.python.distribute.distribute_lib",
    "one_device_strategy": "tensorflow.python.distribute.one_device_strategy",
    "input_util": "tensorflow.python.distribute.input_util",
    "distributed_values": "tensorflow.python.distribute.values",
    "distributed_values_util": "tensorflow.python.distribute.values_util",
    "saveable_object": "tensorflow.python.training.saving.saveable_object",
    "resource_variable_ops": "tensorflow.python.ops.resource_variable_ops",
    "numpy_dataset": "tensorflow.python.distribute.numpy_dataset",
}


def __getattr__(name):  # `_compat.distribute_lib` etc. import TensorFlow only when first used
    if name in _TF_MODULES:
        module = importlib.import_module(_TF_MODULES[name])
        globals()[name] = module
        return module
    raise AttributeError(f"module 'tfdist._compat' has no attribute {name!r}")


def rank_local_variable(initial_value, name):
    """A plain variable of this rank alone, created eagerly (also while a `tf.function` traces) and
    past every variable creator (`ResourceVariable(...)` skips the stack `tf.Variable` runs), so no
    strategy broadcasts or wraps it: compression's error feedback, sharded optimizer slices."""
    with __import__("tensorflow").init_scope():
        return __getattr__("resource_variable_ops").ResourceVariable(initial_value, trainable=False, name=name)


def in_xla_context(graph):
    """Whether `graph` (or a graph it is nested in) is being compiled with XLA."""
    from tensorflow.python.ops import control_flow_util
    return control_flow_util.GraphOrParentsInXlaContext(graph)


def tf_function_class():
    """The class `tf.function` returns (`Function`), whose `__call__` `tfdist.exchange.xla` wraps."""
    from tensorflow.python.eager.polymorphic_function import polymorphic_function

    return polymorphic_function.Function


def tf_function_jit_compile(function):
    """The `jit_compile` a `tf.function` was made with (True, False or None)."""
    return function._jit_compile


def tf_function_settings(function):
    """(python function, the `tf.function` keyword arguments that made `function`)."""
    return function._python_function, {
        "input_signature": function.input_signature, "autograph": function._autograph,
        "experimental_autograph_options": function._experimental_autograph_options,
        "reduce_retracing": function._reduce_retracing, "jit_compile": function._jit_compile}


def global_seed():
    """The global TensorFlow seed set by `tf.random.set_seed`, or None."""
    from tensorflow.python.eager import context

    return context.global_seed()


def compute_batch_size(dataset):
    """The batch size tf.distribute infers for `dataset` (-1 if unknown)."""
    from tensorflow.python.data.experimental.ops import distribute as tf_data_distribute

    return tf_data_distribute.compute_batch_size(dataset)


def onednn_enabled():
    """Whether the loaded TensorFlow runs oneDNN kernels."""
    from tensorflow.python.util import _pywrap_util_port

    return bool(_pywrap_util_port.IsMklEnabled())


def dataset_inputs(dataset):
    """The datasets `dataset` is built from (raises for dataset kinds without inputs)."""
    return dataset._inputs()


def dataset_graph_def(dataset):
    """The serialized GraphDef (bytes) of `dataset`."""
    return dataset._as_serialized_graph().numpy()


# --- Keras: the classes tfdist patches ----------------------------------------------------------

KERAS3_SAVE_MODEL = "_save_model"  # ModelCheckpoint / BackupAndRestore method that writes files
KERAS3_CHECKPOINT_PATH = "_get_file_path"  # ModelCheckpoint: (epoch, batch, logs) -> the path it saves to
TF_KERAS_BACKUP = "_backup"  # tf-keras BackupAndRestore method that writes its checkpoint (epoch, batch)
TF_KERAS_SUPPORTED_STRATEGIES = "_supported_strategies"  # tf-keras BackupAndRestore attribute


def keras_version(flavour="keras3"):
    name = {"tf_keras": "tf_keras", "tensorflow": "tensorflow"}.get(flavour, "keras")
    try:
        return f"{name} {importlib.import_module(name).__version__}"
    except (ImportError, AttributeError):
        return f"{name} (version unknown: not importable)"


def hook_error(hook, detail, flavour="keras3", method=None):
    """`KerasHookError` naming the hook, what is wrong and its cause: Keras changed, or (when
    `method` is another library's wrapper over Keras' own) that library."""
    wrapper = wrapper_origin(method)
    cause = (f"another library wrapped it ({wrapper}) and the wrapper hides Keras' own method" if wrapper else
             f"Keras moved or changed what tfdist patches; tfdist was checked against {CHECKED_AGAINST}")
    return KerasHookError(f"tfdist cannot install its {hook!r} hook on {keras_version(flavour)}: {detail}. {cause}.")


def wrapper_origin(method):
    """Where a wrapper that is neither Keras' nor tfdist's own comes from ("module 'tracker'"), or None."""
    while method is not None and hook_of(method):  # under tfdist's own hooks
        method = getattr(method, "tfdist_original", None)
    if method is None:
        return None
    module = getattr(method, "__module__", None) or "?"
    if module.split(".")[0] not in ("keras", "tf_keras"):
        return f"a wrapper from module {module!r}"
    code = getattr(method, "__code__", None)
    if hasattr(method, "__wrapped__") and code is not None:  # functools.wraps copied Keras' names
        return f"a wrapper defined in {code.co_filename}"
    return None


def tf_keras_in_use():
    """Whether tf-keras hooks are needed: tf-keras is imported, or TF_USE_LEGACY_KERAS asks for it."""
    return "tf_keras" in sys.modules or legacy_requested()


def _import(name, hook, flavour):
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise hook_error(hook, f"import {name} failed ({e})", flavour) from e


def keras3_trainer_class(hook):
    """Keras 3's TensorFlow trainer: the base of the public `keras.Model` that runs train/test/predict steps."""
    keras = _import("keras", hook, "keras3")
    for cls in keras.Model.__mro__:
        if cls.__name__ == "TensorFlowTrainer":
            return cls
    raise hook_error(hook, "keras.Model has no TensorFlowTrainer base (is the backend TensorFlow?)")


def keras3_tf_optimizer_class(hook):
    """Keras 3's TensorFlow optimizer base (`TFOptimizer`), which all-reduces the gradients."""
    keras = _import("keras", hook, "keras3")
    for cls in keras.optimizers.Optimizer.__mro__:
        if cls.__name__ == "TFOptimizer":
            return cls
    raise hook_error(hook, "keras.optimizers.Optimizer has no TFOptimizer base (is the backend TensorFlow?)")


def model_classes(hook):
    """[(class, flavour)] whose train/test/predict methods the hooks wrap: Keras 3's trainer, and
    tf-keras' Model when tf-keras is in use."""
    classes = [(keras3_trainer_class(hook), "keras3")]
    if tf_keras_in_use():
        classes.append((tf_keras_model_class(hook), "tf_keras"))
    return classes


def keras_step_reduction_modules(hook):
    """[(module, flavour)] whose `reduce_per_replica` combines what `strategy.run(step)` returned:
    Keras 3's TensorFlow trainer, and tf-keras' training module when tf-keras is in use."""
    names = [("keras.src.backend.tensorflow.trainer", "keras3")]
    if tf_keras_in_use():
        names.append(("tf_keras.src.engine.training", "tf_keras"))
    modules = []
    for name, flavour in names:
        module = _import(name, hook, flavour)
        if not callable(getattr(module, "reduce_per_replica", None)):
            raise hook_error(hook, f"{name} has no reduce_per_replica()", flavour)
        modules.append((module, flavour))
    return modules


def tf_keras_model_class(hook):
    return _import("tf_keras", hook, "tf_keras").Model


def tf_keras_optimizer_classes(hook):
    """tf-keras' (`Optimizer`, `LossScaleOptimizerV3`): its optimizers' base and their loss-scaling wrapper."""
    module = _import("tf_keras.src.mixed_precision.loss_scale_optimizer", hook, "tf_keras")
    if not isinstance(getattr(module, "LossScaleOptimizerV3", None), type):
        raise hook_error(hook, "tf-keras has no LossScaleOptimizerV3", "tf_keras")
    return _import("tf_keras", hook, "tf_keras").optimizers.Optimizer, module.LossScaleOptimizerV3


def keras3_model_class(hook):
    """The public `keras.Model` (Keras 3), whose `save` and `save_weights` tfdist wraps."""
    return _import("keras", hook, "keras3").Model


def keras3_loss_scale_optimizer(hook):
    keras = _import("keras", hook, "keras3")
    cls = getattr(getattr(keras, "mixed_precision", None), "LossScaleOptimizer", None)
    if cls is None:
        raise hook_error(hook, "keras.mixed_precision.LossScaleOptimizer does not exist")
    return cls


def keras3_callback_classes(hook):
    """Keras 3's (ModelCheckpoint, BackupAndRestore, TensorBoard, CSVLogger)."""
    callbacks = _import("keras", hook, "keras3").callbacks
    names = ("ModelCheckpoint", "BackupAndRestore", "TensorBoard", "CSVLogger")
    missing = [n for n in names if not hasattr(callbacks, n)]
    if missing:
        raise hook_error(hook, f"keras.callbacks has no {', '.join(missing)}")
    return tuple(getattr(callbacks, n) for n in names)


def tf_keras_callback_class(name, hook):
    """tf-keras' callback class `name` ("BackupAndRestore", "ModelCheckpoint")."""
    cls = getattr(_import("tf_keras", hook, "tf_keras").callbacks, name, None)
    if cls is None:
        raise hook_error(hook, f"tf_keras.callbacks has no {name}", "tf_keras")
    return cls


def require_methods(cls, names, hook, flavour="keras3"):
    """Raise `KerasHookError` unless `cls` has every method in `names`."""
    missing = [n for n in names if not callable(getattr(cls, n, None))]
    if missing:
        raise hook_error(hook, f"{cls.__module__}.{cls.__name__} has no {', '.join(m + '()' for m in missing)}",
                         flavour)


def patch_method(cls, name, make_wrapper, hook, flavour="keras3"):
    """Replace `cls.name` by `make_wrapper(original)`, marked with the hook's name.

    Raises `KerasHookError` naming the hook and the Keras version if `cls` has no such method.
    """
    require_methods(cls, [name], hook, flavour)
    original = getattr(cls, name)
    wrapper = make_wrapper(original)
    if wrapper.__doc__ is None:
        wrapper.__doc__ = original.__doc__
    wrapper.tfdist_hook = hook
    wrapper.tfdist_original = original
    setattr(cls, name, wrapper)


def hook_of(method):
    """The name of the tfdist hook installed as `method`, or None."""
    return getattr(method, "tfdist_hook", None)


def has_hook(method, hook):
    """Whether tfdist's `hook` is `method` or a method it wraps (hooks installed over each other)."""
    while method is not None and hook_of(method) != hook:
        method = getattr(method, "tfdist_original", None)
    return method is not None


def keras3_tf_variable_class(hook):
    """Keras 3's TensorFlow `keras.Variable`; tf.train.Checkpoint calls its `_serialize_to_tensors`."""
    cls = _import("keras", hook, "keras3").Variable
    require_methods(cls, ["_serialize_to_tensors", "_restore_from_tensors"], hook)
    return cls


def merge_call(fn, strategy, *args):
    """`fn(strategy, *args)` in cross-replica context, as Keras' TF optimizer runs its updates."""
    return __import__("tensorflow").__internal__.distribute.interim.maybe_merge_call(fn, strategy, *args)


# --- Keras: private optimizer and model state -----------------------------------------------------

def optimizer_learning_rate(optimizer):
    """The learning rate as the optimizer stores it (a schedule, a variable or a float), or None."""
    return getattr(optimizer, "_learning_rate", None)


def optimizer_built(optimizer):
    """Whether the optimizer has created its slots (`built` in Keras 3, `_built` in tf-keras)."""
    return bool(getattr(optimizer, "built", False) or getattr(optimizer, "_built", False))


# --- Horovod ------------------------------------------------------------------------------------

def rendezvous_classes():
    """Horovod runner's (SlotInfo, RendezvousHandler, RendezvousHTTPServer), as horovodrun uses them."""
    from horovod.runner.common.util.hosts import SlotInfo
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

    return SlotInfo, RendezvousHandler, RendezvousHTTPServer


# --- Keras: BatchNormalization (tfdist.keras.fused_batchnorm) -------------------------------------

# What the fused path reads of a Keras 3 BatchNormalization besides its weights: constructor arguments
# (kept as same-named attributes). `renorm` (not in Keras 3.12, Python 3.10's) reads as False if absent.
KERAS3_BATCHNORM_ARGS = ("axis", "momentum", "epsilon", "center", "scale", "synchronized")


def keras3_batch_normalization(hook):
    """Keras 3's `keras.layers.BatchNormalization` on the TensorFlow backend, checked to define its
    own `call(inputs, training, mask)` and `_moments` and to take `KERAS3_BATCHNORM_ARGS`."""
    import inspect

    keras = _import("keras", hook, "keras3")
    if keras.backend.backend() != "tensorflow":
        raise hook_error(hook, f"the Keras backend is {keras.backend.backend()!r}, not 'tensorflow'")
    cls = getattr(keras.layers, "BatchNormalization", None)
    if cls is None:
        raise hook_error(hook, "keras.layers.BatchNormalization does not exist")
    require_methods(cls, ["_moments"], hook)
    call = vars(cls).get("call")
    if not callable(call):
        raise hook_error(hook, f"{cls.__module__}.{cls.__name__} does not define call() itself")
    call = getattr(call, "tfdist_original", call)  # the signature of Keras' own call
    if list(inspect.signature(call).parameters) != ["self", "inputs", "training", "mask"]:
        raise hook_error(hook, f"{cls.__name__}.call{inspect.signature(call)} is not call(self, inputs, "
                               "training=None, mask=None)")
    missing = [a for a in KERAS3_BATCHNORM_ARGS if a not in inspect.signature(cls.__init__).parameters]
    if missing:
        raise hook_error(hook, f"{cls.__name__}() takes no {', '.join(missing)} argument")
    return cls


# --- TensorFlow: saving (tfdist.keras.chief_saves) ------------------------------------------------------

def tf_saved_model_modules(hook):
    """The TensorFlow API modules through which callers reach `tf.saved_model.save` (Keras 3's
    `model.export` and tf-keras look it up on `tf.saved_model` or `tf.compat.v2.saved_model`)."""
    tf = _import("tensorflow", hook, "tensorflow")
    save = getattr(tf.saved_model, "save", None)
    if not callable(save):
        raise hook_error(hook, "tf.saved_model has no save()", "tensorflow")
    save = getattr(save, "tfdist_original", save)
    candidates = [tf.saved_model, tf.compat.v2.saved_model, tf.compat.v1.saved_model,
                  getattr(tf.compat.v1.saved_model, "experimental", None)]
    found = []
    for module in candidates:
        exported = getattr(module, "save", None)
        if getattr(exported, "tfdist_original", exported) is save and all(module is not m for m in found):
            found.append(module)
    return found


def tf_checkpoint_classes(hook):
    """(`tf.train.Checkpoint`, `tf.train.CheckpointManager`); the manager writes through the
    checkpoint's private `_write`, so it is wrapped itself."""
    tf = _import("tensorflow", hook, "tensorflow")
    return tf.train.Checkpoint, tf.train.CheckpointManager


def checkpoint_manager_settings(manager):
    """What a `tf.train.CheckpointManager` numbers and names its checkpoints by, as constructor
    arguments (for a second manager in another directory that saves the same checkpoints)."""
    return {"checkpoint_name": os.path.basename(manager._checkpoint_prefix),
            "step_counter": getattr(manager, "_step_counter", None),
            "checkpoint_interval": manager.checkpoint_interval,
            "last_checkpoint_step": getattr(manager, "_last_checkpoint_step", None)}


def set_manager_latest_checkpoint(manager, path):
    """Make `manager.latest_checkpoint` report `path` (a checkpoint another rank wrote there)."""
    manager._latest_checkpoint = path
