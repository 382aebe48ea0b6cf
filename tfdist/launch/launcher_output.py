"""The launcher's output, copied through `tfdist-run` line by line, its last lines kept.

`tfdist-run` stays the launcher's parent (for its failure summary, `tfdist.launch.job_summary`, and for
`--max-restarts`, `tfdist.launch.recovery`). It copies the launcher's stdout and stderr through as they
come and keeps the last `TAIL_LINES` lines to analyse. For horovodrun (`launcher_lines`):

- horovodrun imports TensorFlow itself, to check its Horovod build, before it starts any rank:
  those start-up lines, a third copy of what the ranks print, are dropped;
- once the ranks run, horovodrun's own lines (not tagged `[R]<stdout>:`: its `Process N exit with
  status code` lines and the `RuntimeError` traceback it ends a failed job with) are held until it
  exits. When the ranks' stop line explains the exit (a preemption, exit 75) they go to a log file,
  which the caller names in its last line, instead of the console; otherwise they follow.

Nothing else is touched. No TensorFlow here.
"""

import collections
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading

TAIL_LINES = 400
# TensorFlow's C++ start-up lines below ERROR: absl's header and format, TF's own format, and the
# second line of its CPU-instructions notice.
_TF_START_UP = re.compile(r"^(?:WARNING: All log messages before absl::InitializeLog\(\)"
                          r"|[IW]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w./-]+:\d+\] "
                          r"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IW] "
                          r"|To enable the following instructions: )")
_RANK_TAG = re.compile(r"^\[\d+(?:,\d+)?\]<std(?:out|err)>:")
PREEMPTED_CODE = 75  # tfdist.faults.preemption.EXIT_CODE (not imported: it loads TensorFlow)
_PREEMPTED = re.compile(r"tfdist preemption: (.+?): every rank stopped together; (.+?)\. Exit code 75")


def preempted(lines):
    """(why, what was saved) from the ranks' graceful-stop line in the job's output, or None."""
    for line in lines:
        if m := _PREEMPTED.search(line):
            return m[1], m[2]
    return None


def launcher_lines(argv):
    """For `run_once(kind=...)`: "drop" for horovodrun's own TensorFlow start-up lines, which come
    before any rank's (rank-tagged) line, "own" for its own lines after that, "copy" for the ranks'
    lines; None (copy every line) for other launchers."""
    if os.path.basename(argv[0]) != "horovodrun":
        return None
    ranks_started = []

    def kind(line):
        if _RANK_TAG.match(line):
            ranks_started.append(True)
            return "copy"
        if ranks_started:
            return "own"
        return "drop" if _TF_START_UP.match(line) else "copy"

    return kind


class Outcome(collections.namedtuple("Outcome", "code tail stopped report")):
    """What `run_once` saw: the launcher's exit status, its last output lines, the signal forwarded
    to it (or None), and the log file its own report went to instead of the console (or None)."""


def run_once(argv, env, tail_lines=TAIL_LINES, kind=None):
    """Run `argv`, copying its stdout and stderr through; returns an `Outcome`. `kind(line)`
    (`launcher_lines`): "drop", neither copied nor kept; "own", kept, and copied when the launcher
    has exited, or written to `Outcome.report` when the ranks' stop line explains the exit.

    SIGTERM/SIGINT/SIGHUP sent to tfdist-run go to the launcher too (it stops its ranks); the
    caller then does not relaunch. Ctrl-C at a terminal reaches both already. SIGUSR1/SIGUSR2
    (a scheduler's early warning, `sbatch --signal=B:USR1@90`) go on as they are to mpirun and
    srun, which pass them to every rank; horovodrun would die of them, so it gets SIGTERM, which
    it passes to every rank (tfdist's preemption stops them gracefully; horovodrun kills what is
    left after 5 s). horovodrun gets the first signal only: it stops on one, whatever comes next.
    """
    tail = collections.deque(maxlen=tail_lines)
    held = []  # (sink, raw line): the launcher's own lines, in the order they came
    lock = threading.Lock()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stopped = []

    horovodrun = os.path.basename(argv[0]) == "horovodrun"

    def forward(signum, frame):
        stopped.append(signum)
        if horovodrun and len(stopped) > 1:
            return  # horovodrun acts on its first stop signal; more only risk its handler (patch 0009)
        passed_on = signal.SIGTERM if horovodrun and signum in (signal.SIGUSR1, signal.SIGUSR2) else signum
        try:
            proc.send_signal(passed_on)
        except OSError:
            pass

    previous = {s: signal.signal(s, forward)
                for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)}
    writable = {}

    def copy(sink, raw):
        if writable.get(sink, True):
            try:
                sink.write(raw)
                sink.flush()
            except OSError:  # e.g. `tfdist-run ... | head`: go on reading, so the job never blocks
                writable[sink] = False

    def pump(source, sink):
        for raw in iter(source.readline, b""):
            text = raw.decode(errors="replace").rstrip("\n")
            with lock:
                what = kind(text) if kind is not None else "copy"
                if what == "drop":
                    continue
                tail.append(text)
                if what == "own":
                    held.append((sink, raw))
                    continue
            copy(sink, raw)

    threads = [threading.Thread(target=pump, args=(proc.stdout, sys.stdout.buffer), daemon=True),
               threading.Thread(target=pump, args=(proc.stderr, sys.stderr.buffer), daemon=True)]
    for t in threads:
        t.start()
    try:
        code = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    for t in threads:  # a rank the launcher left behind may hold the pipe: do not wait for it
        t.join(timeout=10)
    with lock:
        lines, own = list(tail), list(held)
        held.clear()
    report = _write_report(argv, own) if own and preempted(lines) else None
    if report is None:
        for sink, raw in own:
            copy(sink, raw)
    return Outcome(code, lines, stopped[0] if stopped else None, report)


def report_note(argv, report):
    """" (horovodrun's own report: PATH)" for a last line, or "" without a report file."""
    return f" ({os.path.basename(argv[0])}'s own report: {report})" if report else ""


def _write_report(argv, own):
    """The launcher's own lines in a log file (its path), or None if none can be written."""
    try:
        with tempfile.NamedTemporaryFile("wb", prefix=f"tfdist-run-{os.path.basename(argv[0])}-",
                                         suffix=".log", delete=False) as f:
            f.writelines(raw for _, raw in own)
        return f.name
    except OSError:
        return None
