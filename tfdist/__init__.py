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
    HorovodNotAvailableError,
    NonFiniteLossError,
    RankMismatchError,
    TfdistError,
    WatchdogError,
    XlaNotSupportedError,
)
from tfdist.launch import LaunchError


def __getattr__(name):
    # HorovodStrategy imports TensorFlow (seconds); `tfdist-run` and the error classes must not wait for it.
    if name == "HorovodStrategy":
        from tfdist.strategy import HorovodStrategy

        return HorovodStrategy
    raise AttributeError(f"module 'tfdist' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "HorovodStrategy",
    "HorovodNotAvailableError",
    "LaunchError",
    "NonFiniteLossError",
    "RankMismatchError",
    "TfdistError",
    "WatchdogError",
    "XlaNotSupportedError",
]
