"""The launcher's output, copied through `tfdist-run` line by line, its last lines kept.

`tfdist-run` stays the launcher's parent (for its failure summary, `tfdist.launch.job_summary`, and for
`--max-restarts`, `tfdist.launch.recovery`). It copies the launcher's stdout and stderr through as they
come and keeps the last `TAIL_LINES` lines to analyse. horovodrun imports TensorFlow itself, to
check its Horovod build, before it starts any rank: those start-up lines, a third copy of what
the ranks print, are dropped (`launcher_noise`); nothing else is. No TensorFlow here.
"""

import collections
import os
import re
import signal
import subprocess
import sys
import threading

TAIL_LINES = 400
# TensorFlow's C++ start-up lines below ERROR: absl's header and format, TF's own format, and the
# second line of its CPU-instructions notice.
_TF_START_UP = re.compile(r"^(?:WARNING: All log messages before absl::InitializeLog\(\)"
                          r"|[IW]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w./-]+:\d+\] "
                          r"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IW] "
                          r"|To enable the following instructions: )")
_RANK_TAG = re.compile(r"^\[\d+(?:,\d+)?\]<std(?:out|err)>:")
PREEMPTED_CODE = 75  # tfdist.preemption.EXIT_CODE (not imported: it loads TensorFlow)
_PREEMPTED = re.compile(r"tfdist preemption: (.+?): every rank stopped together; (.+?)\. Exit code 75")


def preempted(lines):
    """(why, what was saved) from the ranks' graceful-stop line in the job's output, or None."""
    for line in lines:
        if m := _PREEMPTED.search(line):
            return m[1], m[2]
    return None


def launcher_noise(argv):
    """For `run_once(keep=...)`: drop horovodrun's own TensorFlow start-up lines, which come
    before any rank's (rank-tagged) line; None (keep all) for other launchers."""
    if os.path.basename(argv[0]) != "horovodrun":
        return None
    ranks_started = []

    def keep(line):
        if ranks_started:
            return True
        if _RANK_TAG.match(line):
            ranks_started.append(True)
            return True
        return not _TF_START_UP.match(line)

    return keep


def run_once(argv, env, tail_lines=TAIL_LINES, keep=None):
    """Run `argv`, copying its stdout and stderr through; (exit status, its last output lines,
    the signal forwarded to it or None). `keep(line)` False: that line is neither copied nor kept.

    SIGTERM/SIGINT/SIGHUP sent to tfdist-run go to the launcher too (it stops its ranks); the
    caller then does not relaunch. Ctrl-C at a terminal reaches both already. SIGUSR1/SIGUSR2
    (a scheduler's early warning, `sbatch --signal=B:USR1@90`) go on as they are to mpirun and
    srun, which pass them to every rank; horovodrun would die of them, so it gets SIGTERM, which
    it passes to every rank (tfdist's preemption stops them gracefully; horovodrun kills what is
    left after 5 s).
    """
    tail = collections.deque(maxlen=tail_lines)
    lock = threading.Lock()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stopped = []

    horovodrun = os.path.basename(argv[0]) == "horovodrun"

    def forward(signum, frame):
        stopped.append(signum)
        passed_on = signal.SIGTERM if horovodrun and signum in (signal.SIGUSR1, signal.SIGUSR2) else signum
        try:
            proc.send_signal(passed_on)
        except OSError:
            pass

    previous = {s: signal.signal(s, forward)
                for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)}

    def pump(source, sink):
        writable = True
        for raw in iter(source.readline, b""):
            text = raw.decode(errors="replace").rstrip("\n")
            if keep is not None and not keep(text):
                continue
            if writable:
                try:
                    sink.write(raw)
                    sink.flush()
                except OSError:  # e.g. `tfdist-run ... | head`: go on reading, so the job never blocks
                    writable = False
            with lock:
                tail.append(text)

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
        return code, list(tail), (stopped[0] if stopped else None)
