"""A Keras 3 model built outside `strategy.scope()` trains under the strategy whose data it is given.

Keras 3 takes a model's strategy from the scope it was built in, else from the scope each call
runs in. A model built and compiled outside `HorovodStrategy().scope()`, then given the
strategy's `distribute_datasets_from_function(...)` or `experimental_distribute_dataset(...)`, would
run under TensorFlow's default strategy, which cannot take the dataset's per-replica values
(Keras: "Only input tensors may be passed as positional arguments ... PerReplica"). The same model
fitted inside `with strategy.scope():` would run each rank from its own random initial weights.
A one-device `MirroredStrategy` takes both, because it is one process; Keras' own
`tf_dataset_adapter_test` fits a model that way.

Installed by `HorovodStrategy()`: the first `fit`, `evaluate` or `predict` of such a model adopts
the strategy, as if the model had been built in its scope. Every variable it already has (its
weights, and its optimizer's if built) takes rank 0's value, which is what building in the scope
does, and the step functions Keras traced before are traced again. From there the model trains
with the strategy's exchange, and its results equal one process's from rank 0's initial weights:

```python
strategy = tfdist.HorovodStrategy()
dataset = strategy.distribute_datasets_from_function(dataset_fn)
model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(2)])   # outside the scope
model.compile(optimizer="adam", loss="mse")
model.fit(dataset)     # runs under `strategy`, from rank 0's weights on every rank
```

Models given other data outside any tfdist scope, tf-keras models, and models built in a scope
are untouched.
"""

import functools
import logging

from tfdist import _compat, _compat_state, collectives
from tfdist.keras import recognise

log = logging.getLogger("tfdist")

HOOK = "a model built outside the scope adopts the strategy of its data"
METHODS = ("fit", "evaluate", "predict")
_installed = set()


def install():
    """Wrap Keras 3's `Model.fit`, `evaluate` and `predict` once; `KerasHookError` if Keras moved them."""
    model_class = _compat.keras3_model_class(HOOK)
    if model_class in _installed:
        return
    _compat.require_methods(model_class, METHODS, HOOK)
    for name in METHODS:
        _compat.patch_method(model_class, name, _adopting, HOOK)
    _installed.add(model_class)


def strategy_to_adopt(model, data):
    """The tfdist strategy `model` should adopt before running on `data`, or None.

    That is the strategy that distributed `data`, else the tfdist strategy in scope at the call,
    for a Keras 3 model built outside every strategy's scope."""
    import tensorflow as tf

    if not _compat_state.keras3_model_strategy_unset(model):
        return None
    strategy = _compat_state.distributed_dataset_strategy(data)
    if strategy is None and tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
    return strategy if recognise.is_tfdist_strategy(strategy) else None


def adopt(model, strategy):
    """Run `model` under `strategy` from now on, its variables created again in the strategy's
    scope, which starts each from rank 0's value."""
    variables = _compat_state.keras3_tracked_variables(model)
    with strategy.scope():
        for variable in variables:
            _compat_state.recreate_keras3_variable(variable)
    _compat_state.set_keras3_model_strategy(model, strategy)
    if collectives.rank() == 0:
        log.info("tfdist: model %r was built outside strategy.scope(); it runs under HorovodStrategy from "
                 "here on, every rank from rank 0's values of its %d variables (build it in "
                 "`with strategy.scope():` to start that way).",
                 getattr(model, "name", type(model).__name__), len(variables))


def _adopting(method):
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        strategy = strategy_to_adopt(self, args[0] if args else kwargs.get("x"))
        if strategy is not None:
            adopt(self, strategy)
        return method(self, *args, **kwargs)

    return run
