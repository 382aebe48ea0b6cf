"""The last line `tfdist-run` prints for a failed job: the first rank that failed, its host, the cause.

A failed job's output ends with the launcher's report, which names the first process to *exit*:
often a survivor that the watchdog stopped (exit code 3), while the rank that raised or died is
named further up. `tfdist-run` therefore stays the launcher's parent, copies its output through,
keeps the last lines (`tfdist.launch.launcher_output`) and, when the launcher exits non-zero, prints
after everything else:

```
tfdist-run: job failed (exit status 1): rank 1 (host node07) failed: ValueError: bad label 11
```

Where the cause comes from, first match wins:

0. the hang detector's line (`tfdist hang: ranks wait in different collectives ...`): the ranks
   and what each waited in;
1. the watchdog's line (`tfdist watchdog: rank R (host H, pid P) died | failed: ... | stopped
   responding ...`), which every survivor prints: the rank that failed first, whichever exited
   first (`tfdist.launch.recovery.analyse`, which also adds the launcher's exit code or signal);
2. the launcher's report of the first process to exit (horovodrun's `Process name`/`Exit code`,
   mpirun's and srun's lines), unless that process is a survivor stopped with the watchdog's exit
   code, plus that rank's own last words (`[R]<stderr>:` lines: a traceback's last line, an
   argparse error, Python's "can't open file");
3. the first rank whose own last words are in the output;
4. the launcher's exit status alone.

Why the job's output and not a record file written by the ranks: the output reaches `tfdist-run`
from every host through the launcher, with no shared file system, and also for ranks that died
before they could write anything (killed, failed at import). No TensorFlow here.
"""

import re
import sys

from tfdist.launch import launcher_output
from tfdist.launch import recovery
from tfdist.faults.watchdog_support import LINE_CHARS, clip

STOPPED_CODE = 3  # tfdist.faults.watchdog.EXIT_CODE (not imported here: the watchdog loads TensorFlow)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_VERDICT = re.compile(r"tfdist watchdog: rank \d+ \(host .+?, pid \d+\) .+?\. Stopping ")
# A rank's stderr line as horovodrun ("[1]<stderr>:") or mpirun --tag-output ("[1,1]<stderr>:") tags it.
_RANK_STDERR = re.compile(r"^\[(?:\d+,)?(\d+)\]<stderr>:(.*)$")
_LAST_WORDS = (
    re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|Interrupt)\b(?::.*)?$"),  # a traceback's last line
    re.compile(r"^\S+: error: .+"),  # argparse: "train.py: error: ..."
    re.compile(r"can't open file .+"),  # python missing.py (on a host where the file is missing)
    re.compile(r"^tfdist: rank \S+ \(host .+?\): cannot run .+"),  # tfdist.tuning.startup: no such program
)


def last_words(lines):
    """{rank: its last error line} from rank-tagged stderr lines, in the order ranks first erred."""
    found = {}
    for line in lines:
        m = _RANK_STDERR.match(line)
        if not m or m[2][:1].isspace():
            continue
        text = _ANSI.sub("", m[2]).strip()
        if any(p.search(text) for p in _LAST_WORDS):
            found[int(m[1])] = clip(text, LINE_CHARS)
    return found


def describe(code, lines, host_of_rank=None):
    """The first failing rank, its host and what happened to it, in words."""
    failure = recovery.analyse(code, lines, host_of_rank)
    if any(_VERDICT.search(line) or "tfdist hang: " in line for line in lines):
        return failure.cause
    words = last_words(lines)
    stopped = failure.cause.endswith(f"exited with code {STOPPED_CODE}")
    if failure.rank is not None and not (stopped and set(words) - {failure.rank}):
        own = words.get(failure.rank)
        if stopped and not own:
            return (f"{failure.cause}: the watchdog's code for a rank stopped because another rank "
                    "failed; that rank's own output is above")
        return failure.cause + (f": {own}" if own and own not in failure.cause else "")
    if words:
        rank, own = next(iter(words.items()))
        host = host_of_rank(rank) if host_of_rank else None
        return f"rank {rank}" + (f" (host {host})" if host else "") + f" failed: {own}"
    return failure.cause


def run(argv, host_of_rank=None, env=None):
    """Run the launcher `argv` with its output copied through; on failure print the summary line
    last. Returns the exit status (128+N for a launcher killed by signal N)."""
    import os

    code, tail, stopped, report = launcher_output.run_once(argv, dict(os.environ if env is None else env),
                                                           kind=launcher_output.launcher_lines(argv))
    status = code if code >= 0 else 128 - code
    # The ranks' stop line decides, not the launcher's status: horovodrun, itself sent SIGTERM,
    # exited 0 in one loaded run although both ranks had exited 75.
    stop = recovery.preempted(tail)
    if code == 0 and stop is None:
        return 0
    if stop is not None:
        print(f"tfdist-run: job preempted ({stop[0]}): {stop[1]}. Exit status {recovery.PREEMPTED_CODE}: "
              f"run the same command again to continue{launcher_output.report_note(argv, report)}.",
              file=sys.stderr, flush=True)
        return recovery.PREEMPTED_CODE
    if stopped is not None:
        what = f"stopped by {recovery.signal_name(stopped)} sent to tfdist-run"
    else:
        what = describe(code, tail, host_of_rank)
    print(f"tfdist-run: job failed (exit status {status}): {what}", file=sys.stderr, flush=True)
    return status
