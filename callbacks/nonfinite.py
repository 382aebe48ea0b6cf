"""Stop every rank at the first step whose loss is NaN or infinite, naming the step and the rank(s).

```python
from tfdist.callbacks import StopOnNonFiniteLoss
stop = StopOnNonFiniteLoss(action="stop")          # or "raise": NonFiniteLossError on every rank
model.fit(ds, epochs=3, callbacks=[stop])
if stop.report:                                    # {"epoch", "batch", "step", "loss", "ranks", ...}
    print(stop.message)   # non-finite loss (nan) at epoch 1, batch 5 (step 5): local loss non-finite on rank 1
```
"""

from __future__ import annotations

import logging
import math

import numpy as np
import tensorflow as tf

from tfdist.callbacks._keras import Callback
from tfdist import collectives, rank_variables
from tfdist.errors import NonFiniteLossError

log = logging.getLogger("tfdist")

ACTIONS = ("stop", "raise")


class StopOnNonFiniteLoss(Callback):
    """Ends training on all ranks at the first non-finite loss and says which rank(s) produced it.

    Keras' `TerminateOnNaN` looks only at the loss in the logs. Under `HorovodStrategy` that loss
    is global, so every rank does stop, but nobody learns which rank's data or computation went
    bad; with per-rank (local) logs, as in plain Horovod, it would stop only the rank that saw
    the NaN and leave the others waiting in the next allreduce. This callback relies on the loss
    being global, so every rank sees the non-finite value at the same step. At that step only,
    every rank joins one small allgather of "was my own running loss non-finite", and the report
    names the ranks. Training steps are not slowed: nothing extra runs while the loss is finite.

    The step is counted from the start of this `fit()` call (0-based); `batch` is Keras' index
    within the epoch. It works on one process too (the rank is then 0).

    Args:
        action: "stop" ends `fit()` normally after the step (`model.stop_training`), with the
            report in `self.report` / `self.message` and logged as a warning on the chief;
            "raise" raises `tfdist.NonFiniteLossError` with the message on every rank.

    Raises:
        ValueError: `action` is neither (on construction); on several ranks, the model was not
            built under `tfdist.HorovodStrategy` (when training begins).
        NonFiniteLossError: with `action="raise"`, from `fit` at the first non-finite loss.

    Example:
        ```python
        from tfdist.callbacks import StopOnNonFiniteLoss
        stop = StopOnNonFiniteLoss(action="stop")
        model.fit(ds, epochs=3, callbacks=[stop])
        if stop.report:                # {"epoch", "batch", "step", "loss", "ranks", "local_losses"}
            print(stop.message)
        ```
    """

    def __init__(self, action: str = "stop"):
        super().__init__()
        if action not in ACTIONS:
            raise ValueError(f"action={action!r}: expected one of {ACTIONS}")
        self.action = action
        self.report = None
        self.message = None
        self._step = 0
        self._epoch = 0

    def on_train_begin(self, logs=None):
        self.report, self.message, self._step = None, None, 0
        if collectives.process_size() > 1:
            from tfdist.strategy import HorovodStrategy

            if not isinstance(getattr(self.model, "distribute_strategy", None), HorovodStrategy):
                raise ValueError(
                    "StopOnNonFiniteLoss on several ranks needs the model built under "
                    "tfdist.HorovodStrategy (its logged loss is global, so all ranks stop at "
                    "the same step); this model's logs are local to each rank."
                )

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        step, self._step = self._step, self._step + 1
        loss = (logs or {}).get("loss")
        if loss is None:
            return
        loss = float(np.asarray(loss))
        if math.isfinite(loss):
            return
        ranks, local_losses = self._nonfinite_ranks()
        self.report = {"epoch": self._epoch, "batch": batch, "step": step, "loss": str(loss),
                       "ranks": ranks, "local_losses": local_losses}
        who = (f"local loss non-finite on {'rank' if len(ranks) == 1 else 'ranks'} "
               f"{', '.join(map(str, ranks))}" if ranks else
               "every rank's local loss is finite (the global sum overflowed)")
        self.message = (f"non-finite loss ({loss}) at epoch {self._epoch + 1}, batch {batch} "
                        f"(step {step} of this fit): {who}")
        if self.action == "raise":
            raise NonFiniteLossError(self.message)
        if collectives.process_rank() == 0:
            log.warning("tfdist: %s; stopping training on every rank", self.message)
        self.model.stop_training = True

    def _nonfinite_ranks(self):
        """Every rank's running local loss for this epoch (all ranks call this at the same step)."""
        tracker = next((m for m in self.model.metrics if m.name == "loss"), None)
        local = float("nan")
        if tracker is not None and tracker.variables:
            with rank_variables.local_reads():  # this rank's own running sums, not the global ones
                total, count = (float(np.asarray(v.numpy())) for v in tracker.variables[:2])
            local = total / count if count else total
        if collectives.process_size() == 1:
            values = [local]
        else:
            gathered = collectives.allgather(tf.constant([local], tf.float64),
                                             name="tfdist.nonfinite.local_loss")
            values = gathered.numpy().tolist()
        return [r for r, v in enumerate(values) if not math.isfinite(v)], [str(v) for v in values]
