"""Saving that cannot corrupt (tfdist.keras.chief_saves): MWMS-style code saving and loading the same
paths on 2 real ranks, on Keras 3 and tf-keras; and one process, where nothing changes."""

import json
import os

import pytest

from conftest import ROOT, flavor_env, python_results, run_job

WORKER = ROOT / "tests" / "multirank" / "saving_checks.py"
ITERATIONS = 20


def assert_loop(result, label, iterations=ITERATIONS):
    assert result["errors"] == [], f"{label}: {result['errors'][:3]}"
    assert result["loaded"] == result["equal"] == iterations, f"{label}: {result}"


@pytest.mark.multirank
@pytest.mark.parametrize("flavor", ["keras3", "tf_keras"])
def test_every_rank_saves_and_loads_the_same_paths(flavor, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    results = run_job([WORKER, "--dir", shared], tmp_path / "out", np=2, env=flavor_env(flavor), timeout=400)

    for rank in (0, 1):
        got = results[rank]
        # 1. the same path saved and loaded on every rank, 20 times: every load whole and current
        loops = got["keras_loops"]
        for label in ["model.save", "save_weights.h5"] + (["save_weights.tf"] if flavor == "tf_keras" else []):
            assert_loop(loops[label], f"rank {rank} {label}")
        assert loops["files"]["loop-model"] == ["model.keras"]  # no temp file left behind
        assert loops["files"]["loop-weights"] == ["model.weights.h5"]
        if flavor == "tf_keras":  # the chief's checkpoint only (others wrote theirs elsewhere)
            assert loops["files"]["loop-tf-weights"] == ["checkpoint", "weights.data-00000-of-00001", "weights.index"]
        # 2. TensorFlow's own APIs
        tf_apis = got["tensorflow"]
        for label in ["tf.saved_model", "checkpoint.write", "checkpoint.save", "manager.shared_dir"]:
            assert_loop(tf_apis[label], f"rank {rank} {label}", 5)
        assert_loop(tf_apis["manager.mwms_ctl"], f"rank {rank} MWMS CTL tutorial", 3)
        shared_dir = str(shared / "manager")
        assert tf_apis["manager.shared_dir"]["latest"] == [[f"{shared_dir}/ckpt-{i}"] * 2 for i in range(1, 6)]
        assert tf_apis["manager.shared_dir"]["files"] == sorted(
            ["checkpoint"] + [f"ckpt-{i}.{ext}" for i in (4, 5) for ext in ("data-00000-of-00001", "index")])
        # 3. the MWMS Keras tutorial: non-chief saves to its temp path, then every rank loads the chief's
        assert got["mwms_keras"].get("error") is None and got["mwms_keras"]["equal"], got["mwms_keras"]
        # callbacks in fit, and chief-only blocks, keep the ranks' save numbering paired
        assert got["callbacks"]["equal"]
        assert got["chief_only_block"]["equal"] and got["chief_only_block"]["files"] == ["model.keras"]
        # 4. Horovod style: the chief alone, per-rank files, then every rank again
        horovod = got["horovod"]
        assert horovod["chief_file_equal"] and horovod["per_rank_equal"] == [True, True] and horovod["after_equal"]
        assert horovod["files"] == ["after.keras", "model.keras", "rank0.keras", "rank1.keras"]
    paired = ["keras_loops", "tensorflow", "mwms_keras", "callbacks", "chief_only_block", "timeout"]
    assert [results[0]["numbers"][k] for k in paired] == [results[1]["numbers"][k] for k in paired]
    assert results[0]["numbers"]["horovod"] == results[1]["numbers"]["horovod"] + 1  # the chief's own save

    # MWMS tutorial paths: the non-chief wrote its own temp path (and removed it), never the chief's
    assert "workertemp_1" in results[1]["mwms_keras"]["write_model_path"]
    assert not (shared / "mwms" / "workertemp_1").exists() or not os.listdir(shared / "mwms" / "workertemp_1")

    # A save rank 1 makes alone fails after TFDIST_SAVE_TIMEOUT, naming rank, host, call and cause.
    timeout = results[1]["timeout"]
    assert timeout["type"] == "SaveSyncError" and 3 <= timeout["seconds"] < 30, timeout
    for words in ["rank 1 (host ", "model.save('", "rank1-alone.keras')", "save #", "chief never made a matching save"]:
        assert words in timeout["error"], (words, timeout["error"])
    assert not results[0]["timeout"]["exists"]
    assert any("still waiting" in line for line in results[1]["log"])

    # 5. rank 1 says once, at INFO, that the chief writes the shared path; rank 0 never does
    redirected = [line for line in results[1]["log"] if "is written by the chief (rank 0)" in line]
    assert len(redirected) == 1, results[1]["log"]
    assert redirected[0].startswith("tfdist: rank 1: model.save('") and "this rank wrote its copy under /" in redirected[0]
    assert not [line for line in results[0]["log"] if "is written by the chief" in line]


@pytest.mark.multirank
def test_without_watchdog_files_stay_whole_and_a_warning_says_saves_are_not_synchronised(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    results = run_job([WORKER, "--dir", shared, "--no-watchdog"], tmp_path / "out", np=2,
                      env=flavor_env("keras3"), timeout=300)
    for rank in (0, 1):
        checks = results[rank]["checks"]
        assert checks["errors"] == [] and checks["loads_equal"] == 5, checks
        assert checks["files"] == ["ckpt", "ctl", "model.keras"]  # no temp file left
        assert checks["checkpoint_files"] == ["c-1.data-00000-of-00001", "c-1.index", "checkpoint"]
    assert results[0]["checks"]["checkpoint_path"] == str(shared / "unsynchronised" / "ckpt" / "c-1")
    assert not results[1]["checks"]["checkpoint_path"].startswith(str(shared))  # rank 1's copy: its temp dir
    warnings = [line for line in results[1]["log"] if "no watchdog runs" in line]
    assert len(warnings) == 1 and "saves are not synchronised" in warnings[0]
    assert not [line for line in results[0]["log"] if "no watchdog runs" in line]


SINGLE_PROCESS = """
import json, os, sys
import tensorflow as tf
import tfdist
from tfdist import _compat
from tfdist.keras import chief_saves
from tfdist.keras.flavour import keras_module
keras = keras_module()
tfdist.HorovodStrategy(tuning=False, watchdog=False, check_consistency=False)
where = sys.argv[1]
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
model.save(os.path.join(where, "m.keras"))
model.save_weights(os.path.join(where, "m.weights.h5"))
checkpoint = tf.train.Checkpoint(v=tf.Variable(1.0))
saved = checkpoint.save(os.path.join(where, "ckpt", "c"))
manager = tf.train.CheckpointManager(checkpoint, os.path.join(where, "manager"), max_to_keep=1)
tf.saved_model.save(tf.Module(), os.path.join(where, "sm"))
hooks = {"Model.save": type(model).save, "Model.save_weights": type(model).save_weights,
         "tf.saved_model.save": tf.saved_model.save, "tf.compat.v2.saved_model.save": tf.compat.v2.saved_model.save,
         "Checkpoint.write": tf.train.Checkpoint.write, "Checkpoint.save": tf.train.Checkpoint.save,
         "CheckpointManager.save": tf.train.CheckpointManager.save}
print("RESULT " + json.dumps({"hooks": {k: _compat.hook_of(v) for k, v in hooks.items()},
                              "active": chief_saves.active(), "saved": saved, "manager": manager.save(),
                              "files": sorted(os.listdir(where)), "number": chief_saves._state["number"]}))
"""


@pytest.mark.parametrize("flavor", ["keras3", "tf_keras"])
def test_one_process_hooks_installed_and_saving_untouched(flavor, tmp_path):
    got = json.loads(python_results(SINGLE_PROCESS, tmp_path, env=flavor_env(flavor))[-1])
    assert set(got["hooks"].values()) == {"chief-only saving"}, got["hooks"]
    assert got["active"] is False and got["number"] == 0
    assert got["saved"] == str(tmp_path / "ckpt" / "c-1")
    assert got["manager"] == str(tmp_path / "manager" / "ckpt-2")  # the checkpoint's save_counter numbers it
    assert got["files"] == ["ckpt", "m.keras", "m.weights.h5", "manager", "sm"]  # nothing else, no temp files


MOVED = """
import sys
{setup}
import tfdist
try:
    tfdist.HorovodStrategy(tuning=False, watchdog=False, check_consistency=False)
except tfdist.KerasHookError as e:
    print("RESULT " + str(e))
"""


@pytest.mark.parametrize("setup, names", [
    ("import tensorflow as tf; del tf.train.CheckpointManager.save", ["CheckpointManager has no save()", "tensorflow 2."]),
    ("import keras; del keras.Model.save_weights", ["Model has no save_weights()", "keras 3."]),
])
def test_a_moved_saving_function_stops_the_strategy_naming_it(setup, names):
    message = python_results(MOVED.format(setup=setup), env=flavor_env("keras3"))[0]
    for words in ["'chief-only saving' hook", *names]:
        assert words in message, (words, message)
