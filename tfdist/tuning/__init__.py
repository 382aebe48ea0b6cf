"""Per-rank CPU/GPU tuning: the plan, its application before TensorFlow loads, and `tfdist-tune`.

`environment` (what the launcher and node say, without TensorFlow), `plan` (cores, threads,
oneDNN, pinning and GPU for this rank, and what TensorFlow reports in effect), `horovod_env`
(Horovod's cycle and Open MPI's waiting, before `hvd.init()`), `startup` (the plan
applied before TensorFlow loads: `import tfdist`, `python -m tfdist --`), `tuner` (`tfdist-tune`),
`cache` (its choices per machine). Importing this package loads neither TensorFlow nor a submodule.

```python
from tfdist import tuning
topology = tuning.detect_topology(local_rank=0, local_size=2)
print(tuning.make_plan(topology).as_dict())
```
"""

import importlib

_PLAN_EXPORTS = frozenset({
    "LATE_FIX", "Plan", "Topology", "announce", "apply", "describe", "detect_topology", "in_effect", "make_plan",
    "onednn_active", "plan_for_rank", "tune_this_rank",
})
_HOROVOD_ENV_EXPORTS = frozenset({
    "CPU_CYCLE_TIME_MS", "OPEN_MPI_YIELD", "horovod_defaults", "set_horovod_defaults", "set_horovod_knobs",
})
_SUBMODULES = frozenset({"cache", "environment", "horovod_env", "plan", "startup", "tuner"})


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _PLAN_EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.plan"), name)
    if name in _HOROVOD_ENV_EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.horovod_env"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_PLAN_EXPORTS | _HOROVOD_ENV_EXPORTS)
