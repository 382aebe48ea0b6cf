"""tfdist's Keras hooks (tfdist/_compat.py): each is in place after `HorovodStrategy()`, on Keras 3
and on tf-keras, and a hook whose target moved makes `HorovodStrategy()` raise, naming it.

Single process, no horovodrun. Each case runs in a fresh interpreter: Keras picks its flavour at
import time, and a broken or installed hook cannot be undone in this one.
"""

import json

import pytest

from conftest import flavor_env, python_results

METRICS, PREDICT, CALLBACKS, PRECISION, QUIET = (
    "global metrics", "predict gathers rows", "chief-only callback writes", "rank-consistent loss scaling",
    "chief-only progress bars")
GRADIENT_SUM = "gradient-sum marker"
PREEMPTION, FIT_CALLBACKS = "preemption checkpoints", "tfdist fit callbacks"
MODEL_BUILD = "model build without reading the dataset"
ADOPT = "a model built outside the scope adopts the strategy of its data"

# Run in the child: BREAK (may be empty), then HorovodStrategy(); prints one JSON line.
CHILD = """
import json, sys
import keras
{setup}
import tfdist
from tfdist import _compat
from tfdist.keras.flavour import keras_module
try:
    tfdist.HorovodStrategy(tuning=False, watchdog=False, check_consistency=False{args})
except tfdist.TfdistError as e:
    print("RESULT " + json.dumps({{"error": type(e).__name__, "message": str(e)}}))
    sys.exit(0)
trainer = _compat.keras3_trainer_class("test")
hooks = {{
    "keras3.get_metrics_result": trainer.get_metrics_result,
    "keras3.test_step": trainer.test_step,
    "keras3.predict_step": trainer.predict_step,
    "keras3._maybe_symbolic_build": trainer._maybe_symbolic_build,
    "keras3.ModelCheckpoint._save_model": keras.callbacks.ModelCheckpoint._save_model,
    "keras3.BackupAndRestore._save_model": keras.callbacks.BackupAndRestore._save_model,
    "keras3.BackupAndRestore.on_train_end": keras.callbacks.BackupAndRestore.on_train_end,
    "keras3.TensorBoard.set_model": keras.callbacks.TensorBoard.set_model,
    "keras3.CSVLogger.on_train_begin": keras.callbacks.CSVLogger.on_train_begin,
    "keras3.LossScaleOptimizer.check_finite": keras.mixed_precision.LossScaleOptimizer.check_finite,
    "keras3.LossScaleOptimizer._tf_apply": keras.mixed_precision.LossScaleOptimizer._tf_apply,
    "keras3.TFOptimizer._all_reduce_sum_gradients": _compat.keras3_tf_optimizer_class("test")._all_reduce_sum_gradients,
    "keras3.TFOptimizer._clip_gradients": _compat.keras3_tf_optimizer_class("test")._clip_gradients,
    "keras3.fit": keras.Model.fit, "keras3.evaluate": keras.Model.evaluate, "keras3.predict": keras.Model.predict,
    "keras3.evaluate, under the adoption hook": getattr(keras.Model.evaluate, "tfdist_original", None),
    "keras3.predict, under the adoption hook": getattr(keras.Model.predict, "tfdist_original", None),
    "keras3.fit, under the adoption hook": getattr(keras.Model.fit, "tfdist_original", None),
    "keras3.fit, under the progress hook": getattr(getattr(keras.Model.fit, "tfdist_original", None),
                                                   "tfdist_original", None),
}}
optimizer = _compat.keras3_tf_optimizer_class("test")
for name in ("build", "add_variable_from_reference", "_var_key", "_backend_update_step", "save_own_variables",
             "load_own_variables"):
    hooks["keras3.TFOptimizer." + name] = getattr(optimizer, name)
hooks["keras3.TFOptimizer._clip_gradients, under the sharded hook"] = getattr(
    optimizer._clip_gradients, "tfdist_original", None)
hooks["keras3.Variable._serialize_to_tensors"] = keras.Variable._serialize_to_tensors
if _compat.tf_keras_in_use():
    import tf_keras
    hooks.update({{
        "tf_keras.get_metrics_result": tf_keras.Model.get_metrics_result,
        "tf_keras.test_step": tf_keras.Model.test_step,
        "tf_keras.predict_step": tf_keras.Model.predict_step,
        "tf_keras.BackupAndRestore.on_train_begin": tf_keras.callbacks.BackupAndRestore.on_train_begin,
        "tf_keras.CSVLogger.on_train_begin": tf_keras.callbacks.CSVLogger.on_train_begin,
        "tf_keras.fit": tf_keras.Model.fit, "tf_keras.evaluate": tf_keras.Model.evaluate,
        "tf_keras.predict": tf_keras.Model.predict,
        "tf_keras.fit, under the progress hook": getattr(tf_keras.Model.fit, "tfdist_original", None),
        "tf_keras.BackupAndRestore._backup": tf_keras.callbacks.BackupAndRestore._backup,
    }})
    tf_keras_optimizer, tf_keras_loss_scaled = _compat.tf_keras_optimizer_classes("test")
    for name in ("build", "add_variable_from_reference", "_var_key", "apply_gradients", "_clip_gradients",
                 "_internal_apply_gradients", "save_own_variables", "load_own_variables"):
        hooks["tf_keras.Optimizer." + name] = getattr(tf_keras_optimizer, name)
    hooks["tf_keras.LossScaleOptimizerV3.apply_gradients"] = tf_keras_loss_scaled.apply_gradients
print("RESULT " + json.dumps({{"hooks": {{k: _compat.hook_of(v) for k, v in hooks.items()}},
                                "keras_module": keras_module().__name__}}))
"""


def run_child(setup="", flavor="keras3", args=""):
    return json.loads(python_results(CHILD.format(setup=setup, args=args), env=flavor_env(flavor))[-1])


KERAS3_HOOKS = {
    "keras3.get_metrics_result": METRICS,
    "keras3.test_step": METRICS,
    "keras3.predict_step": PREDICT,
    "keras3._maybe_symbolic_build": MODEL_BUILD,
    "keras3.ModelCheckpoint._save_model": CALLBACKS,  # its folder made race-free; saves follow chief_saves
    "keras3.BackupAndRestore._save_model": PREEMPTION,  # over the chief-only write
    "keras3.BackupAndRestore.on_train_end": CALLBACKS,
    "keras3.TensorBoard.set_model": CALLBACKS,
    "keras3.CSVLogger.on_train_begin": CALLBACKS,
    "keras3.LossScaleOptimizer.check_finite": PRECISION,
    "keras3.LossScaleOptimizer._tf_apply": PRECISION,
    "keras3.TFOptimizer._all_reduce_sum_gradients": GRADIENT_SUM,
    "keras3.TFOptimizer._clip_gradients": "clipping after the gradient sum",
    "keras3.fit": ADOPT, "keras3.evaluate": ADOPT, "keras3.predict": ADOPT,
    "keras3.fit, under the adoption hook": QUIET, "keras3.evaluate, under the adoption hook": QUIET,
    "keras3.predict, under the adoption hook": QUIET,
    "keras3.fit, under the progress hook": FIT_CALLBACKS,
    **{f"keras3.TFOptimizer.{name}": None for name in (
        "build", "add_variable_from_reference", "_var_key", "_backend_update_step", "save_own_variables",
        "load_own_variables")},
    "keras3.TFOptimizer._clip_gradients, under the sharded hook": None,
    "keras3.Variable._serialize_to_tensors": None,
}
SHARDED = "sharded optimizer state"
KERAS3_SHARDED_HOOKS = {
    **KERAS3_HOOKS,
    **{f"keras3.TFOptimizer.{name}": SHARDED for name in (
        "build", "add_variable_from_reference", "_var_key", "_backend_update_step", "save_own_variables",
        "load_own_variables")},
    "keras3.TFOptimizer._clip_gradients": SHARDED,
    "keras3.TFOptimizer._clip_gradients, under the sharded hook": "clipping after the gradient sum",
    "keras3.Variable._serialize_to_tensors": SHARDED,
}
TF_KERAS_HOOKS = {
    "tf_keras.get_metrics_result": METRICS,
    "tf_keras.test_step": METRICS,
    "tf_keras.predict_step": PREDICT,
    "tf_keras.BackupAndRestore.on_train_begin": CALLBACKS,
    "tf_keras.CSVLogger.on_train_begin": CALLBACKS,
    "tf_keras.fit": QUIET, "tf_keras.evaluate": QUIET, "tf_keras.predict": QUIET,
    "tf_keras.fit, under the progress hook": FIT_CALLBACKS,
    "tf_keras.BackupAndRestore._backup": PREEMPTION,
    **{f"tf_keras.Optimizer.{name}": None for name in (
        "build", "add_variable_from_reference", "_var_key", "apply_gradients", "_clip_gradients",
        "_internal_apply_gradients", "save_own_variables", "load_own_variables")},
    "tf_keras.LossScaleOptimizerV3.apply_gradients": None,
}


def test_hooks_in_place_on_keras3():
    result = run_child()
    assert result["hooks"] == KERAS3_HOOKS


def test_sharded_state_hooks_in_place_on_keras3():
    result = run_child(args=", shard_optimizer_state=True")
    assert result["hooks"] == KERAS3_SHARDED_HOOKS


def test_sharded_state_hooks_in_place_on_tf_keras():
    result = run_child(flavor="tf_keras", args=", shard_optimizer_state=True")
    sharded = {name: SHARDED for name in TF_KERAS_HOOKS if name.startswith(("tf_keras.Optimizer.",
                                                                             "tf_keras.LossScaleOptimizerV3"))}
    assert result["hooks"] == {**KERAS3_SHARDED_HOOKS, "keras3.TFOptimizer._all_reduce_sum_gradients": None,
                               "keras3.TFOptimizer._clip_gradients": SHARDED,
                               "keras3.TFOptimizer._clip_gradients, under the sharded hook": None,
                               **TF_KERAS_HOOKS, **sharded}


def test_hooks_in_place_on_tf_keras():
    result = run_child(flavor="tf_keras")
    assert result["keras_module"] == "tf_keras"
    # tf-keras' gradient sum is recognised by its variable destinations: no marker on Keras 3's
    assert result["hooks"] == {**KERAS3_HOOKS, "keras3.TFOptimizer._all_reduce_sum_gradients": None,
                               "keras3.TFOptimizer._clip_gradients": None, **TF_KERAS_HOOKS}


# (case, flavour, setup code that breaks a hook's target, the hook named, the Keras named)
BROKEN = [
    ("metrics method gone", "keras3",
     "from keras.src.trainers.trainer import Trainer\ndel Trainer.get_metrics_result", METRICS, "keras "),
    ("trainer class not found", "keras3",
     "from keras.src.backend.tensorflow.trainer import TensorFlowTrainer\n"
     "TensorFlowTrainer.__name__ = 'RenamedTrainer'", METRICS, "keras "),
    ("predict_step gone", "keras3",
     "from keras.src.backend.tensorflow.trainer import TensorFlowTrainer\ndel TensorFlowTrainer.predict_step",
     PREDICT, "keras "),
    ("_maybe_symbolic_build gone", "keras3",
     "from keras.src.backend.tensorflow.trainer import TensorFlowTrainer\ndel TensorFlowTrainer._maybe_symbolic_build",
     MODEL_BUILD, "keras "),
    ("LossScaleOptimizer gone", "keras3",
     "del keras.mixed_precision.LossScaleOptimizer", PRECISION, "keras "),
    ("check_finite gone", "keras3",
     "del keras.mixed_precision.LossScaleOptimizer.check_finite", PRECISION, "keras "),
    ("_tf_apply gone", "keras3",
     "del keras.mixed_precision.LossScaleOptimizer._tf_apply", PRECISION, "keras "),
    ("gradient all-reduce gone", "keras3",
     "from keras.src.backend.tensorflow.optimizer import TFOptimizer\n"
     "del TFOptimizer._all_reduce_sum_gradients", GRADIENT_SUM, "keras "),
    ("tf_keras import fails", "tf_keras",  # after Horovod's own import of it
     "import horovod.tensorflow\nsys.modules['tf_keras'] = None  # `import tf_keras` raises ImportError",
     METRICS, "tf_keras "),
    ("tf_keras predict_step gone", "tf_keras",
     "import tf_keras\ndel tf_keras.Model.predict_step", PREDICT, "tf_keras 2."),
    ("tf_keras BackupAndRestore._backup gone", "tf_keras",
     "import tf_keras\ndel tf_keras.callbacks.BackupAndRestore._backup", PREEMPTION, "tf_keras 2."),
]


def test_a_sharded_state_hook_whose_target_moved_raises_naming_it():
    result = run_child("from keras.src.backend.tensorflow.optimizer import TFOptimizer\n"
                       "TFOptimizer._backend_update_step = None", args=", shard_optimizer_state=True")
    assert result.get("error") == "KerasHookError", result
    assert repr(SHARDED) in result["message"] and "_backend_update_step" in result["message"], result


@pytest.mark.parametrize("case,flavor,setup,hook,keras_name", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_hook_target_raises_naming_it(case, flavor, setup, hook, keras_name):
    result = run_child(setup, flavor)
    assert result.get("error") == "KerasHookError", result
    message = result["message"]
    assert repr(hook) in message, message
    assert keras_name in message and "checked against" in message, message


def test_keras_hook_error_is_exported():
    import tfdist

    assert issubclass(tfdist.KerasHookError, tfdist.TfdistError)


# Another library (an experiment tracker) wraps the `fit` tfdist wraps, before HorovodStrategy().
WRAPPED = '''
import functools, json, logging, types
import numpy as np
from tfdist import _compat
from tfdist.keras.flavour import keras_module
keras = keras_module()
cls = _compat.model_classes("test")[-1][0]  # the class whose fit tfdist wraps, for this flavour
tracker = types.ModuleType("tracker")
exec("""import functools
def wrap(original, keep):
    def fit(self, *args, **kwargs):
        return original(self, *args, **kwargs)
    return functools.wraps(original)(fit) if keep else fit""", tracker.__dict__)
cls.fit = tracker.wrap(cls.fit, {keep})
messages = []
handler = logging.Handler()
handler.emit = lambda record: messages.append(record.getMessage())
logging.getLogger("tfdist").addHandler(handler)
import tfdist
strategy = tfdist.HorovodStrategy(tuning=False, watchdog=False, check_consistency=False)
x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.1), "mse")
losses = model.fit(x, x[:, :1], batch_size=16, epochs=3, verbose=0).history["loss"]
print("RESULT " + json.dumps({{"warnings": [m for m in messages if "hook" in m], "losses": losses,
                              "hook": _compat.hook_of(cls.fit)}}))
'''


@pytest.mark.parametrize("flavor", ["keras3", "tf_keras"])
@pytest.mark.parametrize("keep", [False, True], ids=["hides the signature", "functools.wraps"])
def test_a_wrapper_of_fit_from_another_library_never_stops_training(flavor, keep):
    result = json.loads(python_results(WRAPPED.format(keep=keep), env=flavor_env(flavor))[-1])
    losses = result["losses"]
    assert len(losses) == 3 and losses[-1] < losses[0], result  # it trained
    if keep:  # the wrapper keeps Keras' signature: every hook is in place, nothing to say
        assert result["warnings"] == [] and result["hook"] == QUIET, result
    else:  # only the progress-bar hook cannot go in: one warning naming it and the wrapper's module
        assert len(result["warnings"]) == 1, result
        warning = result["warnings"][0]
        assert QUIET in warning and "a wrapper from module 'tracker'" in warning, warning
        assert "training is not affected" in warning, warning
