"""tfdist's own callbacks in every `fit` of a model under a tfdist strategy.

Some of tfdist's features follow the training loop step by step: preemption stops every rank at
one agreed step and saves there (`tfdist.keras.preemption`), the hang detector knows which step
each rank is in (`tfdist.faults.hang`). They need a callback in every `fit`, also one whose code was
written for another strategy. Installed by `HorovodStrategy()`, this wraps `fit` (Keras 3 and
tf-keras) so that the registered callbacks run first (before the user's: they see the position
before any user callback acts on it) or last (after every user callback, e.g. to stop after the
user's own `on_train_batch_end`):

```python
from tfdist.keras import fit_callbacks
fit_callbacks.register("first", lambda model: MyPositionTracker())   # None: nothing for this model
```

A callback's `after_fit()`, if it has one, runs when `fit` returns or raises. Models under
other strategies are left alone. A `fit` wrapped by another library is wrapped
again on top (the callbacks are added to the `callbacks=` argument, by name or by position).
"""

import functools
import inspect

from tfdist import _compat
from tfdist.keras import recognise, sharded_optimizer

HOOK = "tfdist fit callbacks"

_factories = {"first": [], "last": []}
_installed = set()


def register(where, factory):
    """Add `factory(model)` (a callback or None) to every tfdist `fit`, `where` "first" or "last"."""
    if where not in _factories:
        raise ValueError(f"where={where!r}: expected 'first' or 'last'")
    if factory not in _factories[where]:
        _factories[where].append(factory)


def install():
    """Wrap `fit` of Keras 3 and (if used) tf-keras models; `KerasHookError` if Keras moved it."""
    for model_class, flavour in _compat.model_classes(HOOK):
        _patch(model_class, flavour)


def _patch(model_class, flavour):
    if model_class in _installed:
        return
    _compat.patch_method(model_class, "fit", _with_tfdist_callbacks, HOOK, flavour)
    _installed.add(model_class)


def callbacks_for(model, given):
    """(`given` with this model's tfdist callbacks added, those added). `given`: None or a list; a
    CallbackList made by the caller is used as it is."""
    first = [c for c in (f(model) for f in _factories["first"]) if c is not None]
    last = [c for c in (f(model) for f in _factories["last"]) if c is not None]
    if not first and not last or not (given is None or isinstance(given, (list, tuple))):
        return given, []
    every = first + list(given or []) + last
    for callback in first + last:
        if hasattr(callback, "fit_callbacks"):
            callback.fit_callbacks = every  # those that act on the others (preemption saves) see them
    return every, first + last


def _with_tfdist_callbacks(method):
    try:
        position = list(inspect.signature(method).parameters).index("callbacks")
    except (TypeError, ValueError):
        position = None  # a wrapper that hides the signature: `callbacks=` by name only

    @functools.wraps(method)
    def fit(self, *args, **kwargs):
        if not recognise.is_tfdist_strategy(getattr(self, "distribute_strategy", None)):
            return method(self, *args, **kwargs)
        sharded_optimizer.check_before_fit(self)  # shard_optimizer_state: an optimizer it cannot shard
        if "callbacks" in kwargs or position is None or len(args) < position:
            kwargs["callbacks"], added = callbacks_for(self, kwargs.get("callbacks"))
        else:
            args = list(args)
            args[position - 1], added = callbacks_for(self, args[position - 1])
        try:
            return method(self, *args, **kwargs)
        finally:  # also when fit raised, and on_train_end never ran (signal handlers given back)
            for callback in added:
                if callable(getattr(callback, "after_fit", None)):
                    callback.after_fit()

    return fit
