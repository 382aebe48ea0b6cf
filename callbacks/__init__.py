"""Keras callbacks for tfdist training (Keras 3, or tf-keras with TF_USE_LEGACY_KERAS=1).

```python
from callbacks import SkippedRecordsReport
model.fit(ds, callbacks=[SkippedRecordsReport(plan.skipped)])
```
"""

from callbacks.accumulation import accumulate_gradients
from callbacks.lars import LARC, LARS
from callbacks.lr_schedule import (
    LearningRateLogger,
    LearningRateWarmup,
    WarmupSchedule,
    polynomial_decay,
    scale_learning_rate,
    step_decay,
)
from callbacks.profiling import ProfileSteps
from callbacks.skipped_records import SkippedRecordsReport

__all__ = [
    "LARC",
    "LARS",
    "LearningRateLogger",
    "LearningRateWarmup",
    "ProfileSteps",
    "SkippedRecordsReport",
    "WarmupSchedule",
    "accumulate_gradients",
    "polynomial_decay",
    "scale_learning_rate",
    "step_decay",
]
