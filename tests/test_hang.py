"""The hang detector (tfdist.faults.hang, tfdist.faults.hang_detector, tfdist.keras.step_marks).

Two real 2-rank jobs (`tests/multirank/hang_checks.py` under `horovodrun -np 2 --gloo`): ranks
that wait in different collectives are named and the job ends by itself; a rank whose step is
slow while the other waits in the same step is not reported. The detector's rule itself (same
step, a rank outside every mark, the bound of 5x the longest step, the timeout) is checked on
recorded states, in process.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import BIN, ROOT, make_job_env

WORKER = Path(__file__).parent / "multirank" / "hang_checks.py"
HOST = socket.gethostname()
JOB_LIMIT_S = 120
HANG_ENV = {"TFDIST_HANG_WARN_SECONDS": "5", "TFDIST_HANG_TIMEOUT": "12"}


class Job:
    """A horovodrun job whose output lines are kept with the time.time() each arrived."""

    def __init__(self, mode, out, env):
        self.start = time.time()
        self.proc = subprocess.Popen(
            [str(BIN / "horovodrun"), "-np", "2", "--gloo", sys.executable, str(WORKER), "--mode", mode,
             "--out", str(out)], cwd=ROOT, env=make_job_env({"PYTHONUNBUFFERED": "1", **env}),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines = []  # (arrival time, line)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))

    def wait(self, timeout=JOB_LIMIT_S):
        """(exit code, seconds it ran, whether it had to be killed)."""
        try:
            code = self.proc.wait(timeout=timeout)
            killed = False
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            code, killed = self.proc.wait(), True
        ended = time.time()
        self.reader.join(timeout=10)
        return code, ended, killed

    def text(self):
        return "\n".join(line for _, line in self.lines)

    def tfdist_lines(self):
        """(time, rank, message) of every line a rank printed that starts with "tfdist"."""
        found = []
        for at, line in self.lines:
            match = re.match(r"\[(\d+)\]<std(?:err|out)>:(tfdist.*)", line)
            if match:
                found.append((at, int(match.group(1)), match.group(2)))
        return found


def _job_failure(job, what, lines=80):
    """`what`, then the job's last lines (TensorFlow's start-up lines left out)."""
    kept = [line for _, line in job.lines if " I0000 " not in line and " W0000 " not in line]
    return what + ":\n" + "\n".join(kept[-lines:])


def test_ranks_in_different_collectives_are_named_and_the_job_ends(tmp_path):
    job = Job("hang", tmp_path, HANG_ENV)
    code, ended, killed = job.wait()
    assert not killed, _job_failure(job, f"the job did not end by itself within {JOB_LIMIT_S} s")
    assert code != 0, _job_failure(job, "exit code 0")
    entered = [json.loads((tmp_path / f"entered{rank}").read_text()) for rank in (0, 1)]
    began = max(e["time"] for e in entered)  # both ranks wait from here on
    bound = max(e["bound"] for e in entered)
    hangs = [(at, rank, text) for at, rank, text in job.tfdist_lines() if text.startswith("tfdist hang:")]
    assert hangs, _job_failure(job, "no hang line")
    first_at, _, first = hangs[0]
    warned_after, ended_after = first_at - began, ended - began
    print(f"\nwarn bound {bound:.1f} s; the line came {warned_after:.2f} s after both ranks waited, the job "
          f"ended {ended_after:.2f} s after (exit code {code}); {ended - job.start:.1f} s in all\n{first}")
    _, _, last = job.tfdist_lines()[-1]
    print(f"last: {last}")
    # Rank 0 judges and prints, then sends the line to rank 1; horovodrun reads each rank's pipe in a
    # thread of its own, so either copy may arrive first (rank 1's did once, in a loaded CI run).
    assert "Ending the job in" in first and "TFDIST_HANG_TIMEOUT=12" in first, first
    assert bound - 1.5 <= warned_after <= bound + 3, (bound, warned_after)
    for rank in (0, 1):
        assert any(r == rank and text == first for _, r, text in hangs), f"rank {rank} did not print the line"
    # The last tfdist line of the job is the detector's again, now stopping it.
    assert last.startswith("tfdist hang: ranks wait in different collectives") and \
        "Stopping every rank with exit code 3" in last, _job_failure(job, "another last line")
    for line in (first, last):
        assert "Every rank must run the same collectives in the same order" in line, line
        for rank, collective in ((0, "allreduce 'tfdist.test.only_rank0'"),
                                 (1, "allgather 'tfdist.test.only_rank1'")):
            pattern = (rf"rank {rank} \(host {re.escape(HOST)}\) in {re.escape(collective)} for \d+ s "
                       r"\(last finished: [^;]*train step 10 \(epoch 1, batch 10\)\)")
            assert re.search(pattern, line), (pattern, line)
    assert max(12, bound) - 1.5 <= ended_after <= max(12, bound) + 6, (bound, ended_after)


def test_a_slow_step_on_one_rank_is_not_a_hang(tmp_path):
    """Rank 1 sleeps inside train step 3 while rank 0 waits in that step's allreduce: longer than
    the warn bound, but in the same step, so nothing is reported and the job ends normally."""
    job = Job("slow", tmp_path, {"TFDIST_HANG_WARN_SECONDS": "5", "TFDIST_HANG_TIMEOUT": "12"})
    code, ended, killed = job.wait()
    assert not killed and code == 0, _job_failure(job, f"exit code {code}, killed: {killed}")
    results = {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)}
    longest = max(r["longest_before_slow_step"] for r in results.values())
    slow = results[1]["slow_seconds"]
    print(f"\nlongest step or collective before the slow step {longest:.2f} s (bound then "
          f"{max(5, 5 * longest):.1f} s); slow step {slow:g} s; job {ended - job.start:.1f} s")
    assert max(5, 5 * longest) < slow - 1, "the bound was above the slow step: the same-step rule was not tested"
    assert "tfdist hang" not in job.text(), _job_failure(job, "a hang was reported")


def test_global_batches_of_different_lengths_per_rank_end_the_job_named(tmp_path):
    """Arrays of different lengths per rank under the global convention (a contract breach): with
    no partial-batch check under DATA sharding, the long rank waits alone in a train step; the
    detector names both ranks' collectives and ends the job instead of a silent hang."""
    job = Job("uneven", tmp_path, HANG_ENV)
    code, ended, killed = job.wait()
    assert not killed, _job_failure(job, f"the job did not end by itself within {JOB_LIMIT_S} s")
    assert code != 0, _job_failure(job, "exit code 0")
    hangs = [text for _, _, text in job.tfdist_lines() if text.startswith("tfdist hang:")]
    assert hangs, _job_failure(job, "no hang line")
    print(f"\n{hangs[0]}")
    assert "Every rank must run the same collectives in the same order" in hangs[0], hangs[0]
    assert re.search(r"rank 1 \(host [^)]*\) in [^;]*train step 11", hangs[0]), hangs[0]
    assert re.search(r"rank 0 \(host [^)]*\) in ", hangs[0]), hangs[0]
    assert "if their data ran out first" in hangs[0] and "batch_convention='per_rank'" in hangs[0], hangs[0]


# --- the rule, on recorded states -----------------------------------------------------------------

class FakePeer:
    def __init__(self, host):
        self.host = host


class FakeDog:
    def __init__(self, size=2):
        self.rank, self.host, self.stopped, self.failing = 0, "h0", False, False
        self.peers = {r: FakePeer(f"h{r}") for r in range(1, size)}
        self.sent, self.ended = [], []

    def send_all(self, message, skip=None):
        self.sent.append(message)

    def end_job(self, text):
        self.ended.append(text)


@pytest.fixture
def judge(monkeypatch):
    """judge(states, now, warn=5, timeout=12) -> (stderr lines, detector); states: rank -> (what,
    seconds in it, last, last_step, longest); rank 0's comes from a patched hang.snapshot()."""
    from tfdist.faults import hang
    from tfdist.faults import hang_detector

    reports = {}
    monkeypatch.setattr(hang_detector, "_reports", reports)

    def make(warn=5.0, timeout=12.0, size=2):
        return hang_detector._Detector(FakeDog(size), warn, timeout)

    def run(detector, states, now):
        def snap(rank):
            what, seconds, last, last_step, longest = states[rank]
            return {"what": what, "for": seconds, "last": last, "last_step": last_step, "longest": longest,
                    "longest_what": f"train step 1 of rank {rank}"}

        monkeypatch.setattr(hang, "snapshot", lambda: snap(0))
        reports.clear()
        for rank in states:
            if rank:
                reports[rank] = (now, {"rank": rank, **snap(rank)})
        detector.judge(now)

    return make, run


def test_rule_names_ranks_in_different_collectives_once_then_ends_the_job(judge, capsys):
    make, run = judge
    detector = make()
    step = "train step 10 (epoch 1, batch 10)"
    states = {0: ("allreduce 'a'", 4.0, "allreduce 'm'", step, 0.2), 1: ("allgather 'b'", 4.5, step, step, 0.3)}
    run(detector, states, 100.0)
    assert capsys.readouterr().err == "" and not detector.dog.sent  # 4 s < 5 s
    states = {0: ("allreduce 'a'", 6.0, "allreduce 'm'", step, 0.2), 1: ("allgather 'b'", 6.5, step, step, 0.3)}
    run(detector, states, 102.0)
    line = capsys.readouterr().err.strip()
    assert line == detector.dog.sent[0]["text"] and detector.dog.sent[0]["t"] == "hang"
    assert line.startswith("tfdist hang: ranks wait in different collectives for 6 s (warn bound 5 s: "
                           "TFDIST_HANG_WARN_SECONDS=5): rank 0 (host h0) in allreduce 'a' for 6 s (last "
                           f"finished: allreduce 'm', after {step}); rank 1 (host h1) in allgather 'b' for 6 s "
                           f"(last finished: {step}). Every rank must"), line
    assert line.endswith("Ending the job in 6 s (TFDIST_HANG_TIMEOUT=12)."), line
    run(detector, {r: (s[0], s[1] + 5, *s[2:]) for r, s in states.items()}, 107.0)
    assert capsys.readouterr().err == "" and not detector.dog.ended  # said once; 11 s < 12 s
    run(detector, {r: (s[0], s[1] + 6, *s[2:]) for r, s in states.items()}, 108.0)
    assert len(detector.dog.ended) == 1, detector.dog.ended
    assert "for 12 s" in detector.dog.ended[0] and detector.dog.ended[0].endswith(
        "Stopping every rank with exit code 3 after 12 s (TFDIST_HANG_TIMEOUT=12)."), detector.dog.ended[0]


def test_rule_same_step_or_a_rank_outside_is_no_hang(judge, capsys):
    make, run = judge
    detector = make()
    run(detector, {0: ("train step 3 (epoch 1, batch 3)", 50.0, None, None, 0.1),
                   1: ("train step 3 (epoch 1, batch 3)", 50.0, None, None, 0.1)}, 100.0)
    run(detector, {0: ("allreduce 'a'", 50.0, None, None, 0.1), 1: (None, 0.0, "allreduce 'x'", None, 0.1)}, 101.0)
    run(detector, {0: ("allreduce 'a'", 50.0, None, None, 0.1)}, 102.0)  # rank 1 has not reported
    assert capsys.readouterr().err == "" and not detector.dog.sent and not detector.dog.ended


def test_rule_bound_is_five_times_the_longest_step(judge, capsys):
    make, run = judge
    detector = make(timeout=0)
    states = {0: ("allreduce 'a'", 19.0, None, None, 4.0), 1: ("allgather 'b'", 19.0, None, None, 1.0)}
    run(detector, states, 100.0)
    assert capsys.readouterr().err == ""
    run(detector, {r: (s[0], 21.0, *s[2:]) for r, s in states.items()}, 102.0)
    line = capsys.readouterr().err
    assert ("for 21 s (warn bound 20 s: 5x the longest step or collective so far, train step 1 of rank 0: "
            "4.0 s)") in line, line
    assert "(last finished: nothing yet)" in line and "The job is not ended (TFDIST_HANG_TIMEOUT=0)." in line
    run(detector, {r: (s[0], 500.0, *s[2:]) for r, s in states.items()}, 581.0)
    assert not detector.dog.ended


def test_rule_groups_many_ranks(judge, capsys):
    make, run = judge
    detector = make(size=12)
    states = {r: ("allgather 'b'", 9.0, None, None, 0.1) for r in range(1, 12)}
    states[0] = ("allreduce 'a'", 9.0, None, None, 0.1)
    run(detector, states, 100.0)
    line = capsys.readouterr().err
    assert "rank 0 (host h0) in allreduce 'a' for 9 s" in line, line
    assert ("ranks 1, 2, 3, 4, 5, 6, 7, 8 and 3 more (hosts h1, h10, h11, h2, h3, h4, h5, h6 and 3 more) in "
            "allgather 'b' for 9 s") in line, line


def test_settings_from_the_environment(monkeypatch):
    from tfdist.faults import hang_detector

    monkeypatch.delenv("TFDIST_HANG_WARN_SECONDS", raising=False)
    monkeypatch.delenv("TFDIST_HANG_TIMEOUT", raising=False)
    assert hang_detector.settings() == (60.0, 300.0)
    monkeypatch.setenv("TFDIST_HANG_WARN_SECONDS", "0")
    monkeypatch.setenv("TFDIST_HANG_TIMEOUT", "30")
    assert hang_detector.settings() == (0.0, 30.0)
    assert hang_detector.start() is None  # no watchdog in this process
    monkeypatch.setenv("TFDIST_HANG_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="TFDIST_HANG_TIMEOUT='soon': expected a number of seconds"):
        hang_detector.settings()


# --- the marks ----------------------------------------------------------------------------------------

def test_marks_nest_and_survive_a_late_end_from_another_thread():
    from tfdist.faults import hang

    step = hang.enter("train step 1", step=True)
    inner = hang.enter(hang.collective("allreduce", "x", "tfdist_allreduce"))
    assert hang.snapshot()["what"] == "allreduce 'x'"
    hang.leave(inner)
    assert hang.snapshot()["what"] == "train step 1" and hang.snapshot()["last"] == "allreduce 'x'"
    hang.leave(step)
    assert hang.current() is None and hang.snapshot()["last_step"] == "train step 1"
    # Keras 3 may end step 2 on a thread pool after step 3 began: step 3 stays current, step 2 last.
    two = hang.enter("train step 2", step=True)
    three = hang.enter("train step 3", step=True)
    threading.Thread(target=hang.leave, args=(two,)).run()
    assert hang.snapshot()["what"] == "train step 3" and hang.snapshot()["last_step"] == "train step 2"
    hang.leave(three)
    assert hang.current() is None and hang.snapshot()["last"] == "train step 3"
    assert hang.collective("allreduce", None, "tfdist_metric_sync") == "allreduce in tfdist_metric_sync"
    assert hang.collective("allgather", None, "tfdist_allgather") == "allgather"


def test_eager_collectives_and_keras_steps_are_marked():
    """collectives.named marks eager work (not graph building); step_marks marks each batch of a fit."""
    import tensorflow as tf

    from tfdist import collectives
    from tfdist.faults import hang
    from tfdist.keras import step_marks
    from tfdist.keras.flavour import keras_module

    with collectives.named("tfdist_allgather", "allgather", "tfdist.objects.data"):
        assert hang.snapshot()["what"] == "allgather 'tfdist.objects.data'"
    assert hang.snapshot()["last"] == "allgather 'tfdist.objects.data'"

    @tf.function
    def traced():
        with collectives.named("tfdist_allreduce", "allreduce", "in.graph"):
            seen.append(hang.snapshot()["what"])
        return tf.constant(1)

    seen = []
    traced()
    assert seen == [None]

    keras = keras_module()
    seen = []

    class Probe(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(hang.snapshot()["what"])

        def on_test_batch_begin(self, batch, logs=None):
            seen.append(hang.snapshot()["what"])

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((8, 3), "float32"), np.ones((8, 1), "float32")
    before = step_marks._counts["train"]
    model.fit(x, y, batch_size=4, epochs=2, verbose=0, validation_data=(x, y),
              callbacks=[step_marks._marks(model), Probe()])
    n = before
    assert seen[:3] == [f"train step {n + 1} (epoch 1, batch 1)", f"train step {n + 2} (epoch 1, batch 2)",
                        f"evaluate batch 1 (evaluation {step_marks._counts['test'] - 1})"], seen
    assert seen[5] == f"train step {n + 4} (epoch 2, batch 2)", seen
    assert hang.current() is None and hang.snapshot()["last_step"] == f"train step {n + 4} (epoch 2, batch 2)"
