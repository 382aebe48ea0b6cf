"""`predict()` under `HorovodStrategy` returns every rank's rows, as under MultiWorkerMirroredStrategy.

With the global-batch convention each rank predicts its part of every global batch. Keras would
return only that part; MWMS gathers the parts, so every worker gets the predictions for the
whole input, in input order. Here each predict step all-gathers its outputs in rank order, which
is the order in which a global batch was split (for datasets sharded by data; with file
sharding, rows come in the order the ranks read them).

Installed by `HorovodStrategy()`; models under other strategies, and strategies with
`batch_convention="per_rank"`, keep Keras' per-rank behaviour.
"""

import sys

import tensorflow as tf

from tfdist import collectives
from tfdist.keras_flavour import legacy_requested

_installed = set()


def install():
    """Wrap `predict_step` of Keras 3 and (if used) tf-keras models with a cross-rank gather."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    _patch(TensorFlowTrainer)
    if "tf_keras" in sys.modules or legacy_requested():
        try:
            from tf_keras.src.engine import training as tf_keras_training
        except ImportError:
            return
        _patch(tf_keras_training.Model)


def _patch(model_class):
    if model_class in _installed:
        return
    _installed.add(model_class)
    local_predict_step = model_class.predict_step

    def predict_step(self, *args, **kwargs):
        outputs = local_predict_step(self, *args, **kwargs)
        if not _gathers(self):
            return outputs
        return tf.nest.map_structure(_gather_rows, outputs)

    predict_step.__doc__ = local_predict_step.__doc__
    model_class.predict_step = predict_step


def _gathers(model):
    from tfdist.strategy import HorovodStrategy

    strategy = getattr(model, "distribute_strategy", None)
    return (isinstance(strategy, HorovodStrategy) and strategy.extended._global_batch_size
            and collectives.size() > 1)


def _gather_rows(value):
    value = tf.convert_to_tensor(value)
    if value.shape.rank == 0:
        return value
    return collectives.allgather(value)
