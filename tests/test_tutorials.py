"""TensorFlow's and Keras' distributed tutorials, run unchanged under every runner.

The flows live in tests/multirank/tutorial_flows.py and run inside the conformance launches
(tests/test_conformance.py launches each runner once per session; these tests read the same
result files): HorovodStrategy on 2 ranks (Keras 3, tf-keras), MWMS on loopback (tf-keras) and
one process at the global batch, which is the numeric oracle.
"""

import numpy as np
import pytest

from test_conformance import JOBS, assert_close, assert_same_on_workers, scenario, single

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("job", JOBS)
def test_cluster_resolver_makes_worker_0_the_chief(job, tmp_path_factory):
    parts = scenario(job, "tutorial_keras", tmp_path_factory)
    for w, part in enumerate(parts):
        assert part["task"] == ["worker", w], f"worker {w}: cluster_resolver task"
        assert part["is_chief"] == (w == 0)
        assert part["workers_in_cluster_spec"] == len(parts)
        assert part["in_multi_worker_mode"] is True
    ref = single("tutorial_keras", tmp_path_factory)
    assert ref["task"] == [None, None] and ref["is_chief"]


@pytest.mark.parametrize("job", JOBS)
def test_tutorial_fit_matches_single_process(job, tmp_path_factory):
    parts = scenario(job, "tutorial_keras", tmp_path_factory)
    ref = single("tutorial_keras", tmp_path_factory)
    assert_same_on_workers(parts, "trained")
    assert_close(parts[0]["trained"], ref["trained"], what="weights after fit vs single process")
    for w, part in enumerate(parts):
        assert sorted(part["history"]) == sorted(ref["history"])
        for key in ("loss", "accuracy"):
            np.testing.assert_allclose(part["history"][key], ref["history"][key], rtol=1e-4, err_msg=f"worker {w} {key}")
        # a custom metric returning its variable counts every worker's examples: 96 per epoch
        assert part["history"]["examples"] == [96.0, 96.0], f"worker {w}: custom metric"
    assert ref["history"]["examples"] == [96.0, 96.0]


@pytest.mark.parametrize("job", JOBS)
def test_every_worker_loads_what_the_chief_saved(job, tmp_path_factory):
    for w, part in enumerate(scenario(job, "tutorial_keras", tmp_path_factory)):
        # saved by the chief (the others wrote a worker temp copy and removed it), loaded by all
        assert part["loaded"] == part["trained"], f"worker {w}: loaded model differs from the trained one"
    assert single("tutorial_keras", tmp_path_factory)["versions_loaded"] == list(range(5))
    if job.startswith("mwms"):
        return  # MWMS workers all write a shared path and corrupt it: the flow skips that part there
    for w, part in enumerate(scenario(job, "tutorial_keras", tmp_path_factory)):
        # every worker saving one path 5 times, loading after each save: always a whole file, the
        # version saved then or (on another worker, the chief having saved again) a later one
        versions = part["versions_loaded"]
        assert None not in versions and len(versions) == 5, f"worker {w}: {versions}"
        assert all(v >= i for i, v in enumerate(versions)), f"worker {w}: loaded an older version: {versions}"
        if w == 0:
            assert versions == list(range(5)), "the chief loads what it just saved"


@pytest.mark.parametrize("job", JOBS)
def test_distribute_values_from_function_numbers_replicas_globally(job, tmp_path_factory):
    parts = scenario(job, "tutorial_keras", tmp_path_factory)
    for w, part in enumerate(parts):
        expected = [x for replica in range(len(parts)) for x in (replica, len(parts))]
        assert part["value_contexts"] == expected, f"worker {w}: (replica id, replicas) gathered"
    assert single("tutorial_keras", tmp_path_factory)["value_contexts"] == [0, 1]


@pytest.mark.parametrize("job", JOBS)
def test_custom_loop_metrics_are_global(job, tmp_path_factory):
    parts = scenario(job, "tutorial_custom_loop", tmp_path_factory)
    ref = single("tutorial_custom_loop", tmp_path_factory)
    assert len(ref["per_epoch"]) == 2 and 0 < ref["per_epoch"][0]["train_accuracy"] < 1
    for w, part in enumerate(parts):
        for epoch, (got, expected) in enumerate(zip(part["per_epoch"], ref["per_epoch"])):
            for key in ("loss", "train_accuracy", "test_loss"):
                assert got[key] == pytest.approx(expected[key], rel=1e-5), f"worker {w} epoch {epoch} {key}"


@pytest.mark.parametrize("job", JOBS)
def test_custom_loop_checkpoint_manager_with_worker_dirs(job, tmp_path_factory):
    parts = scenario(job, "tutorial_custom_loop", tmp_path_factory)
    ref = single("tutorial_custom_loop", tmp_path_factory)
    assert_same_on_workers(parts, "final")
    assert_close(parts[0]["final"], ref["final"], what="custom-loop weights vs single process")
    for w, part in enumerate(parts):
        # every worker restores the chief's latest checkpoint (max_to_keep=1, saved after epoch 2)
        assert part["latest_checkpoint"] == "ckpt-2", f"worker {w}"
        assert part["restored_epoch"] == 2, f"worker {w}"
        assert part["restored"] == part["final"], f"worker {w}: restored weights"


@pytest.mark.parametrize("job", JOBS)
def test_one_shuffled_dataset_across_fits_keeps_one_process_data_order(job, tmp_path_factory):
    # The "Multi-worker training with Keras" tutorial fits one .shuffle().repeat() dataset again
    # and again (plain, ModelCheckpoint, BackupAndRestore): each fit must draw the shuffle order
    # one process draws; a reader of the dataset that one process does not have (Keras 3 reads a
    # batch to build the model under any strategy) shifts every later order.
    parts = scenario(job, "tutorial_data_order", tmp_path_factory)
    ref = single("tutorial_data_order", tmp_path_factory)
    assert_same_on_workers(parts, "losses")
    for fit, losses in ref["losses"].items():
        np.testing.assert_allclose(parts[0]["losses"][fit], losses, rtol=1e-4, err_msg=f"{job}: {fit}")
    assert_close(parts[0]["trained"], ref["trained"], atol=1e-4, what="weights after the fits vs single process")
