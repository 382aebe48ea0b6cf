"""Profile a range of training steps and write TensorBoard scalars, on the chief or chosen ranks.

```python
from tfdist.callbacks import ProfileSteps
model.fit(ds, epochs=3, callbacks=[ProfileSteps("runs/resnet50", steps=(20, 25), ranks=(0, 1), batch_size=64)])
```

Then, on the machine holding `runs/` (TensorBoard binds to localhost by default; keep it so on a
shared login node, and tunnel with `ssh -L 6006:localhost:6006 login-node`):

    tensorboard --logdir runs/resnet50          # Scalars: loss, metrics, learning rate, images/s
                                                # Profile: Overview (step time and its breakdown),
                                                # input pipeline, trace viewer with tfdist's collectives
    tfdist-profile runs/resnet50                # per rank: step, compute, input and communication wait

Each profiled rank writes under `<log_dir>/rank<R>/` (the chief alone by default), so ranks
never write one file. Every profiled step carries a step marker, which the profiler's Overview
page and input-pipeline analyser need: tfdist adds it on Keras 3; tf-keras marks its steps itself
(numbered within the epoch), and the profiler is started before tf-keras opens the first one.
In a custom training loop, mark steps with `step_marker(step)`.

When the job runs with `HOROVOD_TIMELINE=DYNAMIC` (or `HorovodStrategy(horovod={"timeline":
"DYNAMIC"})`), Horovod's timeline of the same steps is written beside the profile, to
`<log_dir>/horovod_timeline.json` (by rank 0, Horovod's coordinator; open it in ui.perfetto.dev).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable

import numpy as np
import tensorflow as tf

from tfdist import collectives
from tfdist.callbacks._keras import Callback
from tfdist.keras.flavour import legacy_requested

log = logging.getLogger("tfdist")

TIMELINE_FILE = "horovod_timeline.json"


def step_marker(step: int, name: str = "train") -> tf.profiler.experimental.Trace:
    """A step marker for the TensorFlow profiler around one training step of a custom loop.

    The profiler groups the trace into steps by these markers (a `tf.profiler.experimental.Trace`
    with `step_num` and `_r=1`); without them its Overview page reports "No step marker observed"
    and its step-time breakdown and input-pipeline analysis stay empty. Free when not profiling.

    Args:
        step: the step's number.
        name: the marker's name in the trace.

    Returns:
        A context manager: the step is what runs inside it.

    Example:
        ```python
        from tfdist.callbacks import step_marker
        iterator = iter(strategy.experimental_distribute_dataset(ds))
        tf.profiler.experimental.start(f"runs/loop/rank{strategy.rank}")
        for step in range(10):
            with step_marker(step):                   # take the batch inside: input time is part of the step
                strategy.run(train_step, args=(next(iterator),))
        tf.profiler.experimental.stop()
        ```
    """
    return tf.profiler.experimental.Trace(name, step_num=int(step), _r=1)


class ProfileSteps(Callback):
    """TF-profile global steps [start, stop) and log epoch scalars, on `ranks` (default: chief).

    Args:
        log_dir: TensorBoard run directory; rank R writes to `<log_dir>/rank<R>`.
        steps: (start, stop) global training steps to trace (counted across epochs).
        ranks: ranks that profile and write scalars.
        batch_size: per-rank batch, for the images/s scalar (global: x num_replicas_in_sync).
        horovod_timeline: also record Horovod's timeline of these steps into
            `<log_dir>/horovod_timeline.json` when the job allows it (`HOROVOD_TIMELINE=DYNAMIC`).

    Raises:
        ValueError: `steps` is not 0 <= start < stop.

    Example:
        ```python
        from tfdist.callbacks import ProfileSteps
        profile = ProfileSteps("runs/resnet50", steps=(20, 25), ranks=(0, 1), batch_size=64)
        model.fit(ds, epochs=3, callbacks=[profile])   # then: tfdist-profile runs/resnet50
        ```
    """

    def __init__(self, log_dir: str, steps: tuple[int, int] = (10, 15), ranks: Iterable[int] = (0,),
                 batch_size: int | None = None, horovod_timeline: bool = True):
        super().__init__()
        self.start, self.stop = steps
        if not 0 <= self.start < self.stop:
            raise ValueError(f"ProfileSteps(steps={steps}): need 0 <= start < stop")
        self.ranks = tuple(ranks)
        self.batch_size = batch_size
        self.log_dir = log_dir
        self.horovod_timeline = horovod_timeline
        self._step = 0
        self._profiling = False  # the TF profiler and/or the Horovod timeline are recording
        self._timeline = False
        self._marker = None
        self._writer = None
        # tf-keras opens its own step marker before on_train_batch_begin and closes it after
        # on_train_batch_end; the profiler must run for the whole of each marked step.
        self._keras_marks_steps = legacy_requested()

    @property
    def active(self) -> bool:
        """Whether this rank profiles and writes scalars."""
        return collectives.process_rank() in self.ranks

    @property
    def rank_dir(self) -> str:
        """This rank's TensorBoard directory, `<log_dir>/rank<R>`."""
        return f"{self.log_dir}/rank{collectives.process_rank()}"

    @property
    def timeline_path(self) -> str:
        """Where Horovod's timeline goes: `<log_dir>/horovod_timeline.json`."""
        return f"{self.log_dir}/{TIMELINE_FILE}"

    def on_train_begin(self, logs=None):
        if self.active:
            self._writer = tf.summary.create_file_writer(self.rank_dir)
        if self.start == 0:
            self._begin()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start, self._epoch_steps = time.perf_counter(), 0
        if self._step == self.start:  # the range starts with this epoch (after any validation)
            self._begin()

    def on_train_batch_begin(self, batch, logs=None):
        if self._profiling and self._keras_marks_steps and self._step >= self.stop:
            self._end()  # inside tf-keras' marker of step `stop`, which is then left out
        if self._profiling and not self._keras_marks_steps and self.start <= self._step < self.stop:
            self._marker = step_marker(self._step)
            self._marker.__enter__()

    def on_train_batch_end(self, batch, logs=None):
        if self._marker is not None:
            self._marker.__exit__(None, None, None)
            self._marker = None
        self._step += 1
        self._epoch_steps += 1
        if self._step == self.start and not self._at_epoch_end(batch):
            self._begin()  # before the next step, and before tf-keras opens its marker
        if self._profiling and self._step >= self.stop and not self._keras_marks_steps:
            self._end()

    def on_test_begin(self, logs=None):
        if self._profiling and self._step >= self.stop:
            self._end()  # validation steps are not part of the range

    def on_epoch_end(self, epoch, logs=None):
        if self._profiling and self._step >= self.stop:
            self._end()
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
        if self._marker is not None:
            self._marker.__exit__(None, None, None)
            self._marker = None
        if self._profiling:  # training ended inside the range: keep what was traced
            self._end()
        if self._writer is not None:
            self._writer.close()

    def _at_epoch_end(self, batch):
        steps = (self.params or {}).get("steps")
        return steps is not None and batch + 1 >= steps

    def _begin(self):
        if self._profiling:
            return
        if self.active:
            tf.profiler.experimental.start(self.rank_dir)
        self._timeline = self._start_timeline()
        self._profiling = True

    def _end(self):
        if self.active:
            tf.profiler.experimental.stop()
        if self._timeline:
            collectives.stop_timeline()
            self._timeline = False
        self._profiling = False

    def _start_timeline(self):
        """Every rank starts Horovod's timeline (rank 0 writes it); False where it cannot run."""
        if not self.horovod_timeline or collectives.process_size() == 1:
            return False
        mode = collectives.timeline_mode()
        if mode == "dynamic":
            collectives.start_timeline(self.timeline_path)
            return True
        if collectives.process_rank() == 0:
            if mode == "file":
                log.info("tfdist ProfileSteps: Horovod's timeline covers the whole job, in %s",
                         os.environ["HOROVOD_TIMELINE"])
            else:
                log.warning("tfdist ProfileSteps: Horovod's timeline of the profiled steps is not recorded: "
                            "start the job with HOROVOD_TIMELINE=DYNAMIC, or create the strategy with "
                            "HorovodStrategy(horovod={'timeline': 'DYNAMIC'}), to get %s", self.timeline_path)
        return False
