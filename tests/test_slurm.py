"""Real Slurm: a private one-node cluster (tests/slurm_cluster.py) runs the sbatch templates.

The cluster's daemons need root and Debian's slurm-wlm and munge (scripts/bootstrap.sh --with-slurm
installs them); without them, or when the cluster does not come up, every test here skips with the reason
(and the daemons' logs). There is no slurmdbd, so job states come from `scontrol show job`.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import BIN, ROOT
from slurm_cluster import ClusterUnavailable, SlurmCluster

CPU_TEMPLATE = ROOT / "scripts" / "slurm" / "cpu_nodes.sbatch"
WATCHDOG_WORKER = ROOT / "tests" / "multirank" / "watchdog_checks.py"
LAUNCH_WORKER = ROOT / "tests" / "multirank" / "launch_checks.py"
HOST = socket.gethostname()
TEST_DIGITS = 360  # scripts/examples/make_digits_dataset.py's test split
ONE_NODE = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=6"]


@pytest.fixture(scope="session")
def cluster():
    try:
        cluster = SlurmCluster()
        cluster.start()
    except ClusterUnavailable as e:
        pytest.skip(f"no test Slurm cluster on this machine: {e}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    out = tmp_path_factory.mktemp("slurm-data") / "digits"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "examples" / "make_digits_dataset.py"), str(out), "--size", "16"],
                   check=True, capture_output=True, timeout=300, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    return out


def job_env(cluster, **extra):
    """What sbatch exports to the job: this venv's Python, node-local disk inside the cluster's dir."""
    return {"PY": sys.executable, "TMPDIR": str(cluster.dir / "tmp"), "TF_CPP_MIN_LOG_LEVEL": "2", **extra}


def explain(cluster, info, text):
    return f"{info}\n--- job output (tail)\n{text[-4000:]}\n{cluster.log_tail(8)}"


def test_cpu_template_stages_trains_and_reports_global_accuracy(cluster, digits, tmp_path):
    out = tmp_path / "cpu.out"
    job = cluster.sbatch([*ONE_NODE, f"--output={out}", f"--chdir={ROOT}", CPU_TEMPLATE,
                          "--model", "mnist_cnn", "--image_size", "16", "--num_classes", "10",
                          "--batch_size", "32", "--epochs", "1", "--eval_dir", digits / "test",
                          "--display_every", "10"],
                         env=job_env(cluster, DATA=str(digits / "train")))
    info = cluster.wait(job, timeout=360)
    text = out.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), explain(cluster, info, text)
    # the staging step ran on the node and training read its copy, not the source
    staged = re.search(r"^tfdist-cpu: staged on every node into (\S+)$", text, re.M).group(1)
    assert staged.startswith(str(cluster.dir / "tmp" / "tfdist-stage")), text[-3000:]
    assert f"Data: {staged}" in text and os.path.exists(os.path.join(staged, "manifest.json"))
    # two srun tasks formed one 2-rank Horovod job
    assert f"tfdist-cpu: training, 2 tasks on {HOST}:" in text
    assert "Mode: tfdist  ranks: 2  batch/replica: 32  global batch: 64" in text, text[-3000:]
    # training finished, and the accuracy is over all 360 test digits (both ranks' halves)
    assert re.search(r"^total images/sec: [\d.]+$", text, re.M), text[-3000:]
    accuracy = float(re.search(r"^final test accuracy: ([\d.]+)", text, re.M).group(1))
    assert accuracy * TEST_DIGITS == pytest.approx(round(accuracy * TEST_DIGITS), abs=1e-3)
    assert "Traceback" not in text
    completed = (cluster.dir / "jobcomp.txt").read_text()
    assert re.search(rf"JobId={job} .*JobState=COMPLETED .*ProcCnt=2 ", completed), completed


def test_killed_task_ends_the_job_with_the_watchdog_message(cluster, tmp_path):
    """Rank 1 is SIGKILLed mid-training: rank 0 names it, and Slurm records a failed job. The
    tasks run under PMI-2 (`srun --mpi=pmi2`, a common MpiDefault), which must take tfdist's Gloo
    path: Horovod's Open MPI cannot start from PMI-2."""
    out = tmp_path / "kill.out"
    marks = tmp_path / "marks"
    marks.mkdir()
    job = cluster.sbatch([*ONE_NODE, f"--output={out}", f"--chdir={ROOT}", CPU_TEMPLATE,
                          "--out", marks, "--mode", "train"],
                         env=job_env(cluster, TRAIN=str(WATCHDOG_WORKER), SLURM_MPI_TYPE="pmi2",
                                     PYTHONPATH=str(ROOT)))
    deadline = time.monotonic() + 240
    while not all((marks / f"ready{r}").exists() for r in (0, 1)):
        info = cluster.job(job)
        if info["JobState"] not in ("PENDING", "RUNNING") or time.monotonic() > deadline:
            cluster.cli(["scancel", job], check=False)
            pytest.fail("the ranks never reached step 20: " + explain(cluster, info, out.read_text()))
        time.sleep(1)
    pid = int((marks / "ready1").read_text())
    task_env = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
    assert "PMI_RANK=1" in task_env and "SLURM_PROCID=1" in task_env  # a PMI-2 srun task
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    info = cluster.wait(job, timeout=90)
    seconds = time.monotonic() - killed
    text = out.read_text()
    print(f"\njob {job} ended {seconds:.1f} s after the kill: JobState={info['JobState']} "
          f"ExitCode={info['ExitCode']}; " + next((l for l in text.splitlines() if "tfdist watchdog:" in l), "<none>"))
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0", explain(cluster, info, text)
    assert f"tfdist watchdog: rank 1 (host {HOST}, pid {pid}) died" in text, explain(cluster, info, text)
    assert "MPI_Init" not in text and seconds < 60


def test_tfdist_run_in_an_allocation_uses_srun_and_mpi_from_pmix(cluster, tmp_path):
    """`salloc -n 2 tfdist-run -np 2 ...` picks srun. With `--mpi=pmix` (where Slurm has the
    plugin) the tasks take Horovod's MPI controller, without tfdist's rendezvous; without it, the
    Gloo path (as in the tests above). Either way the ranks end bit-identical."""
    listed = cluster.cli(["srun", "--mpi=list"])
    pmix = "pmix" in listed.stdout + listed.stderr
    extra = ["--launcher-args=--mpi=pmix"] if pmix else []
    out = cluster.cli(["salloc", "--ntasks=2", "--time=5", BIN / "tfdist-run", "-np", "2", *extra,
                       "python", LAUNCH_WORKER, "--out", tmp_path], timeout=300, check=False,
                      env=cluster.env({"PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"}), cwd=ROOT)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:] + cluster.log_tail(8)
    srun = f"tfdist-run: srun: {shutil.which('srun')} --ntasks=2 --kill-on-bad-exit=1"
    assert srun + (" --mpi=pmix " if pmix else f" {sys.executable} ") in text, text[-3000:]
    ranks = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    for r, result in ranks.items():
        assert (result["topology"]["rank"], result["topology"]["size"]) == (r, 2)
        # tfdist's Slurm path sets HOROVOD_CONTROLLER=gloo; under PMIx it must stay out of the way
        assert result["horovod_env"].get("HOROVOD_CONTROLLER") == (None if pmix else "gloo"), result
    for a, b in zip(ranks[0]["final"], ranks[1]["final"]):
        assert np.array_equal(a, b)
    if not pmix:
        print("\nthis Slurm has no pmix MPI plugin: the MPI path under srun was not run")


PREEMPT_WORKER = ROOT / "tests" / "multirank" / "preemption_checks.py"


def test_preempted_job_is_requeued_and_resumes_exactly(cluster, tmp_path):
    """The template's preemption path on real Slurm: `scancel --signal=USR1 --batch` (what
    `--signal=B:USR1@120` sends before the time limit) mid-epoch; the ranks save and exit 75, the
    template requeues, and the second run resumes and ends equal to an uninterrupted run."""
    out, work, results = tmp_path / "preempt.out", tmp_path / "work", tmp_path / "results"
    job = cluster.sbatch([*ONE_NODE, f"--output={out}", f"--chdir={ROOT}", CPU_TEMPLATE,
                          "--phase", "slurm", "--work", work, "--out", results],
                         env=job_env(cluster, TRAIN=str(PREEMPT_WORKER), PYTHONPATH=str(ROOT)))
    deadline = time.monotonic() + 240
    while not (work / "ready").exists():
        info = cluster.job(job)
        if info["JobState"] not in ("PENDING", "RUNNING") or time.monotonic() > deadline:
            cluster.cli(["scancel", job], check=False)
            pytest.fail("the job never reached epoch 2: " + explain(cluster, info, out.read_text() if out.exists() else ""))
        time.sleep(0.2)
    signalled = time.monotonic()
    cluster.cli(["scancel", "--signal=USR1", "--batch", job])
    deadline = time.monotonic() + 300
    while True:
        info = cluster.job(job)
        done = all((results / f"rank{r}.json").exists() for r in (0, 1))
        if info["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") and (done or info["JobState"] != "COMPLETED"):
            break
        if time.monotonic() > deadline:
            cluster.cli(["scancel", job], check=False)
            pytest.fail("the requeued job did not finish: " + explain(cluster, info, out.read_text()))
        time.sleep(1)
    text = out.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), explain(cluster, info, text)
    assert info.get("Restarts") == "1", explain(cluster, info, text)
    assert "requeueing job" in text and "tfdist-run: job preempted (SIGUSR1" in text, text[-4000:]
    stopped = [json.loads((work / "slurm" / f"rank{r}-stopped" / f"rank{r}.json").read_text()) for r in (0, 1)]
    resumed = [json.loads((work / "slurm" / f"rank{r}-finished" / f"rank{r}.json").read_text()) for r in (0, 1)]
    reference = [json.loads((work / "slurm-reference" / f"rank{r}-finished" / f"rank{r}.json").read_text())
                 for r in (0, 1)]
    print(f"\njob {job}: stopped {stopped[0]['exit_time'] - stopped[0]['signal_time']:.1f} s after rank 0 was "
          f"ready for the signal; steps trained {stopped[0]['trained_to']} + "
          f"{resumed[0]['trained_to'] - resumed[0]['trained_from']}; whole job {time.monotonic() - signalled:.0f} s "
          "after the signal")
    for r in (0, 1):
        assert stopped[r]["exit_code"] == 75
        assert resumed[r]["trained_from"] == stopped[r]["trained_to"]
        assert stopped[r]["trained_to"] + resumed[r]["trained_to"] - resumed[r]["trained_from"] == 60
        for mine, expected in zip(resumed[r]["variables"], reference[r]["variables"]):
            np.testing.assert_allclose(mine, expected, atol=1e-5)
