"""Keras callbacks for tfdist training (Keras 3, or tf-keras with TF_USE_LEGACY_KERAS=1).

```python
from tfdist.callbacks import SkippedRecordsReport
model.fit(ds, callbacks=[SkippedRecordsReport(plan.skipped)])
```
"""

from tfdist.callbacks.checkpoint import CheckpointError, Checkpointer, latest_checkpoint
from tfdist.callbacks.lr_schedule import (
    LearningRateLogger,
    LearningRateWarmup,
    WarmupSchedule,
    polynomial_decay,
    scale_learning_rate,
    step_decay,
)
from tfdist.callbacks.nonfinite import StopOnNonFiniteLoss
from tfdist.callbacks.profiling import ProfileSteps, step_marker
from tfdist.callbacks.skipped_records import SkippedRecordsReport

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "LearningRateLogger",
    "LearningRateWarmup",
    "ProfileSteps",
    "SkippedRecordsReport",
    "StopOnNonFiniteLoss",
    "WarmupSchedule",
    "latest_checkpoint",
    "polynomial_decay",
    "scale_learning_rate",
    "step_decay",
    "step_marker",
]

# Optimizer wrappers lived here until 0.1; they are optimizers, not callbacks: `tfdist.optimizers`.
_MOVED_TO_OPTIMIZERS = frozenset({"LARC", "LARS", "accumulate_gradients"})


def __getattr__(name):
    if name in _MOVED_TO_OPTIMIZERS:
        from tfdist import _moved, optimizers

        _moved.warn(f"tfdist.callbacks.{name}", f"tfdist.optimizers.{name}")
        return getattr(optimizers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
