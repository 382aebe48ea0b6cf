"""Checkpoint and resume: atomic chief-side saves, damaged checkpoints skipped, pruning, and a
2-rank job killed after epoch 2 that resumes to the same weights as an uninterrupted run."""

import json
import logging
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tfdist.callbacks.checkpoint import (
    MARKER_FILE,
    STATE_FILE,
    CheckpointError,
    Checkpointer,
    latest_checkpoint,
    training_variables,
)
from conftest import ROOT, JobFailed, flavor_env, run_job
from tfdist.keras.flavour import keras_module

keras = keras_module()
WORKER = ROOT / "tests" / "multirank" / "checkpoint_checks.py"
RECORDS = 48


# --- one process (the flavour pytest runs under; tf-keras via the subprocess test below) ------

def make_model(units=3, seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(units), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    return model


def make_data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(32, 4)).astype("float32")
    return x, (x @ np.array([1.0, -2.0, 0.5, 3.0], "float32"))[:, None]


def variable_values(model):
    return [np.asarray(v).copy() for v in training_variables(model)]


class Crash(keras.callbacks.Callback):
    def __init__(self, after):
        super().__init__()
        self.after = after

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 == self.after:
            raise KeyboardInterrupt("simulated crash")


def test_unit_resumed_fit_equals_uninterrupted_fit(tmp_path):
    x, y = make_data()
    reference = make_model()
    reference.fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0)

    model = make_model()
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0,
                  callbacks=[Checkpointer(tmp_path, keep=5), Crash(after=2)])
    resumed = make_model(seed=1)  # a fresh process would start from other values
    checkpointer = Checkpointer(tmp_path, keep=5)
    assert checkpointer.initial_epoch() == 2
    history = resumed.fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0, callbacks=[checkpointer])
    assert len(history.history["loss"]) == 2  # epochs 3 and 4 only
    assert checkpointer.restored_from == str(tmp_path / "ckpt-000002")
    assert int(np.asarray(resumed.optimizer.iterations)) == 16
    for got, want in zip(variable_values(resumed), variable_values(reference)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000001", "ckpt-000002", "ckpt-000003", "ckpt-000004"]


def test_unit_crash_while_saving_leaves_last_good_checkpoint(tmp_path, caplog):
    x, y = make_data()
    model = make_model()
    checkpointer = Checkpointer(tmp_path, keep=10)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[checkpointer])
    saved = variable_values(model)
    good = tmp_path / "ckpt-000002"
    # A save killed half way: a temp dir with a partial state file and no marker.
    partial = tmp_path / ".tmp-ckpt-000003-dead"
    partial.mkdir()
    (partial / STATE_FILE).write_bytes((good / STATE_FILE).read_bytes()[:100])
    # Newer checkpoints damaged afterwards: marker gone, marker corrupt, state file truncated.
    for epoch, damage in [(4, "no marker"), (5, "corrupt marker"), (6, "truncated state")]:
        damaged = tmp_path / f"ckpt-{epoch:06d}"
        shutil.copytree(good, damaged)
        marker = json.loads((good / MARKER_FILE).read_text())
        (damaged / MARKER_FILE).write_text(json.dumps({**marker, "epoch": epoch}))
        if damage == "no marker":
            (damaged / MARKER_FILE).unlink()
        elif damage == "corrupt marker":
            (damaged / MARKER_FILE).write_text('{"epoch": 5, "fil')
        else:
            with open(damaged / STATE_FILE, "r+b") as f:
                f.truncate(200)
    with caplog.at_level(logging.WARNING, logger="tfdist"):
        path, marker = latest_checkpoint(tmp_path)
    assert path == str(good) and marker["epoch"] == 2 and marker["step"] == 8
    for name, reason in [(".tmp-ckpt-000003-dead", "unfinished save"), ("ckpt-000004", "no complete.json"),
                         ("ckpt-000005", "complete.json is corrupt"), ("ckpt-000006", "has 200 bytes")]:
        assert any(name in r.getMessage() and reason in r.getMessage() for r in caplog.records), name

    fresh = make_model(seed=3)
    resume = Checkpointer(tmp_path)
    fresh.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[resume])  # nothing left to run
    assert resume.restored_from == str(good)
    for got, want in zip(variable_values(fresh), saved):
        np.testing.assert_array_equal(got, want)


def test_unit_same_sized_but_altered_state_is_rejected_by_checksum(tmp_path):
    model = make_model()
    model.fit(*make_data(), batch_size=8, epochs=2, verbose=0, callbacks=[Checkpointer(tmp_path)])
    state = tmp_path / "ckpt-000002" / STATE_FILE
    data = bytearray(state.read_bytes())
    data[-30] ^= 0xFF
    state.write_bytes(bytes(data))
    assert latest_checkpoint(tmp_path)[0] == str(tmp_path / "ckpt-000001")


def test_unit_keep_prunes_and_save_every_epochs(tmp_path):
    model = make_model()
    model.fit(*make_data(), batch_size=8, epochs=5, verbose=0,
              callbacks=[Checkpointer(tmp_path, save_every_epochs=2, keep=2)])
    # epochs 2 and 4 by the interval, 5 because it is the last; keep=2 leaves the newest two
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000004", "ckpt-000005"]


def test_unit_checkpoint_of_another_model_fails_naming_it(tmp_path):
    model = make_model(units=3)
    model.fit(*make_data(), batch_size=8, epochs=1, verbose=0, callbacks=[Checkpointer(tmp_path)])
    other = make_model(units=5)
    with pytest.raises(CheckpointError, match=r"ckpt-000001: variable #0 .* float32\[4, 5\] here but float32\[4, 3\]"):
        other.fit(*make_data(), batch_size=8, epochs=2, verbose=0, callbacks=[Checkpointer(tmp_path)])


def test_unit_epoch_with_non_finite_loss_is_not_saved(tmp_path, caplog):
    from tfdist.callbacks import StopOnNonFiniteLoss

    model = make_model()
    x, y = make_data()
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[Checkpointer(tmp_path)])
    with caplog.at_level(logging.WARNING, logger="tfdist"):
        model.fit(np.full_like(x, np.nan), y, batch_size=8, epochs=3, verbose=0,
                  callbacks=[StopOnNonFiniteLoss(), Checkpointer(tmp_path)])
    # epoch 3 was the last (always saved) but its loss is NaN: the good epoch-2 checkpoint stays newest
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000001", "ckpt-000002"]
    assert latest_checkpoint(tmp_path)[0] == str(tmp_path / "ckpt-000002")
    assert "epoch 3 ended with loss nan; not saved" in caplog.text


def test_unit_bad_arguments():
    with pytest.raises(ValueError, match="keep=0"):
        Checkpointer("/tmp/x", keep=0)


def test_unit_tests_pass_under_tf_keras():
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "unit and not tf_keras",
         "tests/test_checkpoint.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "7 passed" in out.stdout


# --- two ranks under horovodrun: killed after epoch 2 of 4, restarted with the same command ----

@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from tfdist.pipelines import write_arrays

    rng = np.random.default_rng(0)
    x = rng.normal(size=(RECORDS, 4)).astype("float32")
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], "float32"))[:, None]
    path = tmp_path_factory.mktemp("ckpt-data") / "ds"
    write_arrays({"x": x, "y": y, "id": np.arange(RECORDS, dtype=np.int64)}, path, min_shards=4)
    return path


@pytest.mark.parametrize("flavor", ["keras3", "tf_keras"])
def test_killed_job_resumes_to_the_uninterrupted_result(flavor, dataset, tmp_path):
    command = [WORKER, "--data", dataset, "--ckpt", tmp_path / "ckpt"]
    out = tmp_path / "out"
    env = {**flavor_env(flavor), "CHECKPOINT_TEST_REFERENCE": "1", "CHECKPOINT_TEST_CRASH_AFTER": "2"}
    with pytest.raises(JobFailed, match="Exit code: 17"):  # reference run, then the crash
        run_job(command, out, np=2, env=env, timeout=240)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["ckpt-000001", "ckpt-000002"]
    reference = {r: json.loads((out / "reference" / f"rank{r}.json").read_text()) for r in (0, 1)}
    resumed = run_job(command, out, np=2, env=flavor_env(flavor), timeout=240)  # the same command

    for rank in (0, 1):
        got, want = resumed[rank], reference[rank]
        assert want["epochs_run"] == [0, 1, 2, 3] and want["restored_from"] is None
        # started at the third epoch: nothing repeated, nothing skipped
        assert got["initial_epoch"] == 2 and got["epochs_run"] == [2, 3]
        assert got["restored_from"] == str(tmp_path / "ckpt" / "ckpt-000002")
        assert got["iterations"] == want["iterations"] == 4 * want["steps_per_epoch"]
        # Same data in the same order and the same arithmetic on one device: bit-identical.
        for a, b in zip(got["variables"], want["variables"]):
            np.testing.assert_array_equal(np.array(a), np.array(b))
        assert got["loss"] == want["loss"][2:]
        for epoch in ("2", "3"):
            assert got["ids_by_epoch"][epoch] == want["ids_by_epoch"][epoch]
    for a, b in zip(resumed[0]["variables"], resumed[1]["variables"]):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    for run in (reference, resumed):
        for epoch in run[0]["ids_by_epoch"]:
            assert sorted(run[0]["ids_by_epoch"][epoch] + run[1]["ids_by_epoch"][epoch]) == list(range(RECORDS))
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["ckpt-000003", "ckpt-000004"]
