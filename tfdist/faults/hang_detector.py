"""The hang detector: ranks that wait in different collectives are named, then the job ends.

A collective that only some ranks enter (chief-only code that runs one; rank 0 in an allreduce
while rank 1 is in an allgather) waits forever, and every rank stays alive, so the watchdog has
nothing to report and Horovod's stall inspector does nothing over Gloo. `HorovodStrategy` starts
this detector after the watchdog (more than one rank). Every other rank sends rank 0 its
`tfdist.faults.hang.snapshot()` once a second over the watchdog's connection; rank 0 judges:

- a hang is every live rank inside a collective or Keras step (`tfdist.faults.hang` marks) for longer
  than the warn bound, and not all in the same one (by name: Horovod matches collectives by
  name, and a step's name holds its number). Ranks in the same step, however slow, do not hang;
  a rank outside every mark (computing, doing I/O) is not stuck, so there is no verdict until it
  waits too;
- the warn bound is `TFDIST_HANG_WARN_SECONDS` (default 60 s), and never less than 5x the longest
  step or collective any rank has finished in this job;
- past it, rank 0 prints one line to stderr (and every rank to its own) naming each rank, its host,
  where it waits, for how long, and the last mark it finished;
- `TFDIST_HANG_TIMEOUT` seconds (default 300) after the hang began, still stuck, every rank prints
  the line again and exits with the watchdog's code 3 (`watchdog.running().end_job`).

```python
from tfdist import collectives
from tfdist.faults import hang_detector
from tfdist.faults import watchdog
collectives.init()
watchdog.start()
hang_detector.start()     # no-op without a watchdog, or with TFDIST_HANG_WARN_SECONDS=0
```

Environment: `TFDIST_HANG_WARN_SECONDS` (0 turns the detector off), `TFDIST_HANG_TIMEOUT` (0: warn,
never end the job).
"""

import os
import sys
import threading
import time

from tfdist.faults import hang
from tfdist.faults import watchdog
from tfdist.faults.watchdog_support import clip

WARN_ENV, TIMEOUT_ENV = "TFDIST_HANG_WARN_SECONDS", "TFDIST_HANG_TIMEOUT"
DEFAULT_WARN_SECONDS, DEFAULT_TIMEOUT_SECONDS = 60.0, 300.0
STEP_FACTOR = 5  # the warn bound is at least this many times the longest finished step or collective
REPORT_SECONDS = 1.0
KIND, NOTICE = "activity", "hang"  # watchdog messages: a rank's snapshot; rank 0's line for every rank
WHAT_CHARS = 200  # longest name of a collective or step a message carries (cut visibly)
SHOWN_RANKS = 8  # ranks listed by number in one group of the line; more are counted
FIX = ("Every rank must run the same collectives in the same order: code that runs on some ranks only "
       "(`if strategy.is_chief:`) must not call one (tfdist.collectives, fit, evaluate, or creating a "
       "variable in strategy.scope())")
DATA_HINT = ("Some ranks are in a train step the others did not start: if their data ran out first, give every "
             "rank the same global-batch dataset, or per-rank data with HorovodStrategy(batch_convention='per_rank')")

_reports = {}  # rank -> (rank 0's time.monotonic() when received, that rank's snapshot)
_active = None


def settings():
    """(warn seconds, timeout seconds) from the environment; ValueError names a bad value."""
    values = []
    for env, default in ((WARN_ENV, DEFAULT_WARN_SECONDS), (TIMEOUT_ENV, DEFAULT_TIMEOUT_SECONDS)):
        text = os.environ.get(env, "").strip()
        try:
            values.append(float(text) if text else default)
            if values[-1] < 0:
                raise ValueError
        except ValueError:
            raise ValueError(f"{env}={clip(text, 40)!r}: expected a number of seconds, 0 or more "
                             "(0 turns it off)") from None
    return tuple(values)


def start():
    """Start the detector on this rank (every rank calls it, after `watchdog.start()`).

    Returns it, or None without a watchdog (one rank, `watchdog=False`) or with
    `TFDIST_HANG_WARN_SECONDS=0`. Starting twice returns the running one."""
    global _active
    dog = watchdog.running()
    warn, timeout = settings()
    if _active is not None or dog is None or warn == 0:
        return _active
    _active = _Detector(dog, warn, timeout)
    threading.Thread(target=_active.run, name="tfdist-hang", daemon=True).start()
    return _active


def _record(message):
    try:
        _reports[int(message["rank"])] = (time.monotonic(), message)
    except (KeyError, TypeError, ValueError):
        pass  # not a report this version understands: never disturb the watchdog


def _print(message):
    text = message.get("text")
    if isinstance(text, str):
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


watchdog.on_message(KIND, _record)  # at import, before any watchdog starts: none is missed
watchdog.on_message(NOTICE, _print)


class _Detector:
    def __init__(self, dog, warn, timeout):
        self.dog, self.warn, self.timeout = dog, warn, timeout
        self.episode = None  # the names the ranks wait in, once a hang was reported
        self.ends_at = None  # when the reported hang ends the job (time.monotonic()), or None

    def run(self):
        try:
            while not (self.dog.stopped or self.dog.failing):
                time.sleep(REPORT_SECONDS)
                if self.dog.rank != 0:
                    state = hang.snapshot()
                    for key in ("what", "last", "last_step", "longest_what"):
                        if state[key] is not None:
                            state[key] = clip(state[key], WHAT_CHARS)
                    self.dog.send_all({"t": KIND, "rank": self.dog.rank, **state})
                else:
                    self.judge(time.monotonic())
        except Exception as e:  # noqa: BLE001 - never take the training process down from here
            sys.stderr.write(f"tfdist hang detector: rank {self.dog.rank}: stopped: {e!r}\n")

    def states(self, now):
        """{rank: (host, what, since, last, last_step, (longest, its what))} of every live rank, or
        None while a rank has not reported yet. `since`: when it entered `what`, on this rank's clock."""
        own = hang.snapshot()
        found = {0: (self.dog.host, own, now)}
        for rank, peer in list(self.dog.peers.items()):
            if rank not in _reports:
                return None
            received, report = _reports[rank]
            found[rank] = (peer.host, report, received)
        return {rank: (host, s.get("what"), at - float(s.get("for") or 0.0), s.get("last"), s.get("last_step"),
                       (float(s.get("longest") or 0.0), s.get("longest_what")))
                for rank, (host, s, at) in sorted(found.items())}

    def judge(self, now):
        states = self.states(now)
        if not states or len(states) < 2 or any(s[1] is None for s in states.values()) or \
                len({s[1] for s in states.values()}) == 1:
            self.episode = self.ends_at = None
            return
        longest = max((s[5] for s in states.values()), key=lambda pair: pair[0])
        bound = max(self.warn, STEP_FACTOR * longest[0])
        began = max(s[2] for s in states.values())  # when the last rank started to wait
        if now - began < bound:
            self.episode = self.ends_at = None
            return
        episode = tuple((rank, s[1]) for rank, s in states.items())
        if episode != self.episode:
            self.episode = episode
            self.ends_at = began + max(self.timeout, bound) if self.timeout else None
            line = self.line(states, now, bound, longest)
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
            self.dog.send_all({"t": NOTICE, "text": line})
        elif self.ends_at is not None and now >= self.ends_at and not (self.dog.stopped or self.dog.failing):
            self.dog.end_job(self.line(states, now, bound, longest))

    def line(self, states, now, bound, longest):
        """The one line naming every rank's wait, grouped by what it waits in and finished last."""
        groups = {}
        for rank, (host, what, since, last, last_step, _) in states.items():
            groups.setdefault((what, last, last_step), []).append((rank, host, now - since))
        parts = [_group(what, last, last_step, members) for (what, last, last_step), members in groups.items()]
        waited = now - max(s[2] for s in states.values())
        why = (f"{WARN_ENV}={self.warn:g}" if bound == self.warn else
               f"{STEP_FACTOR}x the longest step or collective so far, {longest[1]}: {longest[0]:.1f} s")
        if self.ends_at is None:
            then = f"The job is not ended ({TIMEOUT_ENV}=0)."
        elif now >= self.ends_at:
            then = (f"Stopping every rank with exit code {watchdog.EXIT_CODE} after {waited:.0f} s "
                    f"({TIMEOUT_ENV}={self.timeout:g}).")
        else:
            then = f"Ending the job in {self.ends_at - now:.0f} s ({TIMEOUT_ENV}={self.timeout:g})."
        in_step = {str(s[1]).startswith("train step") for s in states.values()}
        hint = f" {DATA_HINT}." if in_step == {True, False} else ""
        return (f"tfdist hang: ranks wait in different collectives for {waited:.0f} s (warn bound {bound:.0f} s: "
                f"{why}): {'; '.join(parts)}. {FIX}.{hint} {then}")


def _group(what, last, last_step, members):
    ranks = [rank for rank, _, _ in members]
    shown = ", ".join(str(r) for r in ranks[:SHOWN_RANKS]) + (f" and {len(ranks) - SHOWN_RANKS} more"
                                                              if len(ranks) > SHOWN_RANKS else "")
    hosts = sorted({host for _, host, _ in members})
    where = ", ".join(hosts[:SHOWN_RANKS]) + (f" and {len(hosts) - SHOWN_RANKS} more" if len(hosts) > SHOWN_RANKS
                                              else "")
    waits = sorted(wait for _, _, wait in members)
    waited = f"{waits[0]:.0f} s" if round(waits[0]) == round(waits[-1]) else f"{waits[0]:.0f} to {waits[-1]:.0f} s"
    finished = f"last finished: {last or 'nothing yet'}"
    if last_step is not None and last_step != last:
        finished += f", after {last_step}"
    who = f"rank {shown} (host {where})" if len(ranks) == 1 else f"ranks {shown} (host{'s' * (len(hosts) > 1)} {where})"
    return f"{who} in {what} for {waited} ({finished})"
