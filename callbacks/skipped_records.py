"""Report, every epoch, the records a `skip_corrupt` pipeline dropped, per shard file.

```python
ds, plan = pipelines.read_dataset(path, 32, training=True, skip_corrupt=True)
model.fit(ds, steps_per_epoch=plan.steps_per_epoch, callbacks=[SkippedRecordsReport(plan.skipped)])
```

The counts are those of one epoch (never summed over epochs): in training, the records the
counting pass found bad, which every epoch drops; in evaluation mode, what the pass dropped.
They cover this rank's part of the data (its `plan.skipped`): with one pipeline per rank, the
ranks' counts add up to the job's.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from tfdist.callbacks._keras import Callback

if TYPE_CHECKING:
    from tfdist.pipelines.records import SkippedRecords

log = logging.getLogger("tfdist.pipelines")


class SkippedRecordsReport(Callback):
    """Logs the per-shard skip counts at each epoch end, adds `skipped_records` to the logs, resets.

    `skipped_records` is this rank's count for the epoch (no collective: it may run on some
    ranks only).

    Args:
        skipped: the plan's counts: `read_dataset(..., skip_corrupt=True)`'s `plan.skipped`.
        rank: labels the log lines ("rank R: ..."); None: no label.

    Example:
        ```python
        from tfdist.callbacks import SkippedRecordsReport
        from tfdist.pipelines import read_dataset
        ds, plan = read_dataset("/scratch/ds", 32, training=True, skip_corrupt=True)
        model.fit(ds, steps_per_epoch=plan.steps_per_epoch, callbacks=[SkippedRecordsReport(plan.skipped)])
        ```
    """

    def __init__(self, skipped: SkippedRecords, rank: int | None = None):
        super().__init__()
        self.skipped = skipped
        self.rank = rank

    def on_epoch_end(self, epoch, logs=None):
        counts = self.skipped.report()
        who = f"rank {self.rank}: " if self.rank is not None else ""
        for path, n in sorted(counts.items()):
            log.warning("%sepoch %d: skipped %d corrupt record(s) in %s", who, epoch + 1, n, path)
        if logs is not None:
            logs["skipped_records"] = sum(counts.values())
        self.skipped.reset()
