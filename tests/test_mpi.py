"""Real Open MPI jobs: `mpirun -np 2`, `tfdist-run --launcher mpirun`, a killed rank, Adasum, bfloat16.

Few launches, many checks: one 2-rank job per Keras flavour (Keras 3 through
`tfdist-run --launcher mpirun`, tf-keras under the bare mpirun command it builds) runs
tests/multirank/mpi_checks.py, which trains with op="average" and with op="adasum"; one
1-process reference per flavour; one Keras 3 job whose rank 1 is killed.
"""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import bf16_reference
from conftest import (BIN, EXIT_LIMIT_S, ROOT, WATCHDOG_WORKER, flavor_env, kill_group, make_job_env, run_job,
                      signal_rank)

HOST = socket.gethostname()
WORKER = ROOT / "tests" / "multirank" / "mpi_checks.py"
LAUNCHERS = {"keras3": "tfdist-run mpirun", "tf_keras": "mpirun"}
pytestmark = pytest.mark.multirank

_cache = {}


def _missing_mpi():
    """Why this machine cannot run real Open MPI jobs, or None."""
    mpirun = shutil.which("mpirun")
    if not mpirun:
        return "no mpirun on the PATH: bash scripts/bootstrap.sh --with-mpi (as root) installs Open MPI"
    version = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30).stdout
    if "Open MPI" not in version:
        return f"mpirun is not Open MPI ({version.strip()[:60]!r}); tfdist-run's mpirun flags are Open MPI's"
    from tfdist import collectives

    if not collectives.horovod().mpi_built():
        return "Horovod was built without MPI (horovodrun -cb lists no MPI): rerun scripts/bootstrap.sh --with-mpi"
    return None


@pytest.fixture(scope="module")
def mpi():
    reason = _missing_mpi()
    if reason:
        pytest.skip(reason)


def mpi_results(flavor, tmp_path_factory):
    """The 2-rank mpirun job and its 1-process reference, once per Keras flavour."""
    if flavor not in _cache:
        base = tmp_path_factory.mktemp(f"mpi-{flavor}")
        env = flavor_env(flavor)
        ranks = run_job([WORKER], base / "ranks", np=2, env=env, launcher=LAUNCHERS[flavor])
        reference = run_job([WORKER, "--reference"], base / "ref", np=None, env=env)
        _cache[flavor] = (ranks, reference[0])
    return _cache[flavor]


def numpy_adasum(a, b):
    """Adasum of two ranks' gradients of one tensor (Maleki et al.; Horovod applies it per tensor)."""
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    dot = a @ b
    return (1 - dot / (2 * (a @ a))) * a + (1 - dot / (2 * (b @ b))) * b


def test_ranks_run_under_mpi(mpi, keras_flavor, tmp_path_factory):
    ranks, reference = mpi_results(keras_flavor, tmp_path_factory)
    for rank in (0, 1):
        launch = ranks[rank]["launch"]
        assert (launch["rank"], launch["size"], launch["ompi_rank"]) == (rank, 2, str(rank))
        assert launch["mpi_enabled"] and not launch["gloo_enabled"], launch
        assert launch["transport"] == "collectives MPI on CPU"   # no launcher advice under mpirun
        assert launch["keras"] == ("tf_keras" if keras_flavor == "tf_keras" else "keras")
        # tfdist-run starts every rank through tfdist.tuning.startup (else `import tfdist` applies it),
        # with Open MPI's local rank; -bind-to none leaves the pinning to tfdist
        startup = launch["startup"]
        assert (startup["route"] == "tfdist-run") == (LAUNCHERS[keras_flavor] == "tfdist-run mpirun"), startup
        assert startup["layout"] == [rank, 2] and not startup["bound_by_launcher"], startup
        # HorovodStrategy(tuning=False) leaves Open MPI's own default, as Open MPI reports it (MPI_T);
        # with tuning it yields (test_benchmark's tfdist@mpirun run, test_open_mpi_waiting_... here)
        assert launch["open_mpi_waiting"] == "spins", launch
    pinned = [set(ranks[r]["launch"]["startup"]["pinned"]) for r in (0, 1)]
    assert not (pinned[0] & pinned[1]), pinned  # each rank its own cores (none pinned: both empty)
    assert reference["launch"]["size"] == 1 and reference["launch"]["ompi_rank"] is None
    assert reference["launch"]["open_mpi_waiting"] is None, reference["launch"]


def test_open_mpi_waiting_is_what_open_mpi_reports_and_the_users_choice_wins(mpi):
    from tfdist.tuning import horovod_env

    code = ("import tfdist, horovod.tensorflow as hvd; from tfdist.tuning import horovod_env; "
            "chosen = horovod_env.set_horovod_defaults(); hvd.init(); "
            "print('WAITING', horovod_env.open_mpi_waiting(), horovod_env.OPEN_MPI_YIELD in chosen)")
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    for user, expected in ((None, "yields True"), ("0", "spins False")):
        env = {k: v for k, v in os.environ.items() if k != horovod_env.OPEN_MPI_YIELD}
        if user is not None:
            env[horovod_env.OPEN_MPI_YIELD] = user   # as `mpirun --mca mpi_yield_when_idle 0` sets it
        done = subprocess.run(["mpirun", *root, "-np", "1", sys.executable, "-c", code], env=env,
                              capture_output=True, text=True, timeout=300)
        assert f"WAITING {expected}" in done.stdout, (user, done.stdout[-2000:], done.stderr[-2000:])


def test_mpirun_two_ranks_equal_one_process_with_global_metrics(mpi, keras_flavor, tmp_path_factory):
    ranks, reference = mpi_results(keras_flavor, tmp_path_factory)
    two, ref = ranks[0]["average"], reference["average"]
    assert ranks[1]["average"]["initial"] == two["initial"]  # rank 0's weights, broadcast
    assert ranks[1]["average"]["final"] == two["final"]  # bit for bit
    for mine, theirs in zip(two["final"], ref["final"]):
        np.testing.assert_allclose(np.array(mine), np.array(theirs), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.array(two["final"][0]), np.array(two["initial"][0]))
    # History and evaluate() are the global ones: equal on both ranks and to one process
    assert ranks[1]["average"]["history"] == two["history"]
    assert set(two["history"]) == set(ref["history"]) >= {"loss", "accuracy"}
    for key in ref["history"]:
        np.testing.assert_allclose(two["history"][key], ref["history"][key], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(two["evaluate"], ref["evaluate"], rtol=1e-5, atol=1e-6)


def test_bf16_allreduce_on_mpi_is_numpys_float32_sum_rounded_once(mpi, keras_flavor, tmp_path_factory):
    ranks, _ = mpi_results(keras_flavor, tmp_path_factory)
    exchange = {r: ranks[r]["bf16_exchange"] for r in (0, 1)}
    assert exchange[0]["controller"] == "mpi"
    bf16_reference.check_exchange(exchange)


def test_adasum_exchange_is_the_adasum_of_the_local_gradients(mpi, keras_flavor, tmp_path_factory):
    ranks, _ = mpi_results(keras_flavor, tmp_path_factory)
    local = [ranks[r]["adasum_exchange"]["local"] for r in (0, 1)]
    exchanged = ranks[0]["adasum_exchange"]["exchanged"]
    assert ranks[1]["adasum_exchange"]["exchanged"] == exchanged  # bit for bit
    assert len(exchanged) == 2  # kernel and bias, each combined on its own
    for a, b, got in zip(*local, exchanged):
        expected = numpy_adasum(a, b).reshape(np.shape(got))
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
        # not the average (the same formula without undoing Keras' 1/N would give about that), nor the sum
        assert not np.allclose(got, (np.array(a) + np.array(b)) / 2, rtol=1e-3)
        assert not np.allclose(got, np.array(a) + np.array(b), rtol=1e-3)
    # per tensor, not over all gradients at once
    whole = numpy_adasum(np.concatenate([np.ravel(t) for t in local[0]]),
                         np.concatenate([np.ravel(t) for t in local[1]]))
    assert not np.allclose(np.concatenate([np.ravel(t) for t in exchanged]), whole, rtol=1e-4)


def test_adasum_combines_a_sparse_gradient_beside_dense_ones_densified(mpi, keras_flavor, tmp_path_factory):
    # An Embedding's tf.IndexedSlices gradient with repeated ids, beside the Dense kernel and bias:
    # Horovod's Adasum has no sparse form, so it is densified and combined per tensor as the others.
    ranks, _ = mpi_results(keras_flavor, tmp_path_factory)
    result = ranks[0]["adasum_sparse_exchange"]
    assert result["sparse_locally"] == [True, False, False]
    local = [ranks[r]["adasum_sparse_exchange"]["local"] for r in (0, 1)]
    assert ranks[1]["adasum_sparse_exchange"]["exchanged"] == result["exchanged"]
    for a, b, got in zip(*local, result["exchanged"]):
        np.testing.assert_allclose(got, numpy_adasum(a, b).reshape(np.shape(got)), rtol=1e-5, atol=1e-6)


def test_adasum_with_global_clipnorm_clips_the_combined_gradient(mpi, keras_flavor, tmp_path_factory):
    """Issue 30: the optimizer clips what it applies, the Adasum of the ranks' gradients (had each
    rank clipped its own part first, the result would differ)."""
    ranks, _ = mpi_results(keras_flavor, tmp_path_factory)
    local = [ranks[r]["adasum_clipped_exchange"]["local"] for r in (0, 1)]
    exchanged = ranks[0]["adasum_clipped_exchange"]["exchanged"]
    assert ranks[1]["adasum_clipped_exchange"]["exchanged"] == exchanged
    combined = [numpy_adasum(a, b) for a, b in zip(*local)]
    norm = np.sqrt(sum(float(c @ c) for c in combined))
    assert norm > 2 * 0.05  # the clip engages
    for c, got in zip(combined, exchanged):
        np.testing.assert_allclose(got, (c * 0.05 / norm).reshape(np.shape(got)), rtol=1e-4, atol=1e-7)


def test_adasum_training_loss_falls(mpi, keras_flavor, tmp_path_factory):
    ranks, _ = mpi_results(keras_flavor, tmp_path_factory)
    fit = ranks[0]["adasum_fit"]
    assert ranks[1]["adasum_fit"]["final"] == fit["final"]
    print(f"\nadasum fit ({keras_flavor}): loss per epoch {[round(l, 4) for l in fit['loss']]}")
    assert all(b < a for a, b in zip(fit["loss"], fit["loss"][1:])), fit["loss"]
    assert fit["loss"][-1] < 0.5 * fit["loss"][0], fit["loss"]


def test_adasum_is_refused_on_gloo_and_on_odd_rank_counts(mpi, monkeypatch):
    from tfdist import collectives

    collectives.init()  # one process: Horovod's MPI controller (an Open MPI singleton)
    assert collectives.adasum_refusal() is None
    odd = collectives.adasum_refusal(size=3)
    assert "power-of-2 number of ranks" in odd and "has 3" in odd
    monkeypatch.setattr(collectives.horovod(), "mpi_enabled", lambda: False)
    gloo = collectives.adasum_refusal(size=2)
    assert "runs on Gloo" in gloo and "tfdist-run --launcher mpirun" in gloo


def test_mpirun_command_works_here_and_on_clusters():
    from tfdist.launch.runner import build_command

    py = sys.executable
    env = {"PATH": "/bin", "PYTHONPATH": "/src", "TF_USE_LEGACY_KERAS": "1", "TF_CONFIG": "{}",
           "TFDIST_WATCHDOG_TIMEOUT": "9", "HOME": "/root", "OMP_NUM_THREADS": "4"}
    local = build_command("mpirun", ["python", "t.py"], np=2, env=env, as_root=True)
    assert local[1:] == ["--allow-run-as-root", "-np", "2", "-H", "localhost:2", "-bind-to", "none",
                         "-map-by", "slot", "-x", "PATH", "-x", "PYTHONPATH", "-x", "TFDIST_WATCHDOG_TIMEOUT",
                         "-x", "TF_USE_LEGACY_KERAS", py, "t.py"]
    cluster = build_command("mpirun", ["python", "t.py"], np=8, hosts="n1:4,n2:4", env=env, as_root=False)
    assert cluster[1:7] == ["-np", "8", "-H", "n1:4,n2:4", "-bind-to", "none"]
    allocation = build_command("mpirun", ["python", "t.py"], np=8, env={"SLURM_JOB_ID": "7"}, as_root=False)
    assert allocation[1:] == ["-np", "8", "-bind-to", "none", "-map-by", "slot", py, "t.py"]


def test_killed_rank_under_mpirun_names_rank_and_host(mpi, tmp_path):
    """SIGKILL rank 1 mid-training: the job ends non-zero, bounded, the watchdog naming rank 1."""
    log = open(tmp_path / "job.log", "w")
    proc = subprocess.Popen(
        [str(BIN / "tfdist-run"), "--launcher", "mpirun", "-np", "2", sys.executable, str(WATCHDOG_WORKER),
         "--mode", "train", "--out", str(tmp_path)],
        cwd=ROOT, env=make_job_env({"PYTHONUNBUFFERED": "1"}), stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True)
    log.close()
    pids = None
    try:
        pids, seconds = signal_rank(tmp_path, [proc], signal.SIGKILL, [tmp_path / "job.log"])
        rank0_exited = time.monotonic()
        proc.wait(timeout=30)
        job_seconds = seconds + time.monotonic() - rank0_exited
    finally:
        kill_group(proc, grace=20)  # SIGTERM first: mpirun stops its ranks (each in its own process group)
        for pid in pids or ():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # mpirun's ranks are not in its process group
    text = (tmp_path / "job.log").read_text()
    print(f"\nunder mpirun, rank 0 exited {seconds:.2f} s and mpirun {job_seconds:.2f} s after rank 1 was killed")
    assert seconds < EXIT_LIMIT_S and proc.returncode != 0, text[-3000:]
    assert f"tfdist watchdog: rank 1 (host {HOST}, pid {pids[1]}) died" in text, text[-3000:]
