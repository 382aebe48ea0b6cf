"""`tfdist-run --max-restarts` / `--min-np`: failed jobs relaunch by themselves and resume.

Unit tests of the restart rule, the cause analysis and the rank planning (no TensorFlow), the
loop itself on a fake launcher, then real jobs: a 2-rank job SIGKILLed twice mid-epoch that ends
equal to an uninterrupted run (both Keras flavours), and a 3-rank job that loses a host for good
and finishes on 2 ranks at the digits accuracy target.
"""

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ROOT, communicate_or_kill, flavor_env, make_job_env, read_results
from tfdist.launch import recovery
from tfdist.launch.recovery import Failure, analyse, decide, plan_ranks

WORKER = ROOT / "tests" / "multirank" / "recovery_checks.py"
WATCHDOG_LINE = ("[0]<stderr>:tfdist watchdog: rank 1 (host n2, pid 4242) died: its connection closed "
                 "without a goodbye (killed, crashed, or out of memory). Stopping every rank with exit "
                 "code 3 so that no rank waits forever in a collective.")


# --- the cause of a failure ---------------------------------------------------------------

def test_unit_cause_from_horovodrun_and_watchdog():
    lines = ["[1]<stdout>:epoch 1", WATCHDOG_LINE, "Process name: 1", "[0]<stdout>:a line between", "Exit code: 137"]
    failure = analyse(1, lines)
    assert failure.cause == "rank 1 (host n2) was killed by SIGKILL (exit code 137)"
    assert (failure.rank, failure.host, failure.retry) == (1, "n2", True)
    # the launcher alone, no watchdog line
    assert analyse(1, ["Process name: 1", "Exit code: 137"]).cause == "rank 1 was killed by SIGKILL (exit code 137)"
    # an exception relayed by the watchdog: its last line is the cause
    raised = analyse(1, ["tfdist watchdog: rank 0 (host n1, pid 9) failed: OSError: disk quota exceeded. "
                         "Stopping every rank with exit code 3 so ...", "Process name: 0", "Exit code: 1"])
    assert raised.cause == "rank 0 (host n1) failed: OSError: disk quota exceeded" and raised.retry


def test_unit_cause_from_mpirun_srun_and_bare_status():
    mpi = analyse(137, ["mpirun noticed that process rank 2 with PID 77 on node gpu3 exited on signal 9 (Killed)."])
    assert mpi.cause == "rank 2 (host gpu3) was killed by SIGKILL" and mpi.rank == 2
    srun = analyse(137, ["srun: error: node7: task 5: Killed"])
    assert srun.cause == "rank 5 (host node7) Killed" and srun.host == "node7"
    assert analyse(-15, []).cause == "the job was killed by SIGTERM (launcher exit status)"
    # horovodrun names the rank only: the host comes from the launch's own host list
    hosts = [("n1", 2), ("n2", 2)]
    named = analyse(1, ["Process name: 2", "Exit code: 137"], lambda r: recovery._host_of_rank(r, hosts, ["horovodrun"]))
    assert named.cause == "rank 2 (host n2) was killed by SIGKILL (exit code 137)"
    assert recovery._host_of_rank(1, None, ["/usr/bin/srun"]) is None


def test_unit_usage_and_deterministic_errors_are_not_restarted():
    usage = analyse(1, ["Process name: 0", "Exit code: 2", "[0]<stderr>:usage: train.py [-h] --data DATA",
                        "[0]<stderr>:train.py: error: the following arguments are required: --data"])
    assert not usage.retry and "usage error" in usage.why_not
    for line in ["ModuleNotFoundError: No module named 'trian'",
                 "[1]<stderr>:tfdist.errors.RankMismatchError: ranks disagree",
                 "NonFiniteLossError: non-finite loss (nan) at epoch 1"]:
        failure = analyse(1, ["Traceback (most recent call last):", line, "Process name: 0", "Exit code: 1"])
        assert not failure.retry, line
    assert decide(usage, [], 0, 5) == (False, "not restarting: a usage error (the command line is wrong; "
                                              "fix it and rerun)")


def test_unit_restart_rule():
    killed = Failure(1, "rank 1 (host n2) was killed by SIGKILL", 1, "n2", progress=1)
    assert decide(killed, [], 0, 2) == (True, "relaunching")
    assert decide(killed, [], 2, 2)[1] == "restarts exhausted (2 of --max-restarts 2 used)"
    # the same failure with a newer checkpoint in between: progress, so go on
    later = Failure(1, "rank 1 (host n2) was killed by SIGKILL", 1, "n2", progress=2)
    assert decide(later, [killed], 1, 3)[0]
    # the same failure at the same checkpoint: it would repeat forever
    again = Failure(1, "rank 1 (host n2) was killed by SIGKILL", 1, "n2", progress=1)
    go, why = decide(again, [killed], 1, 3)
    assert not go and "no progress" in why and "epoch 1" in why
    # another rank failing at the same checkpoint is another fault: relaunch
    other = Failure(1, "rank 0 (host n1) was killed by SIGKILL", 0, "n1", progress=1)
    assert decide(other, [killed], 1, 3)[0]


def test_unit_rank_planning_keeps_the_global_batch():
    assert plan_ranks(3, 3, [("a", 2), ("b", 1)]) == (3, [("a", 2), ("b", 1)])
    assert plan_ranks(4, 2, [("a", 2), ("b", 2)], global_batch=48) == (4, [("a", 2), ("b", 2)])
    # 3 slots left but 64 does not divide by 3: go on with 2, the largest count that keeps it
    assert plan_ranks(4, 2, [("a", 2), ("b", 1)], global_batch=64) == (2, [("a", 2)])
    with pytest.raises(recovery.RecoveryError, match=r"only 1 slot\(s\) left on a:1, fewer than --min-np 2"):
        plan_ranks(3, 2, [("a", 1)])
    with pytest.raises(recovery.RecoveryError, match=r"--global-batch 50 cannot be kept on 3 to 3 ranks.*e\.g\. 12"):
        plan_ranks(4, 3, [("a", 3)], global_batch=50)


def test_unit_host_lines_and_slurm_discovery():
    assert recovery.parse_host_lines("# hosts\nn1:2\nn2\nn3:0\n", "x") == [("n1", 2), ("n2", 1)]
    with pytest.raises(recovery.RecoveryError, match="x: expected host"):
        recovery.parse_host_lines("n1:two\n", "x")

    def fake_run(argv, **kwargs):
        out = {"scontrol": "JobId=5 NodeList=n[1-3] NumNodes=3\n", "sinfo": "n1 alloc\nn2 down*\nn3 mix\n"}
        return subprocess.CompletedProcess(argv, 0, out[argv[0]], "")

    env = {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n[1-3]"}
    assert recovery.slurm_hosts(2, env, run=fake_run) == [("n1", 2), ("n3", 2)]


# --- the loop, on a fake launcher (no TensorFlow) --------------------------------------------

FAKE_JOB = """
import os, sys
k = int(os.environ["TFDIST_RESTART"])
print("launch", k, sys.argv[1], os.environ.get("TFDIST_RESTART_CAUSE"), flush=True)
if k < int(sys.argv[2]):
    print("Process name: 1\\nExit code: 137", file=sys.stderr)
    with open(os.environ["TFDIST_PROGRESS_FILE"], "w") as f:
        f.write('{"epoch": %d, "path": "ckpt"}' % (k + 1))
    sys.exit(1)
"""


FAKE_PREEMPTED_JOB = """
import os, sys
k = int(os.environ["TFDIST_RESTART"])
print("launch", k, flush=True)
if k < int(sys.argv[2]):  # what horovodrun shows of ranks that stopped gracefully: exit 1, their line
    print("[0]<stderr>:tfdist preemption: SIGTERM on rank 1 (host n2): every rank stopped together; saved after "
          "epoch 1, batch %d by Checkpointer (c). Exit code 75 (preempted; resumable): run the same command again "
          "to continue." % (k + 4), file=sys.stderr)
    print("Process name: 1\\nExit code: 75", file=sys.stderr)
    sys.exit(int(os.environ.get("FAKE_LAUNCHER_STATUS", "1")))  # horovodrun sent SIGTERM once exited 0
"""


def supervise_fake(tmp_path, failures, max_restarts, hosts_text=None, min_np=None, job_text=FAKE_JOB):
    """Run `recovery.supervise` in a child process on a fake job that fails `failures` times."""
    job = tmp_path / "job.py"
    job.write_text(job_text)
    discovery = None
    if hosts_text is not None:
        discovery = tmp_path / "hosts.sh"
        discovery.write_text(f"#!/bin/sh\necho '{hosts_text}'\n")
        discovery.chmod(0o755)
    code = (f"import sys; from tfdist import recovery; sys.exit(recovery.supervise("
            f"lambda np_, hosts: [sys.executable, {str(job)!r}, str(np_), '{failures}'], 2, None, "
            f"max_restarts={max_restarts}, min_np={min_np}, "
            f"discovery_script={str(discovery) if discovery else None!r}))")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_unit_loop_relaunches_logs_causes_and_passes_the_restart(tmp_path):
    out = supervise_fake(tmp_path, failures=2, max_restarts=2)
    assert out.returncode == 0, out.stderr
    assert "launch 0 2 None" in out.stdout
    here = socket.gethostname()  # the fake launcher ran its "ranks" here
    assert f"launch 2 2 rank 1 (host {here}) was killed by SIGKILL (exit code 137) (newest checkpoint: epoch 2)" in out.stdout
    assert (f"tfdist-run: restart 1/2 after rank 1 (host {here}) was killed by SIGKILL (exit code 137) (newest checkpoint: "
            "epoch 1); relaunching on 2 rank(s)") in out.stderr
    assert "restart 2/2 after" in out.stderr and "job finished after 2 restart(s)" in out.stderr


def test_unit_loop_resumes_a_preempted_job_as_long_as_restarts_last(tmp_path):
    # only the ranks were signalled (tfdist-run was not): the allocation goes on, so resume
    out = supervise_fake(tmp_path, failures=2, max_restarts=2, job_text=FAKE_PREEMPTED_JOB)
    assert out.returncode == 0, out.stderr
    assert ("tfdist-run: restart 1/2 after preemption (SIGTERM on rank 1 (host n2); saved after epoch 1, batch 4 "
            "by Checkpointer (c)); relaunching on 2 rank(s)") in out.stderr
    assert "restart 2/2 after preemption" in out.stderr and out.stdout.count("launch") == 3
    used_up = supervise_fake(tmp_path, failures=3, max_restarts=2, job_text=FAKE_PREEMPTED_JOB)
    assert used_up.returncode == 75, used_up.stderr
    assert ("tfdist-run: job preempted (SIGTERM on rank 1 (host n2); saved after epoch 1, batch 6 by Checkpointer "
            "(c)); not restarting (restarts used up: 2 of --max-restarts 2). Exit status 75") in used_up.stderr
    os.environ["FAKE_LAUNCHER_STATUS"] = "0"  # the ranks' stop line decides, whatever the launcher's status
    try:
        launcher_said_0 = supervise_fake(tmp_path, failures=3, max_restarts=2, job_text=FAKE_PREEMPTED_JOB)
    finally:
        del os.environ["FAKE_LAUNCHER_STATUS"]
    assert launcher_said_0.returncode == 75 and "restart 2/2 after preemption" in launcher_said_0.stderr


def test_unit_loop_gives_up_loudly(tmp_path):
    out = supervise_fake(tmp_path, failures=3, max_restarts=2)
    assert out.returncode == 1
    assert (f"tfdist-run: giving up: rank 1 (host {socket.gethostname()}) was killed by SIGKILL (exit code 137) (newest checkpoint: "
            "epoch 3); restarts exhausted (2 of --max-restarts 2 used). Exit status 1.") in out.stderr
    clean = supervise_fake(tmp_path, failures=0, max_restarts=2)
    assert clean.returncode == 0 and "restart" not in clean.stderr and clean.stdout.count("launch") == 1
    few = supervise_fake(tmp_path, failures=1, max_restarts=2, hosts_text="localhost:1", min_np=2)
    assert few.returncode == 2 and "only 1 slot(s) left on localhost:1, fewer than --min-np 2" in few.stderr


def test_unit_run_flags_usage_errors_and_dry_run():
    def tfdist_run(*argv):
        return subprocess.run([sys.executable, "-m", "tfdist.launch.runner", *argv], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)

    out = tfdist_run("--dry-run", "-np", "2", "--max-restarts", "2", "python", "train.py")
    assert out.returncode == 0 and "horovodrun -np 2 --gloo" in out.stdout
    assert "supervised: up to 2 restart(s), at least 2 rank(s)" in out.stderr
    assert "--min-np 3: expected 1 to -np 2" in tfdist_run("-np", "2", "--min-np", "3", "python", "t.py").stderr
    both = tfdist_run("-H", "a:1", "--host-discovery-script", "/bin/true", "--max-restarts", "1", "python", "t.py")
    assert both.returncode == 2 and "either -H or --host-discovery-script" in both.stderr


# --- real jobs ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """The digits example's split: 1,437 training records as a tfdist dataset, the test arrays beside."""
    pytest.importorskip("sklearn")
    from tfdist.pipelines import write_arrays
    sys.path.insert(0, str(ROOT / "scripts" / "examples"))
    from digits_cnn import load_digits_split

    (x, y), (x_test, y_test) = load_digits_split()
    root = tmp_path_factory.mktemp("digits")
    write_arrays({"x": x.reshape(len(x), 64), "y": y.astype("int64")}, root / "train", min_shards=4)
    np.savez(root / "test.npz", x=x_test.reshape(len(x_test), 64), y=y_test)
    return root / "train"


def tfdist_run_job(flags, data, tmp_path, env, epochs, timeout=420):
    """tfdist-run FLAGS python recovery_checks.py ...: (exit status, stderr, {rank: results})."""
    out = tmp_path / "out"
    out.mkdir()
    command = [sys.executable, "-m", "tfdist.launch.runner", *flags, "python", str(WORKER), "--data", str(data),
               "--ckpt", str(tmp_path / "ckpt"), "--out", str(out), "--epochs", str(epochs)]
    proc = subprocess.Popen(command, cwd=ROOT, env=make_job_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    started = time.monotonic()
    stdout, stderr, timed_out = communicate_or_kill(proc, timeout)
    if timed_out:
        pytest.fail(f"tfdist-run timed out after {timeout}s\n{stderr[-4000:]}")
    print(f"\n{' '.join(flags)}: {time.monotonic() - started:.1f} s, exit {proc.returncode}")
    print("\n".join(l for l in stderr.splitlines() if l.startswith("tfdist-run:")))
    results = read_results(out)
    logs = {int(p.stem.split("rank")[1]): [tuple(map(int, l.split())) for l in p.read_text().splitlines()]
            for p in out.glob("epochs-rank*.log")}
    return proc.returncode, stdout + stderr, stderr, results, logs, out


@pytest.mark.multirank
def test_killed_twice_mid_epoch_ends_equal_to_an_uninterrupted_run(keras_flavor, digits, tmp_path):
    # launch 0: rank 1 dies at epoch 1 step 5; launch 1: at epoch 2 step 3; launch 2 finishes
    env = {**flavor_env(keras_flavor), "RECOVERY_TEST_REFERENCE": "1", "RECOVERY_TEST_KILL": "0:1:1:5,1:1:2:3"}
    code, output, stderr, results, logs, out = tfdist_run_job(
        ["-np", "2", "--max-restarts", "2"], digits, tmp_path, env, epochs=3)
    assert code == 0, output[-6000:]
    for k in (1, 2):
        assert f"tfdist-run: restart {k}/2 after rank 1 (host " in stderr
    assert stderr.count("was killed by SIGKILL") >= 2, stderr[-3000:]
    assert "(newest checkpoint: epoch 1); relaunching on 2 rank(s)" in stderr
    assert "(newest checkpoint: epoch 2); relaunching on 2 rank(s)" in stderr
    reference = {r: json.loads((out / "reference" / f"rank{r}.json").read_text()) for r in (0, 1)}
    for rank in (0, 1):
        got, want = results[rank], reference[rank]
        assert got["restart"] == 2 and got["initial_epoch"] == 2 and got["epochs_run"] == [2]
        assert got["restored_from"] == str(tmp_path / "ckpt" / "ckpt-000002")
        assert got["iterations"] == want["iterations"] == 3 * want["steps_per_epoch"]
        for a, b in zip(got["variables"], want["variables"]):
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=0, atol=1e-6)
        # the launches' epochs: killed in epoch 1, then in epoch 2; each repeats only the epoch it died in
        assert logs[rank] == [(0, 2, 0), (0, 2, 1), (1, 2, 1), (1, 2, 2), (2, 2, 2)]
    repeated = len(logs[0]) - 3
    assert repeated <= 2  # at most one epoch per failure
    for a, b in zip(results[0]["variables"], results[1]["variables"]):
        np.testing.assert_array_equal(np.array(a), np.array(b))


@pytest.mark.multirank
def test_lost_rank_goes_on_two_then_grows_back_to_three_at_the_digits_target(keras_flavor, digits, tmp_path):
    """3 ranks, then 2 (rank 2's host is gone), then 3 again once the discovery script lists it."""
    gone = tmp_path / "host-gone"
    discovery = tmp_path / "hosts.sh"
    discovery.write_text(f"#!/bin/sh\nif [ -e {gone} ]; then echo localhost:2; else echo localhost:3; fi\n")
    discovery.chmod(0o755)
    env = {**flavor_env(keras_flavor), "RECOVERY_TEST_KILL": "0:2:1:3", "RECOVERY_TEST_GONE": str(gone),
           "RECOVERY_TEST_BACK": "1:2", "TFDIST_GROW_CHECK_SECONDS": "1"}
    code, output, stderr, results, logs, _ = tfdist_run_job(
        ["-np", "3", "--min-np", "2", "--max-restarts", "1", "--host-discovery-script", str(discovery),
         "--global-batch", "48"], digits, tmp_path, env, epochs=5)
    assert code == 0, output[-6000:]
    assert "tfdist-run: restart 1/1 after rank 2 (host " in stderr
    # horovodrun reports the first process to exit: rank 2 (SIGKILL), or a survivor the watchdog
    # stopped (exit code 3), and then the watchdog's line names rank 2 and how it went
    assert "was killed by SIGKILL" in stderr or "died: its connection closed without a goodbye" in stderr
    assert "relaunching on 2 rank(s) on localhost:2" in stderr
    # back: the job stops at an epoch's end, saves it, and goes on with 3 ranks (no restart used)
    assert "tfdist-run: 3 rank(s) fit again; asking the job to stop at the end of this epoch" in stderr
    assert "tfdist-run: growing back: relaunching on 3 rank(s) on localhost:3" in stderr, stderr[-3000:]
    assert "tfdist preemption: tfdist-run: hosts for 3 ranks are back (this launch has 2): every rank stopped " \
           "together; saved at the end of epoch" in output
    assert sorted(results) == [0, 1, 2]
    for rank in (0, 1, 2):
        assert results[rank]["size"] == 3 and results[rank]["restart"] == 2
        assert results[rank]["iterations"] == 5 * results[rank]["steps_per_epoch"]
    # epochs by launch: 3 ranks (killed in epoch 1), 2 ranks from epoch 1 until the host is back
    # (it returns at the start of epoch 2), then 3 ranks from the next epoch on; none repeated
    # but the one the kill interrupted
    sizes = [(restart, size) for restart, size, _ in logs[0]]
    epochs = [epoch for _, _, epoch in logs[0]]
    assert logs[0][:4] == [(0, 3, 0), (0, 3, 1), (1, 2, 1), (1, 2, 2)], logs[0]
    assert epochs[2:] == list(range(1, 5)) and sizes[-1] == (2, 3), logs[0]
    print(f"epochs (launch, ranks, epoch): {logs[0]}")
    # the digits example's target (tests/test_example.py), on the same held-out 360 digits
    print(f"test accuracy on 3 ranks after 3 -> 2 -> 3: {results[0]['test_accuracy']:.4f}")
    assert results[0]["test_accuracy"] == results[1]["test_accuracy"] == results[2]["test_accuracy"] >= 0.90
