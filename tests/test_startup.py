"""Settings TensorFlow reads when it loads: applied before it loads, reported as TensorFlow has
them, and measured by tfdist-tune (tiny model; no timing asserted)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import BIN, ROOT
from tfdist.tuning import startup
from tfdist.tuning import cache as tuning_cache

TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT), "PATH": str(BIN) + ":/usr/bin:/bin"}


def python(code, env=None, timeout=180):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TFDIST_", "TF_NUM_", "TF_ENABLE_ONEDNN", "HOROVOD_"))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={k: v for k, v in {**clean, **TF_ENV, **(env or {})}.items() if v is not None})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def test_local_layout_from_each_launcher():
    assert startup.local_layout({}) == (0, 1)
    assert startup.local_layout({"HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "4"}) == (1, 4)
    assert startup.local_layout({"OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}) == (2, 3)
    assert startup.local_layout({"MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}) == (0, 2)
    step = {"SLURM_STEP_ID": "0", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "4,2"}
    assert startup.local_layout(step) == (1, 2)
    # the batch script itself (no step task layout) is one process
    assert startup.local_layout({"SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "2"}) == (0, 1)
    assert startup.externally_bound({"SLURM_CPU_BIND_TYPE": "mask_cpu:"}) and not startup.externally_bound({})
    assert not startup.externally_bound({"SLURM_CPU_BIND_TYPE": "none"})


def test_ranks_other_than_0_quiet_tensorflow_start_up_log():
    assert startup.launcher_rank({}) is None and startup.launcher_rank({"SLURM_PROCID": "3"}) == 3
    assert startup.launcher_rank({"HOROVOD_RANK": "1", "SLURM_PROCID": "0"}) == 1  # horovodrun inside a step
    level = "2" if os.path.exists("/proc/driver/nvidia/version") else "3"
    for env in ({"HOROVOD_RANK": "1"}, {"OMPI_COMM_WORLD_RANK": "2"}, {"PMI_RANK": "1"}, {"SLURM_PROCID": "5"}):
        assert startup.quiet_log_level(env) == level, env
    for env in ({}, {"HOROVOD_RANK": "0"}, {"HOROVOD_RANK": "1", "TFDIST_QUIET_RANKS": "0"}):
        assert startup.quiet_log_level(env) is None, env
    # applied before TensorFlow loads, unless the user set it; undo() takes it back
    code = ("import os\nimport tfdist\nfrom tfdist import startup\n"
            "print('LEVEL', os.environ.get('TF_CPP_MIN_LOG_LEVEL'), 'TF_CPP_MIN_LOG_LEVEL' in startup.state()['kept'])\n"
            "startup.undo()\nprint('UNDONE', os.environ.get('TF_CPP_MIN_LOG_LEVEL'))\n")
    out = python(code, env={"HOROVOD_RANK": "1", "TF_CPP_MIN_LOG_LEVEL": None}).stdout
    assert f"LEVEL {level} False" in out and "UNDONE None" in out, out
    out = python(code, env={"HOROVOD_RANK": "1", "TF_CPP_MIN_LOG_LEVEL": "1"}).stdout
    assert "LEVEL 1 True" in out and "UNDONE 1" in out, out


def test_each_local_rank_gets_its_gpu_before_tensorflow_loads():
    """CUDA_VISIBLE_DEVICES narrowed to this local rank's entry (and memory growth on) by `import
    tfdist`; the scheduler's list is where the choice comes from, never a setting to keep."""
    code = ("import os\nimport tfdist\nfrom tfdist import startup\n"
            "print('GPU', os.environ.get('CUDA_VISIBLE_DEVICES'), os.environ.get('TF_FORCE_GPU_ALLOW_GROWTH'))\n"
            "startup.undo()\nprint('UNDONE', os.environ.get('CUDA_VISIBLE_DEVICES'))\n")
    layout = {"HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_RANK": "1"}
    out = python(code, env={**layout, "CUDA_VISIBLE_DEVICES": "4,6"}).stdout
    assert "GPU 6 true" in out and "UNDONE 4,6" in out, out
    out = python(code, env={**layout, "CUDA_VISIBLE_DEVICES": "7"}).stdout  # srun --gpus-per-task=1
    assert "GPU 7 true" in out, out
    out = python(code, env={**layout, "CUDA_VISIBLE_DEVICES": "4,6", "TF_FORCE_GPU_ALLOW_GROWTH": "false"}).stdout
    assert "GPU 6 false" in out, out  # the user's memory setting wins


@pytest.mark.parametrize("onednn", [False, True])
def test_import_tfdist_first_puts_onednn_choice_in_effect(onednn):
    """TensorFlow itself reports the choice: tfdist set TF_ENABLE_ONEDNN_OPTS before it loaded."""
    choice = json.dumps({"overrides": {"onednn": onednn}})
    out = python("import tfdist, tensorflow\n"
                 "from tfdist import tuning, startup\n"
                 "print('ONEDNN', tuning.onednn_active(), startup.state()['route'])\n",
                 env={tuning_cache.CHOICE_VARIABLE: choice}).stdout
    assert f"ONEDNN {onednn} import tfdist" in out


def test_tensorflow_first_is_reported_as_not_in_effect_with_the_fix():
    """The summary line shows what TensorFlow has, and the chief names what came too late."""
    code = ("import tensorflow\n"
            "from tfdist import tuning\n"
            "default = tuning.onednn_active()\n"
            "import tfdist, json, os\n"
            "os.environ['TFDIST_TUNING_CHOICE'] = json.dumps({'overrides': {'onednn': not default}})\n"
            "s = tfdist.HorovodStrategy(watchdog=False, check_consistency=False)\n"
            "s = tfdist.HorovodStrategy(watchdog=False, check_consistency=False)  # tfdist's own settings are not 'yours'\n"
            "print('DEFAULT', default, 'ACTIVE', tuning.onednn_active())\n")
    done = python(code)
    default = "DEFAULT True" in done.stdout
    assert f"ACTIVE {default}" in done.stdout  # nothing could change it
    summary = next(line for line in done.stdout.splitlines() if line.startswith("tfdist tuning:"))
    assert f"oneDNN {'on' if default else 'off'} (no early settings)" in summary
    assert f"NOT in effect: TF_ENABLE_ONEDNN_OPTS={0 if default else 1}" in done.stderr
    assert "import tfdist before tensorflow" in done.stderr and "tfdist-run" in done.stderr
    assert "kept your" not in done.stdout


def test_user_settings_win_and_undo_restores_the_process():
    code = ("import os\n"
            "before = sorted(os.sched_getaffinity(0))\n"
            "import tfdist\n"
            "from tfdist import startup\n"
            "s = startup.state()\n"
            "print('KEPT', s['kept'], 'SET', sorted(s['set']))\n"
            "print('UNDO', startup.undo(), os.environ.get('TF_NUM_INTRAOP_THREADS'), "
            "sorted(os.sched_getaffinity(0)) == before, startup.state())\n")
    out = python(code, env={"TF_ENABLE_ONEDNN_OPTS": "0"}).stdout
    assert "KEPT {'TF_ENABLE_ONEDNN_OPTS': '0'} SET ['TF_NUM_INTRAOP_THREADS']" in out
    assert "UNDO True None True None" in out
    out = python("import tfdist\nprint('STATE', tfdist.tuning.startup.state())\n", env={"TFDIST_TUNING": "0"}).stdout
    assert "STATE None" in out


def test_tuning_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("TFDIST_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(tuning_cache.CHOICE_VARIABLE, raising=False)
    assert tuning_cache.choice_for(1) == {}
    tuning_cache.save("m1", 1, {"overrides": {"onednn": False}}, [{"candidate": "x"}])
    tuning_cache.save("m1", 2, {"overrides": {"onednn": True}, "cycle_time_ms": 1}, [])
    assert tuning_cache.choice_for(1)["overrides"] == {"onednn": False}
    assert tuning_cache.choice_for(2)["cycle_time_ms"] == 1 and "m1" in tuning_cache.choice_for(2)["source"]
    assert tuning_cache.choice_for(3) == {}
    monkeypatch.setenv(tuning_cache.CHOICE_VARIABLE, '{"overrides": {"threads": 3}}')
    with pytest.raises(ValueError, match="unknown override.*threads"):
        tuning_cache.choice_for(1)


@pytest.mark.multirank
def test_tfdist_tune_measures_tables_caches_and_later_jobs_start_tuned(tmp_path):
    env = {**TF_ENV, "TFDIST_CACHE_DIR": str(tmp_path / "cache")}
    command = [str(BIN / "tfdist-tune"), "--model", "trivial", "--image_size", "8", "--num_classes", "4",
               "--global_batch", "8", "--steps", "2", "--repeats", "2", "--budget", "0", "--candidates", "defaults", "onednn_flip", "plan", "ranks2",
               "--json", str(tmp_path / "tune.json")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((tmp_path / "tune.json").read_text())["rows"]
    assert [r["candidate"] for r in rows] == ["defaults", "onednn_flip", "ranks2"]  # plan repeats one of them
    defaults, flipped, two = rows
    assert flipped["in_effect"]["onednn"] != defaults["in_effect"]["onednn"]  # each ran as described
    assert two["ranks"] == 2 and all(len(r["step_seconds"][0]) == 3 and r["images_per_sec"] > 0 for r in rows)
    assert all(len(r["runs"]) == 2 for r in rows)  # every run kept, in alternating order
    assert "| candidate | ranks/node |" in done.stdout and "cached in" in done.stdout
    # a later process on this machine starts with the fastest 1-rank candidate, before TensorFlow loads
    best = max(rows[:2], key=lambda r: r["images_per_sec"])
    out = python("import tfdist, tensorflow\nfrom tfdist import tuning, startup\n"
                 "print('STATE', startup.state()['cached_choice'] is not None, tuning.onednn_active())\n",
                 env={"TFDIST_CACHE_DIR": str(tmp_path / "cache")}).stdout
    assert f"STATE True {best['in_effect']['onednn']}" in out
