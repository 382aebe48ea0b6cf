"""The chief's save notices ("save #k done, path P"), sent over the watchdog's connections.

`tfdist.keras.chief_saves` numbers each rank's saves. The chief announces every finished save to the
other ranks (`announce`); another rank's k-th save waits for the chief's notice #k (`wait_for`)
before it writes anything, so once any rank's save returns, the chief's file is complete. The
notices travel on the watchdog's TCP connections (rank 0's main thread sends, each other rank's
watchdog thread receives), not through Horovod: the chief can save alone, and a rank waiting here
does not hold up a collective. A dead chief ends the wait through the watchdog's own verdict.

Environment: `TFDIST_SAVE_TIMEOUT` (seconds a rank waits for the chief's matching save before
`SaveSyncError`; default 600).
"""

import logging
import os
import threading
import time

from tfdist import collectives
from tfdist.faults import watchdog
from tfdist.errors import SaveSyncError
from tfdist.faults.watchdog_support import host_name

log = logging.getLogger("tfdist")

KIND = "saved"  # watchdog message {"t": KIND, "n": k, "path": P, "error": None or "Type: message"}
TIMEOUT_ENV = "TFDIST_SAVE_TIMEOUT"
DEFAULT_TIMEOUT = 600.0
WAIT_WARNING_SECONDS = 30.0  # a rank still waiting after this long says so (at half the timeout if shorter)


def channel_open():
    """Whether notices can travel: a watchdog runs (not with watchdog=False or a timeout of 0)."""
    return watchdog.running() is not None


def announce(number, path, error=None):
    """Tell every other rank that the chief's save #`number` (of `path`) is done, or failed."""
    dog = watchdog.running()
    if dog is not None:
        dog.send_all({"t": KIND, "n": number, "path": path, "error": error})


class _Received:
    """The chief's notices, as they arrive on the watchdog thread."""

    def __init__(self):
        self.changed = threading.Condition()
        self.finished = {}  # save number -> (path, error summary or None)
        self.paths = set()  # every path the chief has saved to

    def record(self, message):
        try:
            number, path, error = int(message["n"]), str(message["path"]), message.get("error")
        except (KeyError, TypeError, ValueError):
            return  # not a notice this version understands: never disturb the watchdog
        with self.changed:
            self.finished[number] = (path, error)
            if error is None:
                self.paths.add(path)
            self.changed.notify_all()

    def wait_for(self, number, call):
        timeout = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT))
        start = time.monotonic()
        warned = False
        with self.changed:
            while number not in self.finished:
                waited = time.monotonic() - start
                dog = watchdog.running()
                if dog is None or 0 not in dog.peers:
                    raise SaveSyncError(_unmatched(call, number, waited, "the chief (rank 0) left the job "
                                                   "(it ended normally) without making it"))
                if waited >= timeout:
                    raise SaveSyncError(_unmatched(call, number, waited, "the chief (rank 0) did not make "
                                                   f"it within {TIMEOUT_ENV}={timeout:g} s"))
                if not warned and waited >= min(WAIT_WARNING_SECONDS, timeout / 2):
                    warned = True
                    log.warning("%s; still waiting, up to %s=%g s", _unmatched(
                        call, number, waited, "the chief (rank 0) has not finished it yet"), TIMEOUT_ENV, timeout)
                self.changed.wait(min(1.0, max(timeout - waited, 0.01)))
            found = self.finished[number]
            for done in [n for n in self.finished if n <= number]:
                del self.finished[done]
            return found


_received = _Received()
watchdog.on_message(KIND, _received.record)  # at import, before any watchdog starts: none is missed


def wait_for(number, call):
    """(path, error) of the chief's save #`number` once it is done; `call` describes this rank's
    save (`model.save('p')`). Raises `SaveSyncError` naming rank, host, call and cause when the
    chief leaves first or `TFDIST_SAVE_TIMEOUT` passes; says so at WARNING while it waits long."""
    return _received.wait_for(number, call)


def chief_saved(path):
    """Whether the chief has announced a save to `path` (absolute, normalised) so far."""
    return path in _received.paths


def _unmatched(call, number, waited, what_happened):
    return (f"tfdist: rank {collectives.rank()} (host {host_name()}): {call} is this rank's save #{number}, "
            f"which waits for the chief's save #{number}, and {what_happened} ({waited:.0f} s so far). "
            "Likely cause: the chief never made a matching save. Every rank must make the same saves in "
            "the same order (the chief writes a shared path, the others wait for it); a save made on some "
            "ranks only shifts the numbering. Save on every rank, or on the chief only (`if "
            "strategy.is_chief:`), inside `tfdist.keras.chief_saves.chief_only_saves()` if other saves run on "
            "every rank")
