"""Graceful preemption and exact mid-epoch resume on 2 real ranks (tests/multirank/preemption_checks.py).

Per flavour, four launches of the same worker: phase 0 trains every case uninterrupted (the
references), then starts case 0, which a signal stops mid-epoch; phase N resumes case N-1 and
starts case N. Keras 3 runs through `tfdist-run` (its exit status, console and last line are
checked), tf-keras through plain `horovodrun`. Case 2 is signalled from outside, at the launcher,
as a scheduler signals the job's first process; case 4 (Keras 3) at every process of the job,
twice, as Slurm does at a time limit (`tests/exit_statuses.py` reads each rank's own exit status).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from conftest import BIN, ROOT, _tail, communicate_or_kill, flavor_env, make_job_env

WORKER = ROOT / "tests" / "multirank" / "preemption_checks.py"
CASES = ["backup_arrays", "checkpointer_dataset", "backup_every_5_launcher", "custom_loop", "nothing_saved"]
STOP_LINE = re.compile(r"tfdist preemption: (SIG\w+) on rank (\d) \(host .+?\): every rank stopped together; (.+?)\. "
                       r"Exit code 75 \(preempted")


EVERY_PROCESS = 4  # the phase whose case is signalled at every process of the job, twice
# TensorFlow's C++ start-up lines, which no rank prints under tfdist-run by default
TF_START_UP = re.compile(r"<std(?:out|err)>:(?:WARNING: All log messages before absl::InitializeLog"
                         r"|[IW]\d{4} .*(?:Could not find cuda drivers|oneDNN custom operations are on))")


def _launch(phase, work, out, flavor):
    """(exit status, output, when the test signalled, {rank pid: its own exit status} for
    EVERY_PROCESS)."""
    command = [sys.executable, str(WORKER), "--phase", str(phase), "--work", str(work), "--out", str(out)]
    statuses = out.parent / f"statuses{phase}.json"
    if flavor == "keras3":
        command = [str(BIN / "tfdist-run"), "-np", "2", *command]
        if phase == EVERY_PROCESS:
            command = [sys.executable, str(ROOT / "tests" / "exit_statuses.py"), str(statuses), "--", *command]
    else:
        command = [str(BIN / "horovodrun"), "-np", "2", "--gloo", *command]
    (work / "ready").unlink(missing_ok=True)
    proc = subprocess.Popen(command, cwd=ROOT, env=make_job_env(flavor_env(flavor)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    signalled, ranks = None, []
    if phase in (2, EVERY_PROCESS):  # its case starts in this launch: signal once rank 0 is mid-epoch
        ready = work / "ready"
        deadline = time.monotonic() + 240
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if ready.exists() and phase == 2:  # the launcher only
            signalled = time.time()
            os.kill(proc.pid, signal.SIGUSR1 if flavor == "keras3" else signal.SIGTERM)
        elif ready.exists():  # tfdist-run, horovodrun, its middlemen and shells, the ranks, their filters
            job = psutil.Process(proc.pid).children(recursive=True)
            ranks = [p.pid for p in job if _cmdline(p)[1:2] == [str(WORKER)]]
            for _ in range(2):  # a second SIGTERM while the first one's stop is under way
                for process in job:
                    try:
                        process.send_signal(signal.SIGTERM)
                    except psutil.NoSuchProcess:
                        pass
                time.sleep(1)
    output, _, timed_out = communicate_or_kill(proc, 300)
    assert not timed_out, f"phase {phase} timed out:\n{_tail(output, 300)}"
    own = json.loads(statuses.read_text()) if ranks else {}
    return proc.returncode, output, signalled, {pid: own.get(str(pid)) for pid in ranks}


def _cmdline(process):
    try:
        return process.cmdline()
    except psutil.Error:  # ended meanwhile
        return []


def _check_console(phase, output):
    """tfdist-run's console: no traceback (horovodrun's went to the file its last line names, with
    its report of each rank), tfdist's line last, no TensorFlow start-up line."""
    assert "Traceback" not in output, f"phase {phase}:\n{_tail(output)}"
    last = output.rstrip("\n").splitlines()[-1]
    report = re.fullmatch(r"tfdist-run: job preempted \(SIG\w+ on rank \d .+?\): .+Exit status 75: run the same "
                          r"command again to continue \(horovodrun's own report: (\S+)\)\.", last)
    assert report, f"phase {phase}: last line {last!r}"
    text = Path(report[1]).read_text()
    Path(report[1]).unlink()
    assert "RuntimeError: Horovod detected that one or more processes exited" in text, text
    _check_first_exit(phase, text)
    assert not TF_START_UP.search(output), TF_START_UP.search(output)[0]


def _check_first_exit(phase, report):
    """horovodrun names the first rank to exit, as that rank's shell reported it: 75 where nothing
    signalled horovodrun. (It then sends SIGTERM to the other shells' children and stops those shells
    once their child has gone, so their status is its own doing; in phase 2 it got the signal, and
    in EVERY_PROCESS its middlemen and shells were killed by it.)"""
    if phase not in (2, EVERY_PROCESS):
        assert re.search(r"^Exit code: 75$", report, re.M), report


def _result(work, case, rank, kind):
    return json.loads((work / case / f"rank{rank}-{kind}" / f"rank{rank}.json").read_text())


@pytest.mark.parametrize("flavor", ["keras3", "tf_keras"])
def test_preempted_job_saves_at_one_step_and_resumes_exactly(tmp_path, flavor):
    work = tmp_path / "work"
    outputs, signalled = {}, None
    # tf-keras leaves out the last launch (it would resume the custom loop and stop the
    # checkpoint-less fit: Keras-independent paths that Keras 3 covers)
    phases = len(CASES) if flavor == "keras3" else len(CASES) - 1
    for phase in range(phases):
        code, output, sent, rank_statuses = _launch(phase, work, tmp_path / f"out{phase}", flavor)
        outputs[phase] = output
        signalled = sent or signalled
        stops = STOP_LINE.findall(output)
        assert len(stops) == 1, f"phase {phase}: expected one stop line, got {stops}\n{_tail(output)}"
        if flavor == "keras3":  # tfdist-run: the preempted exit status, and its line last
            assert code == 75, f"phase {phase}: tfdist-run exit status {code}\n{_tail(output)}"
            _check_console(phase, output)
        else:
            assert code != 0
            _check_first_exit(phase, output)
        if phase == EVERY_PROCESS:  # every rank's own exit status, after two SIGTERMs to each process
            assert len(rank_statuses) == 2 and set(rank_statuses.values()) == {75}, rank_statuses
    # who was signalled, as the stop lines say
    assert STOP_LINE.findall(outputs[0])[0][:2] == ("SIGTERM", "1")
    assert STOP_LINE.findall(outputs[1])[0][0] == "SIGUSR1"
    # tfdist-run passes SIGUSR1 on to horovodrun as SIGTERM, which horovodrun passes to every rank
    assert STOP_LINE.findall(outputs[2])[0][0] == "SIGTERM"
    assert STOP_LINE.findall(outputs[3])[0][:2] == ("SIGTERM", "1") and "loop-state.npz" in outputs[3]
    if flavor == "keras3":
        assert "nothing could be saved" in STOP_LINE.findall(outputs[4])[0][2]
    assert "BackupAndRestore" in STOP_LINE.findall(outputs[0])[0][2]
    assert "Checkpointer" in STOP_LINE.findall(outputs[1])[0][2] and "ModelCheckpoint" in STOP_LINE.findall(outputs[1])[0][2]

    resumed_cases = CASES[:phases - 1]
    for case in resumed_cases:
        for rank in (0, 1):
            reference = _result(work, case + "-reference", rank, "finished")
            stopped = _result(work, case, rank, "stopped")
            resumed = _result(work, case, rank, "finished")
            assert stopped["exit_code"] == 75
            first_run = stopped["trained_to"] - stopped["trained_from"]
            second_run = resumed["trained_to"] - resumed["trained_from"]
            assert stopped["trained_from"] == 0 and resumed["trained_from"] == stopped["trained_to"], (case, rank)
            # every step trained exactly once: none repeated, none skipped
            assert first_run + second_run == reference["trained_to"] == 60, (case, rank, first_run, second_run)
            assert 20 < first_run < 40, (case, rank, first_run)  # stopped mid-epoch 2
            if case != "custom_loop":  # fit: callbacks see each trained batch once, with its index
                assert len(stopped["batch_ends"]) == first_run and len(resumed["batch_ends"]) == second_run, \
                    (case, rank, len(stopped["batch_ends"]), first_run, len(resumed["batch_ends"]), second_run)
                assert stopped["batch_ends"] + resumed["batch_ends"] == reference["batch_ends"], (case, rank)
            for mine, expected in zip(resumed["variables"], reference["variables"]):
                np.testing.assert_allclose(mine, expected, atol=1e-5, err_msg=f"{case} rank {rank}")
            if stopped.get("signal_time"):
                assert stopped["exit_time"] - stopped["signal_time"] < 60
        ranks = [_result(work, case, r, "finished")["variables"] for r in (0, 1)]
        for a, b in zip(*ranks):
            np.testing.assert_array_equal(a, b)
    launcher_stop = _result(work, CASES[2], 0, "stopped")
    assert signalled is not None and launcher_stop["exit_time"] - signalled < 60
    print(f"\n{flavor}: launcher signal to exit {launcher_stop['exit_time'] - signalled:.2f} s; steps trained "
          f"per run: " + ", ".join(f"{c}: {_result(work, c, 0, 'stopped')['trained_to']}+"
                                   f"{60 - _result(work, c, 0, 'stopped')['trained_to']}" for c in resumed_cases))


def test_unit_launcher_reads_the_preempted_line():
    from tfdist.launch import recovery

    lines = ["[0]<stderr>:tfdist preemption: SIGTERM on rank 1 (host n1): every rank stopped together; saved "
             "after epoch 2, batch 11 by BackupAndRestore (/b). Exit code 75 (preempted; resumable): run ...",
             "Process name: 1", "Exit code: 75"]
    assert recovery.preempted(lines) == ("SIGTERM on rank 1 (host n1)",
                                         "saved after epoch 2, batch 11 by BackupAndRestore (/b)")
    assert recovery.preempted(["Process name: 1", "Exit code: 75"]) is None
    # tfdist-run without restarts: the stop line makes it 75, also where the launcher exited 0
    from tfdist.launch import job_summary

    launcher = [sys.executable, "-c", f"import sys; print({lines[0]!r}, file=sys.stderr); sys.exit(0)"]
    assert job_summary.run(launcher) == 75


FAKE_HOROVODRUN = """#!{python}
import sys
print("[1]<stdout>:epoch 1", flush=True)
if sys.argv[1] == "stopped":
    print({stop!r}, file=sys.stderr, flush=True)
else:
    print("[1]<stderr>:ValueError: bad label 11", file=sys.stderr, flush=True)
print("Process 1 exit with status code 75.", flush=True)
print("Traceback (most recent call last):\\nRuntimeError: Horovod detected that one or more processes exited "
      "with non-zero status, thus causing the job to be terminated.", file=sys.stderr, flush=True)
sys.exit(1)
"""


def test_unit_horovodruns_own_report_goes_to_a_file_when_the_ranks_stopped(tmp_path, capfd):
    """horovodrun's own lines after the ranks' (its `Process N exit` lines, its traceback) are held
    to the end: after a preemption they go to a file that tfdist-run's last line names; after a
    failure they follow the ranks' output, before tfdist-run's line."""
    from tfdist.launch import job_summary

    fake = tmp_path / "horovodrun"  # the name decides (launcher_lines)
    stop = ("[0]<stderr>:tfdist preemption: SIGTERM on rank 1 (host n1): every rank stopped together; saved after "
            "epoch 2, batch 11 by BackupAndRestore (/b). Exit code 75 (preempted; resumable): run ...")
    fake.write_text(FAKE_HOROVODRUN.format(python=sys.executable, stop=stop))
    fake.chmod(0o755)
    assert job_summary.run([str(fake), "stopped"]) == 75
    out, err = capfd.readouterr()
    assert out == "[1]<stdout>:epoch 1\n" and "Traceback" not in err and err.startswith(stop), err
    last = err.splitlines()[-1]
    report = re.fullmatch(r"tfdist-run: job preempted \(SIGTERM on rank 1 \(host n1\)\): .+ to continue "
                          r"\(horovodrun's own report: (\S+)\)\.", last)
    assert report and len(err.splitlines()) == 2, err
    text = Path(report[1]).read_text()
    Path(report[1]).unlink()
    # (stdout's and stderr's lines in the order they came: either may be first)
    assert "Process 1 exit with status code 75.\n" in text and "RuntimeError: Horovod detected" in text, text

    assert job_summary.run([str(fake), "failed"]) == 1
    out, err = capfd.readouterr()
    assert out.splitlines() == ["[1]<stdout>:epoch 1", "Process 1 exit with status code 75."], out
    assert err.splitlines()[:2] == ["[1]<stderr>:ValueError: bad label 11", "Traceback (most recent call last):"], err
    assert err.splitlines()[-1].startswith("tfdist-run: job failed (exit status 1): rank 1 "), err


ONE_PROCESS = """
import os, signal, json
import numpy as np
import tfdist
from tfdist.keras.flavour import keras_module
keras = keras_module()
strategy = tfdist.HorovodStrategy(tuning=False)
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
x, y = np.ones((64, 4), "float32"), np.ones((64, 1), "float32")
seen = {}

class Probe(keras.callbacks.Callback):
    def __init__(self, action):
        super().__init__()
        self.action = action
    def on_train_batch_end(self, batch, logs=None):
        seen["during"] = signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)
        if batch == 1 and self.action == "raise":
            raise ValueError("a user's error")
        if batch == 1 and self.action == "signal":
            os.kill(os.getpid(), signal.SIGTERM)

try:
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[Probe("raise")])
except ValueError:
    pass
seen["after_error"] = signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
try:
    model.fit(x, y, batch_size=8, epochs=2, verbose=0,
              callbacks=[keras.callbacks.BackupAndRestore(os.environ["BACKUP"]), Probe("signal")])
except SystemExit as stop:
    seen["exit_code"] = stop.code
seen["after_stop"] = signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # ignored until the process ends

class Counter(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        seen["resumed_from"] = int(self.model.optimizer.iterations.numpy())

model.fit(x, y, batch_size=8, epochs=2, verbose=0,  # the same run again: it resumes after step 2
          callbacks=[keras.callbacks.BackupAndRestore(os.environ["BACKUP"]), Counter()])
seen["steps"] = int(model.optimizer.iterations.numpy())
seen["after_resume"] = signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handler from before the stop
print("RESULT " + json.dumps(seen), flush=True)
os._exit(0)  # what is checked is above; interpreter shutdown is not this test's subject
"""


@pytest.mark.parametrize("flavor", ["keras3", "tf_keras"])
def test_one_process_stops_at_once_and_gives_the_signals_back(tmp_path, flavor):
    from conftest import python_results

    seen = json.loads(python_results(ONE_PROCESS, env={**flavor_env(flavor), "BACKUP": str(tmp_path / "b")})[-1])
    # caught only while fit runs; given back after a fit that raised; ignored from the stop on (the
    # process is meant to end with 75), and given back by the next fit that caught them;
    # one process stops right after the step it was signalled in (batch 2 of epoch 1), and the
    # same fit again trains the 14 steps left of 2 epochs of 8 (the first fit that raised made 2 steps)
    assert seen == {"during": True, "after_error": True, "exit_code": 75, "after_stop": True,
                    "resumed_from": 4, "steps": 18, "after_resume": True}, seen


STUCK_AT_EXIT = """
import os, sys, threading, time
from tfdist.faults import preemption

def stuck_at_exit():  # a thread that is not a daemon: the interpreter's exit waits for it
    time.sleep(600)

threading.Thread(target=stuck_at_exit).start()
if sys.argv[1] == "goes_on":  # a program that catches the stop and carries on is left alone
    try:
        preemption.exit_preempted("nothing saved", saved=False)
    except SystemExit:
        pass
    time.sleep(3)
    print("still running", flush=True)
    os._exit(0)
preemption.exit_preempted("nothing saved", saved=False)
"""


def test_an_exit_stuck_after_the_stop_ends_with_75_and_shows_where():
    env = make_job_env({"TFDIST_PREEMPTION_EXIT_SECONDS": "1"})
    stuck = subprocess.run([sys.executable, "-c", STUCK_AT_EXIT, "exits"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=120)
    assert stuck.returncode == 75, stuck.stderr[-3000:]
    assert re.search(r"tfdist preemption: rank 0 \(host .+, pid \d+\) had not ended 1 s into its exit after the "
                     r"stop \(TFDIST_PREEMPTION_EXIT_SECONDS\); ending it with 75\. Its threads:", stuck.stderr)
    assert "in stuck_at_exit" in stuck.stderr, stuck.stderr[-3000:]
    goes_on = subprocess.run([sys.executable, "-c", STUCK_AT_EXIT, "goes_on"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=120)
    assert goes_on.returncode == 0 and goes_on.stdout == "still running\n", goes_on.stderr[-3000:]


HOROVODRUN_SIGNALLED_TWICE = """
import signal
from horovod.runner import gloo_run
event = gloo_run.register_shutdown_event()  # what horovodrun --gloo does before it starts the ranks
handler = signal.getsignal(signal.SIGTERM)
handler(signal.SIGTERM, None)  # the first SIGTERM
with event._cond:  # a second one, handled while the first one's Event.set() holds the event's lock
    handler(signal.SIGTERM, None)
print("RESULT", event.is_set())
"""


def test_horovodrun_takes_stop_signals_that_come_together():
    """Slurm's SIGTERM and tfdist-run's reach horovodrun at once: Horovod's own handler then waited
    for a lock its thread held, forever (tfdist's patch 0009-gloo-run-signal-once.patch)."""
    from conftest import python_results

    try:
        assert python_results(HOROVODRUN_SIGNALLED_TWICE, timeout=60) == ["True"]
    except subprocess.TimeoutExpired:
        pytest.fail("horovodrun's SIGTERM handler deadlocks when a second signal comes during the first: "
                    "this Horovod lacks tfdist's patch 0009-gloo-run-signal-once.patch")
