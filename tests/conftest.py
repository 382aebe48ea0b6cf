"""Test harness: launch real multi-process Horovod jobs (horovodrun --gloo) from pytest."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


class JobFailed(AssertionError):
    pass


@pytest.fixture(autouse=True, scope="module")
def _environment_restored():
    """Undo, after each test module, what its in-process HorovodStrategy() set in os.environ (its
    tuning sets HOROVOD_CYCLE_TIME, for one), so jobs launched by later modules start from the same
    environment in any test order. Module scope: set up before the modules' own strategy fixtures."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


def run_job(args, out_dir, np=2, env=None, timeout=420, launcher="horovodrun"):
    """Run `python ARGS --out OUT_DIR` under `horovodrun -np NP --gloo` (np=None: one plain process).

    `launcher="mpirun"`: under the mpirun command `tfdist-run --launcher mpirun` builds
    (`tfdist.launch.runner.build_command`); `"tfdist-run mpirun"`: through `tfdist-run --launcher mpirun`.

    Returns {rank: results dict}. A job that exceeds `timeout` is killed with its whole process
    group and fails the test, so a hang can never stall the suite.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, *map(str, args), "--out", str(out_dir)]
    job_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT), **(env or {})}
    if np is not None and launcher == "horovodrun":
        command = [str(BIN / "horovodrun"), "-np", str(np), "--gloo", *command]
    elif np is not None and launcher == "mpirun":
        from tfdist.launch.runner import build_command

        command = build_command("mpirun", command, np, env=job_env)
    elif np is not None and launcher == "tfdist-run mpirun":
        command = [str(BIN / "tfdist-run"), "--launcher", "mpirun", "-np", str(np), *command]
    elif np is not None:
        raise ValueError(f"run_job: unknown launcher {launcher!r}")
    proc = subprocess.Popen(
        command, cwd=ROOT, env=job_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        if launcher != "horovodrun":  # mpirun gives each rank its own process group: it stops them
            proc.terminate()
            try:
                proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise JobFailed(f"job timed out after {timeout}s: {' '.join(command)}\n{_tail(output)}")
    if proc.returncode != 0:
        raise JobFailed(f"job failed ({proc.returncode}): {' '.join(command)}\n{_tail(output)}")
    results = {}
    for path in sorted(out_dir.glob("rank*.json")):
        results[int(path.stem[4:])] = json.loads(path.read_text())
    expected = np or 1
    if len(results) != expected:
        raise JobFailed(f"expected {expected} result files, got {sorted(results)}\n{_tail(output)}")
    return results


def _tail(output, lines=80):
    kept = [l for l in output.splitlines() if " I0000 " not in l and " W0000 " not in l]
    return "\n".join(kept[-lines:])


@pytest.fixture(params=["keras3", "tf_keras"])
def keras_flavor(request):
    return request.param


def flavor_env(flavor):
    return {"TF_USE_LEGACY_KERAS": "1" if flavor == "tf_keras" else "0"}
