"""Ray Train for real: `ray.train.tensorflow.TensorflowTrainer` on a local Ray cluster starts the
workers, tfdist.HorovodStrategy() in the train function joins the TF_CONFIG cluster Ray writes, and
the job trains to one process's weights (tests/multirank/ray_train_job.py runs it and records each
rank). Ray Data shards, Ray's checkpoints, a killed worker that Ray restarts, and Ray's
TF_USE_LEGACY_KERAS=1 without tf-keras."""

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, JobFailed, _tail, communicate_or_kill, extended_tier, make_job_env, read_results

pytest.importorskip("ray.train", reason="Ray Train is not installed: pip install 'tfdist[ray]' "
                                        "(bash scripts/bootstrap.sh installs it for the suite)")

JOB = ROOT / "tests" / "multirank" / "ray_train_job.py"
RAY_TIMEOUT = 300


def run_ray_job(out_dir, *args, env=None):
    """Run the Ray driver (or `--reference`); (driver.json or None, {rank: results}, its output)."""
    proc = subprocess.Popen([sys.executable, str(JOB), "--out", str(out_dir), *args], cwd=ROOT, env=make_job_env(env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output, _, timed_out = communicate_or_kill(proc, RAY_TIMEOUT, grace=10)
    if timed_out or proc.returncode:
        raise JobFailed(f"Ray job {' '.join(args)} {'timed out' if timed_out else f'exited {proc.returncode}'}"
                        f"\n{_tail(output)}")
    driver = out_dir / "driver.json"
    return json.loads(driver.read_text()) if driver.exists() else None, read_results(out_dir), output


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One process at the global batch (no Ray), per flavour: its final weights."""
    return {flavour: run_ray_job(tmp_path_factory.mktemp(f"ray_ref_{flavour}"), "--reference",
                                 "--flavour", flavour)[1][0]["final"] for flavour in ("tf_keras", "keras3")}


def assert_weights_close(actual, expected):
    for a, b in zip(actual, expected, strict=True):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)


def assert_one_job(ranks, workers, flavour, reference):
    assert sorted(ranks) == list(range(workers))
    assert [ranks[r]["replicas"] for r in ranks] == [workers] * workers
    assert [ranks[r]["is_chief"] for r in ranks] == [True] + [False] * (workers - 1)
    assert {ranks[r]["keras"] for r in ranks} == {"tf_keras" if flavour == "tf_keras" else "keras"}
    assert all(ranks[r]["final"] == ranks[0]["final"] for r in ranks)  # bit-identical across ranks
    assert_weights_close(ranks[0]["final"], reference)
    # Ray Data: each rank's shard through the strategy gives every row once in all
    assert sorted(i for r in ranks for i in ranks[r]["ray_data_ids"]) == list(range(100))
    assert len({ranks[r]["ray_data_steps"] for r in ranks}) == 1 and ranks[0]["ray_data_steps"] > 0
    assert all(ranks[r]["after_ray_data"] == ranks[0]["after_ray_data"] for r in ranks)


@pytest.mark.multirank
@pytest.mark.parametrize("workers, flavour", [
    (2, "tf_keras"),  # Ray's default flavour (it sets TF_USE_LEGACY_KERAS=1)
    pytest.param(4, "tf_keras", marks=extended_tier("Ray Train, 4 workers on tf-keras: 2 run here")),
    pytest.param(4, "keras3", marks=extended_tier("Ray Train, 4 workers on Keras 3: 2 run here, killed and restarted")),
])
def test_ray_train_workers_train_as_one_job_to_one_process_weights(tmp_path, references, workers, flavour):
    driver, ranks, output = run_ray_job(tmp_path, "--workers", str(workers), "--flavour", flavour)
    assert driver["error"] is None
    assert_one_job(ranks, workers, flavour, references[flavour])
    # Ray's own Keras callback reported a checkpoint each epoch: the last one holds the final model
    assert driver["checkpoint"]["weights"] == ranks[0]["final"]
    assert f"TF_CONFIG cluster: {workers} workers as {workers} ranks (worker:0 is rank 0)" in output
    assert "tfdist tuning (rank" not in output  # the per-rank plan stays at debug level


@pytest.mark.multirank
def test_a_killed_ray_worker_stops_every_rank_and_ray_resumes_the_job_exactly(tmp_path, references):
    """Keras 3 past Ray's TF_USE_LEGACY_KERAS=1; rank 1 SIGKILLed in epoch 2 of the first attempt;
    FailureConfig(max_failures=1) starts the group again and BackupAndRestore resumes it."""
    driver, ranks, output = run_ray_job(tmp_path, "--workers", "2", "--flavour", "keras3", "--kill")
    assert driver["error"] is None
    assert driver["attempts"] == ["attempt-0-1", "attempt-0-2", "attempt-1-1", "attempt-1-2"]
    assert [ranks[r]["attempt"] for r in (0, 1)] == [2, 2]
    assert "tfdist watchdog: rank 1 (host" in output and "died" in output  # rank 0 stopped naming it
    assert_one_job(ranks, 2, "keras3", references["keras3"])  # equal to the uninterrupted result
    assert driver["checkpoint"]["weights"] == ranks[0]["final"]


@pytest.mark.multirank
def test_ray_trains_legacy_keras_setting_without_tf_keras_stops_naming_it_and_both_fixes(tmp_path):
    driver, ranks, _ = run_ray_job(tmp_path, "--workers", "2", "--max-failures", "0",
                                   env={"TFDIST_TEST_UNINSTALLED": "tf_keras"})
    assert not ranks and driver["attempts"] == []
    assert "TF_USE_LEGACY_KERAS=1 asks for tf-keras, which is not installed" in driver["error"]
    assert "pip install tf-keras" in driver["error"] and 'os.environ["TF_USE_LEGACY_KERAS"] = "0"' in driver["error"]
