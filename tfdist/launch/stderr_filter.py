"""Keep TensorFlow's C++ start-up lines, and the lines that escape `TF_CPP_MIN_LOG_LEVEL`, off a rank's stderr.

TensorFlow logs some lines through absl while its libraries load, before it reads
`TF_CPP_MIN_LOG_LEVEL`: they reach stderr whatever that level says, twice per process (each of its
two libraries logs them):

```
WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1795485010.736119   16659 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.
I0000 00:00:1795485151.146170   20027 port.cc:153] oneDNN custom operations are on. You may see ...
```

`python -m tfdist --` (what `tfdist-run` starts every rank with) calls `start(level, start_up)` on
every rank, rank 0 included, just before it executes the command: `level` is the rank's
`TF_CPP_MIN_LOG_LEVEL` (`tfdist.tuning.startup.quiet_log_level`'s on ranks other than 0, or the
one you set), `start_up` False where `TFDIST_TF_STARTUP_LINES=1` asks for TensorFlow's start-up
lines. fd 2 then goes through a small process that drops absl's header line, TensorFlow's start-up
notices (`START_UP`: the CUDA-driver, oneDNN and CPU-instruction lines, below ERROR), and the
absl-format lines below `level` (I and W for "2", also E for "3"; never F), and forwards
everything else unchanged, line by line as it comes (a line without its newline after 0.2 s).
It leaves when the last writer has closed the pipe. It is in a session of its own, nobody's child,
and ignores the signals that schedulers and terminals send (`IGNORED`): a launcher's signals to the
rank's process group, or Slurm's SIGTERM to every process of the job, cannot cut off what the rank
writes last (the preemption stop line, a traceback, the watchdog's line). The rank keeps its pid,
exit status and signals (it still `exec`s).
"""
import os
import re
import select
import signal

ABSL_HEADER = re.compile(rb"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR\r?$")
HOLD_SECONDS = 0.2  # how long a line without its newline waits for the rest
# TensorFlow's start-up notices below ERROR, by the file that logs them, and the second line of the
# CPU-instructions notice (it has no absl prefix).
START_UP = (ABSL_HEADER,
            re.compile(rb"^[IW]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ (?:cudart_stub|port|cpu_feature_guard)\.cc:\d+\] "),
            re.compile(rb"^To enable the following instructions: "))
IGNORED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2")


def noise(level):
    """The patterns of the lines to drop at `TF_CPP_MIN_LOG_LEVEL=level`: absl's "I0000 00:00:<time>
    <thread> <file>:<line>] " lines of the severities below it, and absl's header line."""
    severities = {"1": b"I", "2": b"IW", "3": b"IWE"}.get(str(level), b"")
    if not severities:
        return ()
    return (ABSL_HEADER, re.compile(rb"^[" + severities + rb"]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w./-]+:\d+\] "))


def patterns(level, start_up=True):
    """What the filter drops: `noise(level)`, and TensorFlow's start-up lines with `start_up`."""
    return tuple(dict.fromkeys((START_UP if start_up else ()) + noise(level)))


def start(level, start_up=True):
    """Route this process's fd 2 through the filter process (call just before `exec`); nothing
    to do when nothing is to be dropped (`patterns`)."""
    dropped = patterns(level, start_up)
    if not dropped:
        return
    source, sink = os.pipe()
    child = os.fork()
    if child == 0:  # fork again and leave at once: the filter is nobody's child
        try:
            os.setsid()
            if os.fork() == 0:
                for name in IGNORED:
                    signal.signal(getattr(signal, name), signal.SIG_IGN)
                os.close(sink)
                _detach(source)
                _run(3, 2, dropped)
        finally:
            os._exit(0)
    os.close(source)
    os.waitpid(child, 0)
    os.dup2(sink, 2)
    os.close(sink)


def _detach(source):
    """Keep only the pipe (as fd 3) and stderr (2): no other pipe of the job stays open here."""
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.dup2(source, 3)
    os.closerange(4, 1 << 16)


def _run(source, sink, patterns):
    pending, broken = b"", False
    while True:
        ready, _, _ = select.select([source], [], [], HOLD_SECONDS if pending else None)
        chunk = os.read(source, 65536) if ready else b""
        if ready and not chunk:
            break  # every writer closed: the rank and what it started have ended
        out, pending = split(pending + chunk, patterns, flush=not ready)
        broken = broken or not _write(sink, out)  # a closed stderr: go on reading, so the rank never blocks
    if not broken and not any(p.match(pending) for p in patterns):
        _write(sink, pending)


def split(data, patterns, flush=False):
    """(what to forward now, what to keep for later): complete lines but those matching `patterns`,
    and a partial line unless it may still become one (kept until `flush`)."""
    *lines, partial = data.split(b"\n")
    out = b"".join(line + b"\n" for line in lines if not any(p.match(line) for p in patterns))
    if partial and (flush or partial[:1] not in b"IWE" or len(partial) > 300):
        return out + partial, b""
    return out, partial


def _write(fd, data):
    try:
        while data:
            data = data[os.write(fd, data):]
        return True
    except OSError:
        return False
