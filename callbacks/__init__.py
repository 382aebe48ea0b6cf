"""Keras callbacks for tfdist training (Keras 3, or tf-keras with TF_USE_LEGACY_KERAS=1).

```python
from callbacks import SkippedRecordsReport
model.fit(ds, callbacks=[SkippedRecordsReport(plan.skipped)])
```
"""

from callbacks.accumulation import accumulate_gradients
from callbacks.checkpoint import CheckpointError, Checkpointer, latest_checkpoint
from callbacks.lars import LARC, LARS
from callbacks.lr_schedule import (
    LearningRateLogger,
    LearningRateWarmup,
    WarmupSchedule,
    polynomial_decay,
    scale_learning_rate,
    step_decay,
)
from callbacks.nonfinite import StopOnNonFiniteLoss
from callbacks.profiling import ProfileSteps
from callbacks.skipped_records import SkippedRecordsReport

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "LARC",
    "LARS",
    "LearningRateLogger",
    "LearningRateWarmup",
    "ProfileSteps",
    "SkippedRecordsReport",
    "StopOnNonFiniteLoss",
    "WarmupSchedule",
    "accumulate_gradients",
    "latest_checkpoint",
    "polynomial_decay",
    "scale_learning_rate",
    "step_decay",
]
