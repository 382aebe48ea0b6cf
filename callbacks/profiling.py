"""Profile a range of training steps and write TensorBoard scalars, on the chief or chosen ranks.

```python
from tfdist.callbacks import ProfileSteps
model.fit(ds, epochs=3, callbacks=[ProfileSteps("runs/resnet50", steps=(20, 25), batch_size=64)])
```

Then, on the machine holding `runs/` (TensorBoard binds to localhost by default; keep it so on a
shared login node, and tunnel with `ssh -L 6006:localhost:6006 login-node`):

    tensorboard --logdir runs/resnet50          # Scalars: loss, metrics, learning rate, images/s
                                                # Profile: trace viewer, op stats of the steps

Each profiled rank writes under `<log_dir>/rank<R>/` (the chief alone by default), so ranks
never write one file. Horovod's own timeline is switched on with
`HorovodStrategy(horovod={"timeline": "timeline.json"})` and opens in chrome://tracing or Perfetto.
"""

import time

import numpy as np
import tensorflow as tf

from tfdist import collectives
from tfdist.callbacks._keras import Callback


class ProfileSteps(Callback):
    """TF-profile global steps [start, stop) and log epoch scalars, on `ranks` (default: chief).

    Args:
        log_dir: TensorBoard run directory; rank R writes to `<log_dir>/rank<R>`.
        steps: (start, stop) global training steps to trace (counted across epochs).
        ranks: ranks that profile and write scalars.
        batch_size: per-rank batch, for the images/s scalar (global: x num_replicas_in_sync).
    """

    def __init__(self, log_dir, steps=(10, 15), ranks=(0,), batch_size=None):
        super().__init__()
        self.start, self.stop = steps
        if not 0 <= self.start < self.stop:
            raise ValueError(f"steps={steps}: need 0 <= start < stop")
        self.ranks = tuple(ranks)
        self.batch_size = batch_size
        self.log_dir = log_dir
        self._step = 0
        self._profiling = False
        self._writer = None

    @property
    def active(self):
        return collectives.process_rank() in self.ranks

    @property
    def rank_dir(self):
        return f"{self.log_dir}/rank{collectives.process_rank()}"

    def on_train_begin(self, logs=None):
        if self.active:
            self._writer = tf.summary.create_file_writer(self.rank_dir)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start, self._epoch_steps = time.perf_counter(), 0

    def on_train_batch_begin(self, batch, logs=None):
        if self.active and self._step == self.start:
            tf.profiler.experimental.start(self.rank_dir)
            self._profiling = True

    def on_train_batch_end(self, batch, logs=None):
        self._step += 1
        self._epoch_steps += 1
        if self._profiling and self._step >= self.stop:
            tf.profiler.experimental.stop()
            self._profiling = False

    def on_epoch_end(self, epoch, logs=None):
        if self._writer is None:
            return
        seconds = time.perf_counter() - self._epoch_start
        scalars = {k: v for k, v in (logs or {}).items() if np.ndim(v) == 0}
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and "learning_rate" not in scalars:
            scalars["learning_rate"] = float(np.asarray(optimizer.learning_rate))
        if self.batch_size and seconds > 0:
            replicas = self.model.distribute_strategy.num_replicas_in_sync
            scalars["images_per_second"] = self.batch_size * replicas * self._epoch_steps / seconds
        with self._writer.as_default():
            for name, value in scalars.items():
                tf.summary.scalar(name, float(value), step=epoch)
        self._writer.flush()

    def on_train_end(self, logs=None):
        if self._profiling:  # training ended inside the range: keep what was traced
            tf.profiler.experimental.stop()
            self._profiling = False
        if self._writer is not None:
            self._writer.close()
