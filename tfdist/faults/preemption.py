"""Graceful preemption: on SIGTERM or SIGUSR1 every rank stops at one agreed step, saves, exits 75.

Schedulers end jobs with a signal and a grace period: Slurm sends SIGTERM at the time limit or on
preemption (or the signal `#SBATCH --signal=USR1@90` asks for, ahead of time), then SIGKILL after
`KillWait`. The signal may reach every rank (`srun`, `scancel`), only some of them, or only the
launcher. tfdist turns it into an orderly stop:

1. the rank that got it tells rank 0 over the watchdog's connections (nothing on the training
   path: no collective per step);
2. rank 0, at its next step boundary (step `c` done), fixes the stop at step `c + 1` and tells
   every rank; it waits for each rank's acknowledgement before it starts step `c + 1`. No rank
   can finish step `c + 1` without rank 0's part of that step's allreduce, so every rank learns
   the step before it could pass it;
3. after step `c + 1` every rank saves through the job's own checkpointing (in `fit`:
   `tfdist.keras.preemption`), the ranks wait for each other, and each exits with `EXIT_CODE`
   (75, "preempted, resumable"; `tfdist-run` exits with it too, `--max-restarts` relaunches).
   From the stop on, the preemption signals are ignored until the process ends, however many
   arrive (Slurm signals every process of the job, horovodrun passes its own SIGTERM on: a second
   one must not turn 75 into 143), and the exit skips Python's last garbage collection (see
   `exit_preempted`), so that it ends within horovodrun's 5 s grace.

A custom training loop uses `StepAgreement` directly:

```python
from tfdist.faults import preemption
agreement = preemption.StepAgreement()          # catches SIGTERM/SIGUSR1 from now on
for step in range(start, total_steps):
    train_step()
    if agreement.stop_after(step + 1):           # every rank returns True after the same step
        manager.save(checkpoint_number=step + 1)  # your checkpoint, with the step to resume at
        preemption.exit_preempted(f"saved at step {step + 1}")
agreement.close()                                # signals back to their previous handlers
```

Environment: `TFDIST_PREEMPTION_SIGNALS` (comma-separated names, default `TERM,USR1`; `none`
leaves every signal alone), `TFDIST_PREEMPTION_ACK_SECONDS` (how long rank 0 waits for the
ranks' acknowledgements, default 60), `TFDIST_PREEMPTION_EXIT_SECONDS` (how long the interpreter's
exit may take after the stop before the process prints its threads' stacks and ends with 75,
default 20).
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import json
import logging
import os
import signal
import sys
import threading
import time

import tensorflow as tf

from tfdist import collectives
from tfdist.faults import watchdog
from tfdist.errors import PreemptionError
from tfdist.faults.watchdog_support import host_name

log = logging.getLogger("tfdist")

EXIT_CODE = 75  # sysexits.h EX_TEMPFAIL: "temporary failure, try again": preempted, resumable
SIGNALS_ENV = "TFDIST_PREEMPTION_SIGNALS"
CONTROL_ENV = "TFDIST_CONTROL_FILE"  # tfdist-run writes {"stop": "epoch_end", "why": ...} there to grow the job
CONTROL_CHECK_SECONDS = 1.0
ACK_ENV = "TFDIST_PREEMPTION_ACK_SECONDS"
EXIT_ENV = "TFDIST_PREEMPTION_EXIT_SECONDS"  # how long the interpreter's exit may take after a stop
DEFAULT_SIGNALS = "TERM,USR1"
MARK = "tfdist preemption:"  # every line tfdist prints about it starts so (tfdist-run reads them)

_REQUEST, _STOP_AT, _ACK = "preempt", "preempt-at", "preempt-ack"


def signals_from_environment(env=None):
    """The signals that start a graceful stop: `TFDIST_PREEMPTION_SIGNALS` or TERM and USR1."""
    text = (env if env is not None else os.environ).get(SIGNALS_ENV, DEFAULT_SIGNALS).strip()
    if text.lower() in ("", "none", "0", "off"):
        return []
    found = []
    for name in (part.strip().upper() for part in text.split(",") if part.strip()):
        number = getattr(signal, name if name.startswith("SIG") else f"SIG{name}", None)
        if not isinstance(number, signal.Signals) or number in (signal.SIGKILL, signal.SIGSTOP):
            raise PreemptionError(f"{SIGNALS_ENV}={text!r}: {name!r} is not a signal tfdist can catch; "
                                  "give names such as TERM,USR1 (or none)")
        found.append(number)
    return found


class _Requests:
    """This process's stop requests: from its own signals, or relayed by the watchdog thread."""

    def __init__(self):
        self.changed = threading.Condition()
        self.reason = None  # "SIGTERM on rank 1 (host h)": why the job stops
        self.stop_at = None  # the agreed step count (non-zero ranks: from rank 0)
        self.at_epoch_end = False  # asked to stop at an epoch's end (tfdist-run growing the job)
        self.acks = set()

    def request(self, reason, at_epoch_end=False):
        with self.changed:
            if self.reason is None:
                self.reason, self.at_epoch_end = reason, at_epoch_end
            elif not at_epoch_end:
                self.at_epoch_end = False  # a signal turns a pending epoch-end stop into a prompt one
            self.changed.notify_all()

    def on_message(self, message):
        kind = message.get("t")
        try:
            if kind == _REQUEST:
                self.request(str(message["why"]))
            elif kind == _STOP_AT:
                with self.changed:
                    self.reason = str(message["why"])
                    self.stop_at = int(message["step"])
                    self.at_epoch_end = bool(message.get("epoch_end"))
                    self.changed.notify_all()
                dog = watchdog.running()
                if dog is not None and 0 in dog.peers:
                    dog.peers[0].send({"t": _ACK, "rank": collectives.rank(), "step": self.stop_at})
            elif kind == _ACK:
                with self.changed:
                    self.acks.add(int(message["rank"]))
                    self.changed.notify_all()
        except (KeyError, TypeError, ValueError):
            return  # a message this version does not understand: never disturb the watchdog

    def reset(self):
        with self.changed:
            self.reason, self.stop_at, self.at_epoch_end, self.acks = None, None, False, set()


_requests = _Requests()
for _kind in (_REQUEST, _STOP_AT, _ACK):
    watchdog.on_message(_kind, _requests.on_message)

_catching = []  # the StepAgreements whose handlers are in place
_ignored = {}  # signal -> its handler before tfdist caught it, for the signals ignored since a stop
_quick_exit = []  # whether the exit's garbage collection is skipped already (`exit_preempted`)


def requested():
    """Why this job is stopping ("SIGTERM on rank 1 (host h)"), or None."""
    return _requests.reason


class StepAgreement:
    """Catch the preemption signals and tell every rank, after the same step, that it must stop.

    Every rank creates one (at the same point: no collective happens here) and calls
    `stop_after(steps_done)` after each step with the same count. Without a watchdog (one rank,
    or `HorovodStrategy(watchdog=False)`) a rank can only stop on its own signal: on several
    ranks that would leave the others waiting, so the signals are then left alone (warned once).

    Args:
        signals: the signals to catch; default `TFDIST_PREEMPTION_SIGNALS` (TERM and USR1).
    """

    def __init__(self, signals: list[int] | None = None):
        self.rank, self.size = collectives.process_rank(), collectives.process_size()
        self.host = host_name()
        self.signals = signals_from_environment() if signals is None else list(signals)
        self._previous = {}
        self._relayed = False
        self._next_control_check = 0.0  # rank 0 reads tfdist-run's control file at most once a second
        if self.size > 1 and watchdog.running() is None and self.signals:
            log.warning("%s rank %d: no watchdog runs (watchdog=False), so a signal cannot be agreed on "
                        "across ranks; SIGTERM/SIGUSR1 keep their default action", MARK, self.rank)
            self.signals = []
        if threading.current_thread() is not threading.main_thread():
            self.signals = []  # Python lets only the main thread set handlers
        for number in self.signals:
            previous = signal.signal(number, self._on_signal)
            # after a stop that this process survived (SystemExit caught): the handler from before it
            self._previous[number] = _ignored.pop(number, previous)
        if self._previous:
            _catching.append(self)

    def _on_signal(self, number, frame):
        _requests.request(f"{signal.Signals(number).name} on rank {self.rank} (host {self.host})")

    def close(self):
        """Give the signals back to their previous handlers (after `exit_preempted`: nothing, they
        stay ignored)."""
        for number, previous in self._previous.items():
            signal.signal(number, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}
        if self in _catching:
            _catching.remove(self)

    @property
    def reason(self) -> str | None:
        """Why the job stops, once a signal arrived anywhere (None before)."""
        return _requests.reason

    @property
    def at_epoch_end(self) -> bool:
        """Whether the agreed stop is at the end of an epoch (a request from `tfdist-run` to grow
        the job: the epoch's own checkpoint is the one to resume from)."""
        return _requests.at_epoch_end

    def stop_after(self, steps_done: int, ends_epoch=None) -> bool:
        """Whether every rank stops now, after `steps_done` steps (the same count on every rank).

        `ends_epoch(step)`: whether step number `step` ends an epoch. A prompt stop (a signal)
        does not stop there, but one step later, so that the epoch's end runs first; a stop at an
        epoch's end (`tfdist-run` growing the job) waits for the next one.
        """
        if self.rank != 0 and self.size > 1 and watchdog.running() is not None:
            return self._follow(steps_done)
        self._read_control_file()
        with _requests.changed:
            reason, stop_at, at_epoch_end = _requests.reason, _requests.stop_at, _requests.at_epoch_end
        if reason is None:
            return False
        if stop_at is None:
            alone = self.size == 1 or watchdog.running() is None
            stop_at = steps_done if alone else steps_done + 1  # no other rank can be past it
            if at_epoch_end and ends_epoch is not None:
                limit = stop_at + 10**7
                while stop_at < limit and not ends_epoch(stop_at):
                    stop_at += 1
                at_epoch_end = stop_at < limit
            elif ends_epoch is not None and ends_epoch(stop_at):
                stop_at += 1
            stop_at = self._decide(stop_at, reason, at_epoch_end and ends_epoch is not None)
        return steps_done >= stop_at

    def _read_control_file(self):
        """Rank 0: a stop that `tfdist-run` asks for in its control file (checked once a second)."""
        path = os.environ.get(CONTROL_ENV)
        now = time.monotonic()
        if not path or now < self._next_control_check:
            return
        self._next_control_check = now + CONTROL_CHECK_SECONDS
        try:
            with open(path) as f:
                request = json.load(f)
        except (OSError, ValueError):
            return
        if isinstance(request, dict) and request.get("stop") == "epoch_end":
            _requests.request(str(request.get("why", "tfdist-run asked")), at_epoch_end=True)

    def _follow(self, steps_done):
        with _requests.changed:
            reason, stop_at = _requests.reason, _requests.stop_at
        if reason is not None and stop_at is None and not self._relayed:
            self._relayed = True
            dog = watchdog.running()
            if dog is not None and 0 in dog.peers:
                dog.peers[0].send({"t": _REQUEST, "why": reason})
        if stop_at is None:
            return False
        if steps_done > stop_at:
            raise PreemptionError(f"{MARK} rank {self.rank} (host {self.host}) learned of the stop at step "
                                  f"{stop_at} only after step {steps_done}; the ranks' step counts differ "
                                  "(a fit or loop with a different number of steps on some rank)")
        return steps_done == stop_at

    def _decide(self, stop_at, reason, at_epoch_end=False):
        dog = watchdog.running()
        with _requests.changed:
            _requests.stop_at, _requests.at_epoch_end = stop_at, at_epoch_end
        message = {"t": _STOP_AT, "step": stop_at, "why": reason, "epoch_end": at_epoch_end}
        others = dog.send_all(message) if dog and self.size > 1 else []
        wanted = {peer.rank for peer in others}
        limit = float(os.environ.get(ACK_ENV, 60))
        deadline = time.monotonic() + limit
        with _requests.changed:
            while not wanted <= _requests.acks and time.monotonic() < deadline:
                _requests.changed.wait(min(1.0, max(deadline - time.monotonic(), 0.01)))
            missing = sorted(wanted - _requests.acks)
        if missing:
            raise PreemptionError(f"{MARK} rank(s) {missing} did not acknowledge the stop after step {stop_at} "
                                  f"within {ACK_ENV}={limit:g} s ({reason}); they may be hung")
        log.info("%s %s; every rank stops after step %d", MARK, reason, stop_at)
        return stop_at


def barrier(name="tfdist.faults.preemption.saved"):
    """Wait until every rank got here (the chief's saves are finished before anyone exits)."""
    if collectives.process_size() > 1:
        collectives.allreduce([tf.zeros([1], tf.int32)], name=name)


def _ignore_signals_until_exit():
    """The agreed stop is done: the signals the running agreements catch are ignored from now on.

    SIG_IGN, not a Python handler: Python puts SIG_DFL back for those late in its finalization.
    A `StepAgreement` made later in this process (one that caught the SystemExit) takes them over
    and gives back the handlers from before the stop."""
    if threading.current_thread() is not threading.main_thread():
        return  # the handlers stay the agreement's own (they only record a request)
    for agreement in list(_catching):
        for number, previous in agreement._previous.items():
            signal.signal(number, signal.SIG_IGN)
            _ignored.setdefault(number, previous)
        agreement._previous = {}
    _catching.clear()


def _skip_final_collection():
    """At exit (registered by `exit_preempted`, so it runs before the atexit callbacks registered
    earlier, Horovod's shutdown among them): the objects that exist are left out of Python's last
    garbage collections. Those went over TensorFlow's and Keras' objects: after a small fit the
    interpreter's exit took 7.6 and 8.5 s on the 2-core test machine, 0.8 s without them, and
    horovodrun kills a rank 5 s after it passed SIGTERM on. Objects freed by reference counting
    still are (and their files flushed); what only a cycle holds is left to the OS."""
    gc.freeze()


def _guard_exit(limit, where):
    """Once the interpreter is ending (its main thread is done), give it `limit` seconds; then print
    every thread's stack and end the process with `EXIT_CODE`. What is saved is saved by then: a
    thread or exit handler that never returns (a library's shutdown waiting for a peer that has
    gone) must not keep the job running until the scheduler kills it, nor turn 75 into 137. A
    process that caught the SystemExit and goes on is left alone."""
    main = threading.main_thread()
    while main.is_alive():
        time.sleep(0.5)
    time.sleep(limit)
    try:
        sys.stderr.write(f"{MARK} {where} had not ended {limit:g} s into its exit after the stop "
                         f"({EXIT_ENV}); ending it with {EXIT_CODE}. Its threads:\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    finally:
        os._exit(EXIT_CODE)


def exit_preempted(what: str, saved: bool = True) -> None:
    """Every rank: wait for the others, say (chief) what happened, exit with `EXIT_CODE` (75).

    From here on the preemption signals are ignored (the process is ending with 75; more SIGTERMs
    from the scheduler or the launcher must not end it with 143), and the interpreter's exit skips
    its last garbage collection (`_skip_final_collection`).

    Args:
        what: what was saved and where the job resumes, for the job's one line.
        saved: whether a checkpoint was written (the line then says how to continue).
    """
    _ignore_signals_until_exit()
    if not _quick_exit:
        atexit.register(_skip_final_collection)
        where = f"rank {collectives.process_rank()} (host {host_name()}, pid {os.getpid()})"
        threading.Thread(target=_guard_exit, args=(float(os.environ.get(EXIT_ENV, 20)), where),
                         name="tfdist-preemption-exit", daemon=True).start()
        _quick_exit.append(True)
    barrier()
    if collectives.process_rank() == 0:
        reason = _requests.reason or "stop requested"
        message = (f"{MARK} {reason}: every rank stopped together; {what}. Exit code {EXIT_CODE} (preempted"
                   + ("; resumable): run the same command again to continue." if saved else ")."))
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    _requests.reset()
    raise SystemExit(EXIT_CODE)
