"""Keras batches as `tfdist.faults.hang` marks: the hang detector knows which step each rank is in.

`install()` (called by `HorovodStrategy()`) adds a callback first in every `fit` of a model under
a tfdist strategy (`tfdist.keras.fit_callbacks`); it marks each batch from its
`on_*_batch_begin` to its `on_*_batch_end`: `train step 21 (epoch 2, batch 5)` (21: this
process's train steps so far, over every fit; epoch and batch as Keras' progress bar counts
them), `evaluate batch 3 (evaluation 2)` for `fit`'s validation (and `predict batch 3 (prediction
1)` in a `predict` given the callback). Standalone `evaluate` and `predict` calls are not marked:
only `fit` takes tfdist's callbacks.

```python
from tfdist.keras import step_marks
step_marks.install()
model.fit(ds, epochs=3)          # under HorovodStrategy: tfdist.faults.hang.snapshot()["what"] is the step
```
"""

import collections

from tfdist.faults import hang
from tfdist.keras import fit_callbacks

_counts = {"train": 0, "test": 0, "predict": 0}  # this process's train steps, evaluations, predictions
# Marks begun and not yet ended, oldest first: Keras 3 may run on_*_batch_end on a thread pool,
# after the next batch began. A fit that raised left its last one here; the next run drops it.
_open = {mode: collections.deque() for mode in _counts}


def install():
    """Mark the batches of every later tfdist `fit` (needs `fit_callbacks.install()` too)."""
    fit_callbacks.register("first", _marks)


def _marks(model):
    from tfdist.keras.flavour import keras_module

    return type("TfdistStepMarks", (_StepMarks, keras_module().callbacks.Callback), {})()


class _StepMarks:
    async_safe = True  # its batch-end hooks only end marks: Keras 3 may run them on a thread pool

    def __init__(self):
        super().__init__()
        self._epoch = 1

    def on_train_begin(self, logs=None):
        _end_all("train")

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch + 1

    def on_train_batch_begin(self, batch, logs=None):
        _counts["train"] += 1
        _open["train"].append(hang.enter(f"train step {_counts['train']} (epoch {self._epoch}, batch {batch + 1})",
                                         step=True))

    def on_train_batch_end(self, batch, logs=None):
        _end("train")

    def on_test_begin(self, logs=None):
        _end_all("test")
        _counts["test"] += 1

    def on_test_batch_begin(self, batch, logs=None):
        _open["test"].append(hang.enter(f"evaluate batch {batch + 1} (evaluation {_counts['test']})"))

    def on_test_batch_end(self, batch, logs=None):
        _end("test")

    def on_predict_begin(self, logs=None):
        _end_all("predict")
        _counts["predict"] += 1

    def on_predict_batch_begin(self, batch, logs=None):
        _open["predict"].append(hang.enter(f"predict batch {batch + 1} (prediction {_counts['predict']})"))

    def on_predict_batch_end(self, batch, logs=None):
        _end("predict")


def _end(mode):
    try:
        hang.leave(_open[mode].popleft())
    except IndexError:
        pass


def _end_all(mode):
    while _open[mode]:
        try:
            hang.leave(_open[mode].popleft(), finished=False)
        except IndexError:
            pass
