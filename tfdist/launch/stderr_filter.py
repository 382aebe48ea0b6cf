"""Make `TF_CPP_MIN_LOG_LEVEL` hold for the C++ lines that escape it, on ranks other than 0.

TensorFlow logs some start-up lines through absl before absl is initialised; those reach stderr
whatever `TF_CPP_MIN_LOG_LEVEL` says, twice per process (two of its libraries log them):

```
WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1795485010.736119   16659 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.
I0000 00:00:1795485151.146170   20027 port.cc:153] oneDNN custom operations are on. You may see ...
```

`python -m tfdist --` (what `tfdist-run` starts every rank with) calls `start(level)` on ranks
other than 0 with their `TF_CPP_MIN_LOG_LEVEL` (`tfdist.tuning.startup.quiet_log_level`'s, or the one you
set), unless `TFDIST_QUIET_RANKS=0`, just before it executes the command. fd 2 then goes through
a small process that drops absl's header line and the absl-format lines below that level (I and
W for "2", also E for "3"; never F) and forwards everything else unchanged, line by line as it
comes (a line without its newline after 0.2 s). It leaves when the last writer has closed the
pipe, and it is in a session of its own and nobody's child, so a launcher's signals to the rank's
process group cannot cut off what the rank wrote last (a traceback, the watchdog's line). The rank
keeps its pid, exit status and signals (it still `exec`s). Rank 0's output is never filtered.
"""

import os
import re
import select

ABSL_HEADER = re.compile(rb"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR\r?$")
HOLD_SECONDS = 0.2  # how long a line without its newline waits for the rest


def noise(level):
    """The patterns of the lines to drop at `TF_CPP_MIN_LOG_LEVEL=level`: absl's "I0000 00:00:<time>
    <thread> <file>:<line>] " lines of the severities below it, and absl's header line."""
    severities = {"1": b"I", "2": b"IW", "3": b"IWE"}.get(str(level), b"")
    if not severities:
        return ()
    return (ABSL_HEADER, re.compile(rb"^[" + severities + rb"]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w./-]+:\d+\] "))


def start(level):
    """Route this process's fd 2 through the filter process (call just before `exec`)."""
    patterns = noise(level)
    if not patterns:
        return
    source, sink = os.pipe()
    child = os.fork()
    if child == 0:  # fork again and leave at once: the filter is nobody's child
        try:
            os.setsid()
            if os.fork() == 0:
                os.close(sink)
                _detach(source)
                _run(3, 2, patterns)
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
