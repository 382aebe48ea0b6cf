"""tfdist: Horovod data-parallel training for modern Keras (Keras 3 and tf-keras).

```python
import tfdist
strategy = tfdist.HorovodStrategy()
with strategy.scope():
    model = build_and_compile_model()
model.fit(dataset)
```
"""

from tfdist.errors import (
    GPUNotFoundError,
    HorovodNotAvailableError,
    KerasHookError,
    LaunchError,
    NonFiniteLossError,
    PreemptionError,
    RankMismatchError,
    SaveSyncError,
    ShardedStateError,
    TfdistError,
    WatchdogError,
    XlaNotSupportedError,
)
from tfdist import _moved
from tfdist._version import __version__

_moved.install()

# Settings TensorFlow reads when it loads (oneDNN, thread pools, core pinning) only count if set
# before it loads: importing tfdist first applies this rank's (`tfdist.tuning.startup`; TFDIST_TUNING=0: off).
import sys as _sys

from tfdist.launch import tf_config as _tf_config

_tf_config.export_early()  # under a launcher: TF_CONFIG for code that reads it (the ranks as workers)

if "tensorflow" not in _sys.modules:
    from tfdist.tuning import startup as _startup

    _startup.apply_early("import tfdist")


# Submodules reachable as attributes (`tfdist.precision`, `tfdist.pipelines`, ...), imported on
# first use: most import TensorFlow (seconds), which `tfdist-run` and the error classes must not wait for.
_SUBMODULES = frozenset({
    "benchmark", "callbacks", "cluster_resolver", "collectives", "exchange", "faults", "horovod_build",
    "input_contract", "keras", "launch", "optimizers", "pipelines", "precision", "rank_variables", "strategy",
    "strategy_options", "tuning", "units",
})


def __getattr__(name):
    if name == "HorovodStrategy":
        from tfdist.strategy import HorovodStrategy

        return HorovodStrategy
    if name in _SUBMODULES or f"tfdist.{name}" in _moved.MOVED:
        import importlib

        return importlib.import_module(f"tfdist.{name}")
    raise AttributeError(f"module 'tfdist' has no attribute {name!r}")


__all__ = [
    "HorovodStrategy",
    "GPUNotFoundError",
    "HorovodNotAvailableError",
    "KerasHookError",
    "LaunchError",
    "NonFiniteLossError",
    "PreemptionError",
    "RankMismatchError",
    "SaveSyncError",
    "ShardedStateError",
    "TfdistError",
    "WatchdogError",
    "XlaNotSupportedError",
]
