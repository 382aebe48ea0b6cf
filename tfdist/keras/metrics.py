"""Global metric values for Keras models trained under `HorovodStrategy`.

Keras computes a metric's value from its state variables (e.g. `total` and `count` of a `Mean`),
which each rank accumulates over its own examples. Under `HorovodStrategy` the values Keras
reports (progress bar, `History`, `evaluate()`) are computed from the state summed over ranks,
so a mean is weighted by every rank's example count, exactly as if one process had seen all data.

When: every training step (one small fused allreduce of the metric state), and at the end of each
`fit` epoch / `evaluate` call. In a train step the metric state depends on the forward pass only,
so its allreduce is ready while backprop runs: it runs just before the first gradients' round (or
fused with it, where Horovod's cycle collects both), overlapping backprop, not after it
(docs/benchmarks/records-2026-12-03-cycle.md; with the cycle started on enqueue, a round of its own
of about 0.2 ms in most steps). Evaluation steps report the rank's running local values and sync
only at the end, so ranks may evaluate different numbers of batches without waiting on each other.

Installed by `HorovodStrategy()`; models under other strategies are untouched.
"""

import threading

import tensorflow as tf

from tfdist import _compat, collectives, rank_variables
from tfdist.keras import step_outputs

HOOK = "global metrics"
SCOPE = "tfdist_metric_sync"  # the metric-state collectives' name in the profiler's trace viewer

_state = threading.local()
_installed = set()


def install():
    """Route `get_metrics_result` of Keras 3 and (if used) tf-keras models through `global_result`.

    Raises `KerasHookError` (naming the Keras version) if a class or method moved.
    """
    global_result = {"keras3": _keras3_global_result, "tf_keras": _tf_keras_global_result}
    for model_class, flavour in _compat.model_classes(HOOK):
        _patch(model_class, global_result[flavour], flavour)


def _patch(model_class, global_result, flavour):
    if model_class in _installed:
        return
    _compat.require_methods(model_class, ["get_metrics_result", "test_step"], HOOK, flavour)

    def wrap_get_metrics_result(local_result):
        def get_metrics_result(self):
            if not _uses_horovod(self):
                return local_result(self)
            results = local_result(self) if getattr(_state, "local", False) else global_result(self, local_result)
            step_outputs.note_metric_results(results)  # not reduced again with the step's own values
            return results

        return get_metrics_result

    def wrap_test_step(local_test_step):
        def test_step(self, *args, **kwargs):
            previous = getattr(_state, "local", False)
            _state.local = True
            try:
                return local_test_step(self, *args, **kwargs)
            finally:
                _state.local = previous

        return test_step

    _compat.patch_method(model_class, "get_metrics_result", wrap_get_metrics_result, HOOK, flavour)
    _compat.patch_method(model_class, "test_step", wrap_test_step, HOOK, flavour)
    _installed.add(model_class)


def _uses_horovod(model):
    from tfdist.keras.recognise import multi_rank_strategy_of

    return multi_rank_strategy_of(model) is not None


def _aggregation_name(variable):
    aggregation = variable.aggregation
    if isinstance(aggregation, tf.VariableAggregation):
        return {
            tf.VariableAggregation.SUM: "sum",
            tf.VariableAggregation.MEAN: "mean",
            tf.VariableAggregation.ONLY_FIRST_REPLICA: "only_first_replica",
        }.get(aggregation, "none")
    return str(aggregation)


def global_values(variables):
    """Each metric state variable's value combined across ranks, by its aggregation."""
    with rank_variables.local_reads():  # each rank's own state; the sums below combine them
        values = [tf.convert_to_tensor(v) for v in variables]
    kinds = [_aggregation_name(v) for v in variables]
    for kind, op in (("sum", "sum"), ("mean", "average")):
        picked = [i for i, k in enumerate(kinds) if k == kind]
        reduced = collectives.allreduce([values[i] for i in picked], op=op, scope=SCOPE)
        for i, value in zip(picked, reduced):
            values[i] = value
    for i, kind in enumerate(kinds):
        if kind == "only_first_replica":
            values[i] = collectives.broadcast(values[i], 0, name=f"tfdist.metric_first.{i}", scope=SCOPE)
    return values


def _collect(results, metric, value):
    if isinstance(value, dict):
        results.update(value)
    else:
        results[metric.name] = value


def _keras3_global_result(model, local_result):
    metrics = model.metrics
    variables = [v for m in metrics for v in m.variables]
    values = iter(global_values(variables))
    results = {}
    for metric in metrics:
        state = [next(values) for _ in metric.variables]
        _collect(results, metric, _result_of_state(metric, state) if state else metric.result())
    return results


def _result_of_state(metric, state):
    """`metric.result()` computed from `state`, read while `state` stands in for the variables.

    Keras' `stateless_result` returns whatever `result()` returns; a metric written as Keras'
    guide shows (`return self.true_positives`) returns the variable itself, which read later
    would give this rank's own count. Tensors are made inside the scope instead.
    """
    import keras

    with keras.StatelessScope(state_mapping=list(zip(metric.variables, state))):
        return tf.nest.map_structure(tf.convert_to_tensor, metric.result())


def _tf_keras_global_result(model, local_result):
    # tf-keras metrics have no stateless result(): swap the global state into each rank's own
    # variables (not through the sync-on-read wrapper, whose cross-replica assign would spread a
    # SUM over the ranks), read, swap back.
    variables = [rank_variables.own(v) for m in model.metrics for v in m.variables]
    local_values = [tf.identity(v.read_value()) for v in variables]
    for variable, value in zip(variables, global_values(variables)):
        variable.assign(value)
    with rank_variables.local_reads():  # read the swapped-in values as they are
        results = tf.nest.map_structure(tf.identity, local_result(model))
    with tf.control_dependencies(tf.nest.flatten(results)):
        for variable, value in zip(variables, local_values):
            variable.assign(value)
    return results
