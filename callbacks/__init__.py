"""Keras callbacks for tfdist training (Keras 3, or tf-keras with TF_USE_LEGACY_KERAS=1).

```python
from tfdist.callbacks import SkippedRecordsReport
model.fit(ds, callbacks=[SkippedRecordsReport(plan.skipped)])
```
"""

from tfdist.optimizers.accumulation import accumulate_gradients
from tfdist.callbacks.checkpoint import CheckpointError, Checkpointer, latest_checkpoint
from tfdist.optimizers.lars import LARC, LARS
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
    "step_marker",
]
