"""`predict()` under `HorovodStrategy` returns every rank's rows, as under MultiWorkerMirroredStrategy.

With the global-batch convention each rank predicts its part of every global batch. Keras would
return only that part; MWMS gathers the parts, so every worker gets the predictions for the
whole input, in input order. Here each predict step all-gathers its outputs in rank order, which
is the order in which a global batch was split (for datasets sharded by data; with file
sharding, rows come in the order the ranks read them).

Installed by `HorovodStrategy()`; models under other strategies, and strategies with
`batch_convention="per_rank"`, keep Keras' per-rank behaviour.
"""

import tensorflow as tf

from tfdist import _compat, collectives

HOOK = "predict gathers rows"

_installed = set()


def install():
    """Wrap `predict_step` of Keras 3 and (if used) tf-keras models with a cross-rank gather.

    Raises `KerasHookError` (naming the Keras version) if a class or method moved.
    """
    for model_class, flavour in _compat.model_classes(HOOK):
        _patch(model_class, flavour)


def _patch(model_class, flavour):
    if model_class in _installed:
        return

    def wrap(local_predict_step):
        def predict_step(self, *args, **kwargs):
            outputs = local_predict_step(self, *args, **kwargs)
            if not _gathers(self):
                return outputs
            return tf.nest.map_structure(_gather_rows, outputs)

        return predict_step

    _compat.patch_method(model_class, "predict_step", wrap, HOOK, flavour)
    _installed.add(model_class)


def _gathers(model):
    from tfdist.keras.recognise import multi_rank_strategy_of

    strategy = multi_rank_strategy_of(model)
    return strategy is not None and strategy.extended.batch_convention == "global"


def _gather_rows(value):
    value = tf.convert_to_tensor(value)
    if value.shape.rank == 0:
        return value
    return collectives.allgather(value)
