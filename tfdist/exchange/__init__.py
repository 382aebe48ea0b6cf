"""The gradient exchange: when gradients are summed across ranks, and how they are compressed.

`gradients`: the schedule (each gradient as it is ready, buckets, one collective) and recognising
the optimizer's gradient sum; `compression`: PowerSGD and top-k with error feedback;
`compression_plan`: their rules in pure Python, shared with `tfdist-predict`; `casts`: fp16 and
bf16, gradients cast to 16 bits for the allreduce.

```python
import tfdist
from tfdist.exchange import PowerSGD
strategy = tfdist.HorovodStrategy(compression=PowerSGD(rank=4))
```
"""

import importlib

_EXPORTS = {"Compressor": "compression", "PowerSGD": "compression", "TopK": "compression"}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
