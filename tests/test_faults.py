"""Fault behaviour on real 2-rank jobs: dead, stalled, raising, exiting and interrupted ranks, a
watchdog that cannot listen, ranks that disagree, NaN losses.

The dead-rank tests run twice: under `horovodrun` (which itself terminates the siblings of a
failed process) and as two plain processes with Horovod's Gloo variables set by hand around a
rendezvous server started here, as under `srun` without --kill-on-bad-exit, where nobody else
stops the survivors.
"""

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import (BIN, EXIT_LIMIT_S, ROOT, WATCHDOG_WORKER, flavor_env, kill_group, make_job_env, run_job,
                      signal_rank, wait_ready)

WORKERS = Path(__file__).parent / "multirank"
HOST = socket.gethostname()
# The two lines of the error rank 1 raises in watchdog_checks.py's "raise" mode.
FIRST_LINE = "first line: rank 1 fails at step 20"
LAST_LINE = "second line: the real cause is injected on rank 1"
NONFINITE = ("NonFiniteLossError: non-finite loss (nan) at epoch 1, batch 5 (step 5 of this fit): "
             "local loss non-finite on rank 1")


def _job_env(extra=None):
    return make_job_env({"PYTHONUNBUFFERED": "1", **(extra or {})})


class Unsupervised:
    """NP plain processes joined by Horovod's Gloo rendezvous; nobody kills a survivor."""

    def __init__(self, args, out, np=2, env=None):
        from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
        from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars
        from horovod.runner.http.http_server import RendezvousServer

        self.server = RendezvousServer()
        port = self.server.start()
        plan = get_host_assignments(parse_hosts(f"localhost:{np}"), np)
        self.server.init(plan)
        common = {k: str(v) for k, v in create_run_env_vars("127.0.0.1", ["lo"], port).items()}
        self.out = out
        self.logs = [open(out / f"rank{slot.rank}.log", "w") for slot in plan]
        self.procs = [
            subprocess.Popen([sys.executable, *map(str, args), "--out", str(out)], cwd=ROOT,
                             env=_job_env({**common, **create_slot_env_vars(slot), **(env or {})}),
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            for slot, log in zip(plan, self.logs)
        ]

    def output(self, rank):
        self.logs[rank].flush()
        return Path(self.logs[rank].name).read_text()

    def close(self):
        for proc in self.procs:
            kill_group(proc)
        for log in self.logs:
            log.close()
        self.server.stop()


@pytest.fixture
def unsupervised(tmp_path):
    jobs = []

    def start(mode, env=None, np=2):
        job = Unsupervised([WATCHDOG_WORKER, "--mode", mode], tmp_path, np=np, env=env)
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.close()


def _rank0_stopped(job, seconds, what):
    code = job.procs[0].wait(timeout=5)
    text = job.output(0)
    print(f"\nrank 0 exited {seconds:.2f} s after rank 1 {what} (exit code {code}); its message: "
          + _verdict_line(text))
    assert code == 3, text[-3000:]
    assert seconds < EXIT_LIMIT_S
    assert f"tfdist watchdog: rank 1 (host {HOST}, pid {job.procs[1].pid})" in text, text[-3000:]
    return _verdict_line(text)


def _verdict_line(text):
    return next((l for l in text.splitlines() if "tfdist watchdog:" in l), "<none>")


def _horovodrun(tmp_path, mode, *extra):
    log = open(tmp_path / "job.log", "w")
    proc = subprocess.Popen(
        [str(BIN / "horovodrun"), "-np", "2", "--gloo", sys.executable, str(WATCHDOG_WORKER),
         "--mode", mode, "--out", str(tmp_path), *extra],
        cwd=ROOT, env=_job_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return proc, tmp_path / "job.log"


def test_killed_rank_stops_the_survivor_without_a_launcher(unsupervised):
    job = unsupervised("train")
    _, seconds = signal_rank(job.out, job.procs, signal.SIGKILL, [log.name for log in job.logs])
    text = _rank0_stopped(job, seconds, "was killed")
    assert "died: its connection closed without a goodbye" in text
    assert job.procs[0].returncode == 3


def test_rank_raising_stops_the_survivor_without_a_launcher(unsupervised):
    job = unsupervised("raise")
    assert wait_ready(job.out, ranks=(1,), procs=job.procs)
    start = time.monotonic()
    job.procs[0].wait(timeout=EXIT_LIMIT_S + 10)
    verdict = _rank0_stopped(job, time.monotonic() - start, "raised")
    # The type and the last line of the two-line message, not the first.
    assert f"failed: ValueError: {LAST_LINE} [last line of a 2-line message" in verdict, verdict
    assert FIRST_LINE not in verdict
    assert job.procs[1].wait(timeout=30) == 1
    own = job.output(1)
    assert "Traceback (most recent call last):" in own
    assert f"ValueError: {FIRST_LINE}\n{LAST_LINE}" in own, own[-3000:]


def test_rank_raising_under_horovodrun_prints_its_traceback_first(tmp_path):
    """The failing rank's traceback reaches the job's output before the watchdog (or horovodrun,
    reacting to the survivor's exit) can end it, even when printing it takes 2 s."""
    proc, log_path = _horovodrun(tmp_path, "raise", "--slow_stderr", "2")
    try:
        code = proc.wait(timeout=EXIT_LIMIT_S + 120)
    finally:
        kill_group(proc)
    text = log_path.read_text()
    rank1 = "\n".join(l.split(":", 1)[1] for l in text.splitlines() if l.startswith("[1]<stderr>:"))
    assert code != 0, text[-3000:]
    assert "Traceback (most recent call last):" in rank1, text[-3000:]
    assert f"ValueError: {FIRST_LINE}\n{LAST_LINE}" in rank1, text[-3000:]
    verdict = _verdict_line(text)
    print(f"\nunder horovodrun, rank 0: {verdict}")
    pid = (tmp_path / "ready1").read_text()
    assert verdict.startswith(f"[0]<stderr>:tfdist watchdog: rank 1 (host {HOST}, pid {pid}) "
                              f"failed: ValueError: {LAST_LINE} [last line of a 2-line message"), verdict
    assert FIRST_LINE not in verdict


def test_sys_exit_on_one_rank_stops_the_survivor(unsupervised):
    job = unsupervised("exit")
    assert wait_ready(job.out, ranks=(1,), procs=job.procs)
    start = time.monotonic()
    job.procs[0].wait(timeout=EXIT_LIMIT_S + 10)
    verdict = _rank0_stopped(job, time.monotonic() - start, "called sys.exit(3)")
    assert "failed: sys.exit(3)" in verdict, verdict
    assert job.procs[1].wait(timeout=30) == 3


def test_ctrl_c_on_one_rank_stops_the_survivor(unsupervised):
    job = unsupervised("train")
    _, seconds = signal_rank(job.out, job.procs, signal.SIGINT, [log.name for log in job.logs])
    verdict = _rank0_stopped(job, seconds, "got SIGINT")
    assert "failed: KeyboardInterrupt" in verdict, verdict
    assert job.procs[1].wait(timeout=30) != 0
    assert "KeyboardInterrupt" in job.output(1)


def test_nonfinite_raise_stops_every_rank_with_its_own_traceback(unsupervised):
    """NonFiniteLossError is raised on every rank at the same step: each rank prints it and exits
    1; none is cut short by the watchdog relaying the other's error."""
    job = unsupervised("nonfinite")
    codes = [proc.wait(timeout=EXIT_LIMIT_S + 120) for proc in job.procs]
    for rank in (0, 1):
        text = job.output(rank)
        assert codes[rank] == 1, (rank, codes, text[-3000:])
        assert "Traceback (most recent call last):" in text and NONFINITE in text, text[-3000:]
        assert "tfdist watchdog:" not in text, text[-3000:]


def test_rank0_that_cannot_listen_fails_every_rank(tmp_path):
    ranks = run_job([WORKERS / "fault_checks.py", "--checks", "watchdog_port"], tmp_path, np=2,
                    env={"TFDIST_WATCHDOG_TIMEOUT": "0"}, timeout=300)
    port = ranks[0]["watchdog_port"]["taken_port"]
    expected = {
        "taken": [f"cannot listen on 127.0.0.1:{port}", "Address already in use"],
        "not_a_number": ["cannot listen on 127.0.0.1:notaport",
                         "'notaport', not a number from 0 to 65535"],
        "out_of_range": ["'70000', not a number from 0 to 65535"],
        "unknown_host": ["cannot listen on no-such-host.invalid:0"],
    }
    for rank in (0, 1):
        checks = ranks[rank]["watchdog_port"]
        for name, parts in expected.items():
            message = checks[name]["message"]
            assert checks[name]["error"] == "WatchdogError", (rank, name, checks[name])
            for part in [f"rank 0 (host {HOST})", "Set TFDIST_WATCHDOG_ADDR", "watchdog=False",
                         "Every rank stops with this error", *parts]:
                assert part in message, (rank, name, part, message)
            assert (f"reported to rank 1, host {HOST}" in message) == (rank == 1), message
        assert checks["good"]["error"] is None and checks["active"], checks


def test_stalled_rank_is_named_after_the_timeout(unsupervised):
    job = unsupervised("train", env={"TFDIST_WATCHDOG_TIMEOUT": "5"})
    # alive but silent, as a hung rank or an unreachable host
    _, seconds = signal_rank(job.out, job.procs, signal.SIGSTOP, [log.name for log in job.logs])
    text = _rank0_stopped(job, seconds, "was stopped (SIGSTOP)")
    assert "stopped responding: no heartbeat for" in text
    # The watchdog's timeout, well before Gloo's own 30 s. Silence is counted from rank 1's last
    # heartbeat, which can precede the SIGSTOP by up to one heartbeat period (measured: 4.15 s).
    from tfdist.faults.watchdog import HEARTBEAT_SECONDS

    assert 5 - HEARTBEAT_SECONDS - 0.25 < seconds < 15


def test_killed_rank_under_horovodrun_names_rank_and_host(tmp_path):
    proc, log_path = _horovodrun(tmp_path, "train")
    try:
        pids, seconds = signal_rank(tmp_path, [proc], signal.SIGKILL, [log_path])
        proc.wait(timeout=30)
    finally:
        kill_group(proc)
    text = log_path.read_text()
    print(f"\nunder horovodrun, rank 0 exited {seconds:.2f} s after rank 1 was killed")
    assert seconds < EXIT_LIMIT_S and proc.returncode != 0
    assert f"tfdist watchdog: rank 1 (host {HOST}, pid {pids[1]}) died" in text, text[-3000:]


def test_ranks_that_finish_at_different_times_exit_cleanly(tmp_path):
    ranks = run_job([WATCHDOG_WORKER, "--mode", "finish"], tmp_path, np=2, timeout=300)
    assert ranks[0]["finished"] and ranks[1]["finished"]


def test_ranks_that_disagree_stop_naming_the_difference(tmp_path):
    ranks = run_job([WORKERS / "fault_checks.py", "--checks", "consistency,nonfinite"], tmp_path,
                    np=2, timeout=300)
    expected = {
        "script": ["main script differs", "fault_checks.py (sha256", "changed_script.py (sha256"],
        "fingerprint": ["fingerprint differs", "'config-a' on rank 0; 'config-b' on rank 1"],
        "batch": ["dataset batch size differs across ranks: 8 on rank 0; 16 on rank 1"],
        "structure": ["element structure", "float32[4]", "on rank 0", "float32[5]", "on rank 1"],
        "manifest": ["dataset manifest differs", "data_rank0 (40 records", "data_rank1 (41 records"],
    }
    for rank in (0, 1):
        checks = ranks[rank]["consistency"]
        for name, parts in expected.items():
            assert checks[name]["error"] == "RankMismatchError", (rank, name, checks[name])
            for part in parts:
                assert part in checks[name]["message"], (rank, name, checks[name]["message"])
        assert checks["agree_arrays"]["error"] is None, checks["agree_arrays"]
        assert checks["agree_manifest"]["error"] is None, checks["agree_manifest"]
    _assert_nonfinite(ranks)


def test_nan_on_one_rank_stops_both_tf_keras(tmp_path):
    ranks = run_job([WORKERS / "fault_checks.py", "--checks", "nonfinite"], tmp_path, np=2,
                    env=flavor_env("tf_keras"), timeout=300)
    _assert_nonfinite(ranks)


def _assert_nonfinite(ranks, bad_step=5):
    message = f"at epoch 1, batch {bad_step} (step {bad_step} of this fit): local loss non-finite on rank 1"
    for rank in (0, 1):
        stop, raised = ranks[rank]["nonfinite"]["stop"], ranks[rank]["nonfinite"]["raise"]
        assert stop["error"] is None and stop["batches"] == list(range(bad_step + 1)), stop
        assert stop["report"]["ranks"] == [1] and stop["report"]["step"] == bad_step, stop
        assert message in stop["message"], stop["message"]
        assert raised["error"] == "NonFiniteLossError" and message in raised["message"], raised
        assert raised["batches"] == list(range(bad_step)), raised


def test_nonfinite_loss_on_one_process():
    from tfdist.callbacks import StopOnNonFiniteLoss
    from tfdist.keras.flavour import keras_module

    keras = keras_module()
    x = np.ones((40, 3), "float32")
    y = np.ones((40, 1), "float32")
    y[13] = np.inf  # in batch 3 (4 examples per batch)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    stop = StopOnNonFiniteLoss()
    history = model.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0, callbacks=[stop])
    assert stop.report["step"] == 3 and stop.report["ranks"] == [0], stop.report
    assert len(history.epoch) == 1
    with pytest.raises(ValueError, match="action"):
        StopOnNonFiniteLoss(action="ignore")


def test_error_summary_keeps_the_type_and_the_last_meaningful_line():
    """What the other ranks print about a rank's error, on a real Keras error and on long text."""
    from tfdist.keras.flavour import keras_module
    from tfdist.faults.watchdog_support import LINE_CHARS, describe_exception

    keras = keras_module()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError) as caught:
        model.fit(np.ones((8, 4), "float32"), np.ones((8, 2), "float32"), verbose=0)
    summary = describe_exception(caught.type, caught.value, rank=1)
    # Keras puts the cause last, after "in user code" (tf-keras) or before its argument list.
    assert summary.startswith("ValueError: ") and "incompatible" in summary, summary
    assert "in user code" not in summary and "Arguments received" not in summary, summary
    assert "rank 1's traceback has all of it" in summary and "\x1b" not in summary, summary

    long = describe_exception(RuntimeError, RuntimeError("head " + "x" * 2000 + " tail"))
    assert long.startswith("RuntimeError: head") and long.endswith(" tail"), long
    assert " ... " in long and len(long) <= LINE_CHARS
    assert describe_exception(KeyboardInterrupt, KeyboardInterrupt()) == "KeyboardInterrupt"


# --- tfdist-run's last line for a failed job (tfdist/job_summary.py) --------------------------

def test_failed_job_ends_naming_the_rank_that_raised(tmp_path):
    """Under tfdist-run the last line names rank 1, which raised, not rank 0, which the watchdog
    stopped and which horovodrun reports as the first process to exit."""
    env = _job_env()
    env.pop("SLURM_JOB_ID", None)
    proc = subprocess.run([str(BIN / "tfdist-run"), "-np", "2", "python", str(WATCHDOG_WORKER), "--mode", "raise",
                           "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=EXIT_LIMIT_S + 240)
    last = proc.stderr.strip().splitlines()[-1]
    print(f"\nexit status {proc.returncode}; last line: {last}")
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert last.startswith(f"tfdist-run: job failed (exit status {proc.returncode}): rank 1 (host {HOST}) "
                           f"failed: ValueError: {LAST_LINE}"), proc.stderr[-3000:]
    assert "rank 0" not in last
    # rank 1's own traceback came through whole (its stderr passes tfdist.launch.stderr_filter)
    rank1 = "\n".join(l.split(":", 1)[1] for l in proc.stderr.splitlines() if l.startswith("[1]<stderr>:"))
    assert "Traceback (most recent call last):" in rank1 and f"ValueError: {FIRST_LINE}\n{LAST_LINE}" in rank1, rank1


def test_unit_job_summary_names_the_first_failure_not_the_survivor():
    from tfdist.faults import watchdog
    from tfdist.launch.job_summary import STOPPED_CODE, describe, last_words

    assert STOPPED_CODE == watchdog.EXIT_CODE
    hosts = lambda rank: ["n1", "n2"][rank]  # noqa: E731
    horovodrun_stopped_rank0 = ["Process name: 0", "Exit code: 3"]
    traceback = ["[1]<stderr>:Traceback (most recent call last):", '[1]<stderr>:  File "train.py", line 3',
                 "[1]<stderr>:\x1b[1mValueError: bad label 11\x1b[0m"]
    verdict = ("[0]<stderr>:tfdist watchdog: rank 1 (host n2, pid 7) failed: ValueError: bad label 11. "
               "Stopping every rank with exit code 3 so that no rank waits forever in a collective.")
    # 1. the watchdog's line wins over horovodrun's report of the survivor
    assert describe(1, [*traceback, verdict, *horovodrun_stopped_rank0], hosts) == \
        "rank 1 (host n2) failed: ValueError: bad label 11"
    # 2. no watchdog line (lost, or watchdog off): the rank that printed a traceback, not the one stopped
    assert describe(1, [*traceback, *horovodrun_stopped_rank0], hosts) == \
        "rank 1 (host n2) failed: ValueError: bad label 11"
    # the launcher's report of a rank that really failed, with that rank's last words
    assert describe(1, [*traceback, "Process name: 1", "Exit code: 1"], hosts) == \
        "rank 1 (host n2) exited with code 1: ValueError: bad label 11"
    assert describe(1, ["Process name: 1", "Exit code: 137"], hosts) == \
        "rank 1 (host n2) was killed by SIGKILL (exit code 137)"
    usage = ["[0]<stderr>:usage: train.py [-h] --data DATA",
             "[0]<stderr>:train.py: error: the following arguments are required: --data", "Process name: 0",
             "Exit code: 2"]
    assert describe(1, usage, hosts).endswith("exited with code 2: train.py: error: the following arguments "
                                              "are required: --data")
    assert describe(1, horovodrun_stopped_rank0, hosts).startswith("rank 0 (host n1) exited with code 3: the "
                                                                   "watchdog's code for a rank stopped")
    assert describe(1, []) == "the job exited with code 1 (launcher exit status)"
    # several verdicts (rank 0 relayed rank 1's failure, then a survivor lost rank 0): the first
    lost = "[2]<stderr>:tfdist watchdog: rank 0 (host n1, pid 5) died: its connection closed. Stopping rank 2"
    assert describe(1, [verdict, lost, *horovodrun_stopped_rank0], hosts).startswith("rank 1 (host n2) failed")
    # interleaved output keeps each rank's order; indented traceback lines are not last words
    assert list(last_words(["[1]<stderr>:KeyboardInterrupt", "[0]<stderr>:  raise OSError: x",
                            "[0]<stderr>:OSError: y"])) == [1, 0]
