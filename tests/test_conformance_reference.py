"""What the reference's own tf.distribute tests found (issue 35), as conformance checks.

The scenarios (tests/multirank/reference_flows.py) run in test_conformance.py's launches
(HorovodStrategy on Keras 3, tf-keras and 4 ranks; MWMS on tf-keras; one process), so they cost
no launch of their own. Keras' and tf-keras' own test files run through tests/reference/suite.py
(tests/test_reference_suite.py).
"""

import numpy as np
import pytest

from test_conformance import HOROVOD_JOBS, JOBS, assert_close, assert_same_on_workers, scenario, single, workers

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("job", JOBS)
def test_iterator_made_inside_a_function_trains_as_one_process(job, tmp_path_factory):
    # tf-keras' optimizer tests: next(iter(dist_dataset)) inside the tf.function. With one inter-op
    # thread per rank (TensorFlow's default on a rank pinned to one core) this deadlocked.
    parts = scenario(job, "iterator_in_function", tmp_path_factory)
    ref = single("iterator_in_function", tmp_path_factory)
    assert [p["iterations"] for p in parts] == [3] * len(parts) and ref["iterations"] == 3
    assert_same_on_workers(parts, "weights")
    assert_close(parts[0]["weights"], ref["weights"], what="weights after 3 steps vs one process")


@pytest.mark.parametrize("job", JOBS)
def test_predict_on_elements_of_unknown_shape(job, tmp_path_factory):
    # TFRecords decoded by tf.io.parse_tensor: tfdist's first-dataset check read the shape's
    # dimensions and raised "Cannot iterate over a shape with unknown rank".
    parts = scenario(job, "unknown_shape_predict", tmp_path_factory)
    ref = single("unknown_shape_predict", tmp_path_factory)
    assert ref["element_shape"] == "<unknown>"
    for p in parts:
        assert len(p["predictions"]) == 16
        assert_close(p["predictions"], ref["predictions"], what="every row, in input order")


@pytest.mark.parametrize("job", JOBS)
def test_fit_on_distribute_datasets_from_function(job, tmp_path_factory):
    # Keras 3's tf_dataset_adapter_test: fit on per-rank datasets, the model built from a first batch.
    parts = scenario(job, "dataset_fn_fit", tmp_path_factory)
    ref = single("dataset_fn_fit", tmp_path_factory)
    assert_same_on_workers(parts, "weights")
    assert_same_on_workers(parts, "loss")
    assert_close(parts[0]["weights"], ref["weights"], what="weights vs one process")
    np.testing.assert_allclose(parts[0]["loss"], ref["loss"], rtol=1e-5)


@pytest.mark.parametrize("job", [j for j in HOROVOD_JOBS if "keras3" in j])
def test_keras3_model_built_outside_the_scope_adopts_the_strategy_and_trains_as_one_process(job, tmp_path_factory):
    # Keras 3's tf_dataset_adapter_test builds and compiles outside every scope, then fits the
    # strategy's distribute_datasets_from_function dataset: Keras ran it under the default
    # strategy, which cannot take per-replica values. Each rank starts from other weights here.
    parts = scenario(job, "outside_scope_fit", tmp_path_factory)
    ref = single("outside_scope_fit", tmp_path_factory)
    for key in ("weights", "loss", "evaluate", "other_weights", "other_loss"):
        assert_same_on_workers(parts, key)
    assert_close(parts[0]["weights"], ref["weights"], what="weights vs one process")
    np.testing.assert_allclose(parts[0]["loss"], ref["loss"], rtol=1e-5)
    np.testing.assert_allclose(parts[0]["evaluate"], ref["evaluate"], rtol=1e-5)
    assert_close(parts[0]["other_weights"], ref["other_weights"], what="fitted in the scope: weights vs one process")
    np.testing.assert_allclose(parts[0]["other_loss"], ref["other_loss"], rtol=1e-5)


@pytest.mark.parametrize("job", [j for j in HOROVOD_JOBS if "keras3" in j])
def test_keras3_step_values_are_the_mean_over_ranks(job, tmp_path_factory):
    # As MirroredStrategy's replicas on Keras 3: a custom train_step's own values are averaged.
    parts = scenario(job, "step_logs", tmp_path_factory)
    n = workers(job)
    replica = np.mean([r + 0.75 for r in range(n)])
    targets = np.arange(16, dtype=float).reshape(2, n, 8 // n)  # step, rank, rows
    shares = targets.sum(axis=2) / 8  # compute_average_loss over the global batch of 8
    for p in parts:
        assert [b["replica"] for b in p["batches"]] == [replica] * 2
        np.testing.assert_allclose([b["loss"] for b in p["batches"]], shares.mean(axis=1), rtol=1e-6)
        assert p["history"]["loss"] == [p["batches"][-1]["loss"]]
    assert single("step_logs", tmp_path_factory)["batches"][0]["replica"] == 0.75


def test_tf_keras_step_values_are_summed_over_ranks_as_mwms_does(tmp_path_factory):
    # tf-keras' multi_worker_test: shares of compute_average_loss summed, for fit and evaluate.
    hvd = scenario("horovod-tf_keras", "step_logs", tmp_path_factory)
    mwms = scenario("mwms-tf_keras", "step_logs", tmp_path_factory)
    assert hvd == mwms
    assert [b["loss"] for b in hvd[0]["batches"]] == [3.5, 11.5] and hvd[0]["evaluate"]["loss"] == 11.5


@pytest.mark.parametrize("job", [j for j in JOBS if j.startswith("horovod")])
def test_gathering_values_of_different_rank_raises_invalid_argument(job, tmp_path_factory):
    # TensorFlow's strategy_gather_test: InvalidArgumentError matching "Shape mismatch", as MWMS
    # raises (tfdist checks the shapes first; Horovod's own API keeps its FailedPreconditionError).
    parts = scenario(job, "gather_errors", tmp_path_factory)
    mwms = scenario("mwms-tf_keras", "gather_errors", tmp_path_factory)[0]
    assert mwms == {"gather_rank": "InvalidArgumentError", "all_gather_rank": "InvalidArgumentError",
                    "gather_rank says 'Shape mismatch'": True, "all_gather_rank says 'Shape mismatch'": True}
    assert all(p == mwms for p in parts)
