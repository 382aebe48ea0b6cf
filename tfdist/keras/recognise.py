"""How the Keras hooks recognise tfdist's strategy without importing `tfdist.strategy`.

`HorovodStrategy` registers its class here when it is defined; the hooks ask `multi_rank_strategy_of`
before acting differently from Keras, and `non_chief_rank` before redirecting a rank's writes.

```python
from tfdist.keras import recognise
strategy = recognise.multi_rank_strategy_of(model)   # None: Keras' own behaviour applies
```
"""

from __future__ import annotations

import tempfile
from typing import Any

from tfdist import collectives

_STRATEGY_CLASSES: list[type] = []
_scratch: dict[str, str] = {}


def register(strategy_class: type) -> type:
    """Mark `strategy_class` as tfdist's (a class decorator; `HorovodStrategy` uses it).

    Args:
        strategy_class: a `tf.distribute.Strategy` subclass whose instances span Horovod's ranks.

    Returns:
        The class, unchanged.
    """
    if strategy_class not in _STRATEGY_CLASSES:
        _STRATEGY_CLASSES.append(strategy_class)
    return strategy_class


def strategy_classes() -> tuple[type, ...]:
    """The registered strategy classes (for Keras code that keeps a list of supported strategies)."""
    return tuple(_STRATEGY_CLASSES)


def is_tfdist_strategy(strategy: Any) -> bool:
    """Whether `strategy` is an instance of a registered tfdist strategy class.

    Args:
        strategy: any object, usually `tf.distribute.get_strategy()` or `model.distribute_strategy`.
    """
    return bool(_STRATEGY_CLASSES) and isinstance(strategy, tuple(_STRATEGY_CLASSES))


def multi_rank_strategy_of(model: Any) -> Any:
    """The tfdist strategy `model` trains under when it spans more than one rank, else None.

    Args:
        model: a Keras model (any object with a `distribute_strategy` attribute).
    """
    strategy = getattr(model, "distribute_strategy", None)
    if is_tfdist_strategy(strategy) and collectives.size() > 1:
        return strategy
    return None


def non_chief_rank(model: Any) -> int | None:
    """This rank's number if `model` trains under a multi-rank tfdist strategy and it is not the chief.

    Args:
        model: a Keras model.
    """
    if multi_rank_strategy_of(model) is not None and collectives.rank() != 0:
        return collectives.rank()
    return None


def scratch_dir() -> str:
    """A private directory of this process, for files nobody will read."""
    if "dir" not in _scratch:
        _scratch["dir"] = tempfile.mkdtemp(prefix=f"tfdist-rank{collectives.rank()}-")
    return _scratch["dir"]
