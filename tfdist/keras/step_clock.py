"""Horovod's cycle from the measured train step: a callback first in every tfdist `fit`.

`install()` (called by `HorovodStrategy()` where tfdist chose Horovod's cycle itself) adds it
through `tfdist.keras.fit_callbacks`; it times the first train steps and sets the cycle once
(`tfdist.tuning.cycle`), and the chief prints what it chose:

```python
from tfdist.keras import step_clock
step_clock.install()
model.fit(ds, epochs=3)   # rank 0: "tfdist tuning: Horovod cycle 10 -> 1.5 ms for train steps of 44.1 ms ..."
```
"""

from tfdist.keras import fit_callbacks
from tfdist.tuning import cycle


def install():
    fit_callbacks.register("first", _clock)


def _clock(model):
    if not cycle.following():
        return None
    from tfdist.keras.flavour import keras_module

    return type("TfdistStepClock", (_StepClock, keras_module().callbacks.Callback), {})()


def _report(line):
    from tfdist import collectives

    if collectives.rank() == 0:
        print(line, flush=True)


class _StepClock:
    async_safe = True  # it acts at batch begin only, which Keras always calls in the loop's thread

    def __init__(self):
        super().__init__()
        self._clock = cycle.StepClock(_report)

    def on_train_batch_begin(self, batch, logs=None):
        self._clock.batch_begins()
