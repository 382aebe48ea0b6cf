"""Keras 3 builds a model under `HorovodStrategy` without reading a batch, as one process does.

Under any `tf.distribute` strategy, Keras 3's `fit` and `evaluate` build the model, its metrics
and its loss symbolically before the first step (`_maybe_symbolic_build`), from a batch taken
through an iterator of their own over the dataset. Without a strategy they build on the first
traced step instead. That extra iterator draws the next shuffle seed of a `.shuffle()` dataset
(its `reshuffle_each_iteration` seed stream), so every fit under a strategy saw the order that
one process's *next* fit sees: TensorFlow's "Multi-worker training with Keras" tutorial, which
fits one `.shuffle(60000).repeat()` dataset several times, trained on other batches than one
process. It also averaged that batch across ranks, one collective per `fit`.

Installed by `HorovodStrategy()`: under tfdist the symbolic build takes the shapes and dtypes of
a rank's batch from the distributed dataset's element spec, which is all it uses, and reads no
data. Models under other strategies are untouched.
"""

from tfdist import _compat, _compat_state
from tfdist.keras import recognise

HOOK = "model build without reading the dataset"


def install():
    """Wrap Keras 3's TensorFlow trainer's `_maybe_symbolic_build` once.

    Raises `KerasHookError` naming the Keras version if the method moved.
    """
    cls = _compat.keras3_trainer_class(HOOK)
    if _compat.hook_of(getattr(cls, "_maybe_symbolic_build", None)) == HOOK:
        return
    _compat.patch_method(cls, "_maybe_symbolic_build", _from_element_spec, HOOK)


def _from_element_spec(original):
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        if iterator is not None and data_batch is None and recognise.is_tfdist_strategy(self.distribute_strategy):
            data_batch = _compat_state.epoch_iterator_batch_spec(iterator, HOOK)
            iterator = None
        return original(self, iterator=iterator, data_batch=data_batch)

    return _maybe_symbolic_build
