"""Liveness watchdog: when a rank dies or stalls, every other rank exits at once, naming it.

Horovod over Gloo gives a survivor no useful word on a dead peer: a killed peer surfaces as
"Connection reset by peer" in whatever collective is running, and a stalled one (stopped, hung,
unreachable host) as Gloo's 30 s recv timeout; neither names the rank or its host, and a launcher
that does not kill siblings (srun without --kill-on-bad-exit) leaves the rest to the user.

`HorovodStrategy` starts this watchdog when there is more than one rank. Rank 0 listens on one
TCP port; every other rank keeps one connection to it, and both ends send a heartbeat every
second from a daemon thread (nothing runs on the training path). Then:

- a connection that closes without a goodbye (killed, crashed, OOM-killed: the kernel closes the
  process's sockets) or falls silent for `timeout` seconds marks that rank dead;
- a rank that raises prints its full traceback first, then reports `Type: last meaningful line`
  of its error; `sys.exit(n)` with n not 0/None and Ctrl-C (KeyboardInterrupt) are reported too;
- rank 0 tells every survivor, and each prints one line naming the rank and its host to stderr
  and leaves with `os._exit(EXIT_CODE)`; the main thread may be blocked inside an allreduce,
  where no Python exception can reach it. Ranks that lose rank 0 do the same, naming rank 0;
- an error that every rank raises at the same point (`raised_on_every_rank`, e.g.
  NonFiniteLossError) gives the others VERDICT_GRACE_SECONDS to raise it too, so that every rank
  prints its own traceback and exits 1;
- a rank that ends normally says goodbye (atexit) and is not reported.

Example (normally `HorovodStrategy(watchdog=...)` does this for you):

```python
from tfdist import collectives; from tfdist.faults import watchdog
collectives.init()
watchdog.start(timeout=20.0)      # no-op on one rank; TFDIST_WATCHDOG_TIMEOUT overrides
```

Environment: `TFDIST_WATCHDOG_TIMEOUT` (seconds of silence before a rank counts as stalled; 0 turns
the watchdog off), `TFDIST_WATCHDOG_ADDR` (`host` or `host:port` rank 0 listens on and the others
connect to; default: the address of Horovod's Gloo interface, all interfaces bound).
"""

import atexit
import json
import os
import secrets
import selectors
import socket
import sys
import threading
import time

from tfdist import collectives
from tfdist.errors import WatchdogError
from tfdist.faults.watchdog_support import (Peer, advertised_host, clip, describe_exception,
                                     host_name, listen, read_line)

DEFAULT_TIMEOUT = 20.0  # below Gloo's own 30 s recv timeout, so the watchdog names the rank first
HEARTBEAT_SECONDS = 1.0
EXIT_CODE = 3  # "stopped because another rank failed"
# How long a rank whose own collective failed waits for the watchdog's verdict on a peer, so
# the message names the rank that died rather than the survivor that noticed; also how long a
# rank waits to raise an error that every rank raises (e.g. NonFiniteLossError) itself.
VERDICT_GRACE_SECONDS = 3.0
HELLO_SECONDS = 5.0  # how long an accepted connection may take to say which rank it is
TRACEBACK_SECONDS = 10.0  # how long a verdict waits for this rank's own traceback to be printed
_COLLECTIVE_ERROR_WORDS = ("horovod", "gloo", "connection reset", "timed out waiting")

_active = None
_exit_request = None  # (status,) once sys.exit(status) was called
_handlers = {}  # message kind -> handler(message) of another module (save_notices), on this thread


def running():
    """This process's watchdog, or None; other modules send over its connections (`send_all`)."""
    return _active


def on_message(kind, handler):
    """Call `handler(message)` on the watchdog thread for every message `{"t": kind, ...}`."""
    _handlers[kind] = handler


def start(timeout=None):
    """Start the watchdog on every rank (a collective: all ranks call it). Returns it, or None.

    `timeout`: seconds of silence before a rank counts as stalled; None uses
    `TFDIST_WATCHDOG_TIMEOUT` or `DEFAULT_TIMEOUT`. Nothing starts on one rank, with a timeout
    of 0, or when a watchdog already runs in this process. When rank 0 cannot listen, every rank
    raises the same `WatchdogError` (naming the address and the fix).
    """
    global _active
    if _active is not None or collectives.size() == 1:
        return _active
    if timeout is None:
        timeout = float(os.environ.get("TFDIST_WATCHDOG_TIMEOUT", DEFAULT_TIMEOUT))
    if timeout <= 0:
        return None
    rank, size = collectives.rank(), collectives.size()
    listener, record = None, None
    if rank == 0:
        try:
            listener = listen()
            record = {"addr": [advertised_host(), listener.getsockname()[1]],
                      "token": secrets.token_hex(16), "host": host_name(), "pid": os.getpid()}
        except WatchdogError as e:
            record = {"error": str(e)}
    # every rank learns rank 0's address, or why there is none
    hub = collectives.broadcast_object(record, name="tfdist.faults.watchdog.address")
    if "error" in hub:
        if listener is not None:
            listener.close()
        where = "" if rank == 0 else f" (reported to rank {rank}, host {host_name()})"
        raise WatchdogError(f"{hub['error']} Every rank stops with this error{where}.")
    dog = _Watchdog(rank, size, float(timeout), hub)
    if rank == 0:
        dog.accept_peers(listener, hub["token"])
    else:
        dog.connect_to_hub()
    _active = dog
    atexit.register(_at_exit)
    _chain_excepthook()
    _watch_sys_exit()
    threading.Thread(target=dog.run, name="tfdist-watchdog", daemon=True).start()
    return dog


class _Watchdog:
    def __init__(self, rank, size, timeout, hub):
        self.rank, self.size, self.timeout = rank, size, timeout
        self.hub = hub
        self.host = host_name()
        self.peers = {}  # rank -> Peer (rank 0: every other rank; others: rank 0 only)
        self.failing = False  # this rank is exiting with its own error
        self.stopped = False  # this rank said goodbye
        self.printing = threading.Lock()  # held while this rank prints its own traceback
        self.settled = set()  # ranks that left or reported their own failure
        self.pending = None  # (deadline, action): a verdict waiting for this rank's own error

    # --- setup (synchronous, inside HorovodStrategy.__init__) --------------------------------
    def accept_peers(self, listener, token):
        deadline = time.monotonic() + self.timeout
        while len(self.peers) < self.size - 1:
            listener.settimeout(max(deadline - time.monotonic(), 0.01))
            sock = None
            try:
                sock, _ = listener.accept()
                # A rank sends its hello at once; anything silent for long is not one of ours
                # (a port scanner, a health check) and must not hold up the others.
                hello, rest = read_line(sock, min(deadline, time.monotonic() + HELLO_SECONDS))
                if not isinstance(hello, dict):
                    raise ValueError("hello is not a JSON object")
            except (OSError, ValueError, KeyError):
                if sock is not None:
                    sock.close()
                if time.monotonic() < deadline:
                    continue
                missing = sorted(set(range(1, self.size)) - set(self.peers))
                listener.close()
                raise WatchdogError(
                    f"tfdist watchdog: rank(s) {missing} did not connect to rank 0 at "
                    f"{self.hub['addr'][0]}:{self.hub['addr'][1]} within {self.timeout:g} s. Set "
                    "TFDIST_WATCHDOG_ADDR to an address of rank 0's host the others can reach, or "
                    "pass HorovodStrategy(watchdog=False)."
                ) from None
            if hello.get("token") != token:
                sock.close()  # not one of ours
                continue
            peer = Peer(sock, hello["rank"], hello["host"], hello["pid"])
            peer.buffer = rest
            self.peers[peer.rank] = peer
        listener.close()

    def connect_to_hub(self):
        host, port = self.hub["addr"]
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=5)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise WatchdogError(
                        f"tfdist watchdog: rank {self.rank} cannot connect to rank 0's watchdog at "
                        f"{host}:{port} (host {self.hub['host']}): {e}. Set TFDIST_WATCHDOG_ADDR "
                        "to an address of rank 0's host the others can reach, or pass "
                        "HorovodStrategy(watchdog=False)."
                    ) from None
                time.sleep(0.2)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hub = Peer(sock, 0, self.hub["host"], self.hub["pid"])
        hub.send({"token": self.hub["token"], "rank": self.rank, "host": self.host, "pid": os.getpid()})
        self.peers[0] = hub

    # --- the daemon thread ---------------------------------------------------------------------
    def run(self):
        try:
            self._watch()
        except Exception as e:  # noqa: BLE001 - never take the training process down from here
            sys.stderr.write(f"tfdist watchdog: rank {self.rank}: watchdog stopped: {e!r}\n")

    def _watch(self):
        selector = selectors.DefaultSelector()
        for peer in self.peers.values():
            peer.sock.settimeout(5)
            selector.register(peer.sock, selectors.EVENT_READ, peer)
        next_beat = time.monotonic()
        while (self.peers or self.pending) and not self.stopped:
            wake = min(next_beat, self.pending[0]) if self.pending else next_beat
            for key, _ in selector.select(timeout=max(wake - time.monotonic(), 0)):
                self._receive(key.data, selector)
            now = time.monotonic()
            if self.pending and now >= self.pending[0]:
                action, self.pending = self.pending[1], None
                action()  # does nothing when this rank meanwhile raised its own error
            if now >= next_beat:
                next_beat = now + HEARTBEAT_SECONDS
                for peer in list(self.peers.values()):
                    peer.send({"t": "hb"})
                    if now - peer.last_heard > self.timeout:
                        self._peer_failed(peer, f"stopped responding: no heartbeat for "
                                                f"{now - peer.last_heard:.0f} s (hung, stopped, or "
                                                "its host is unreachable)")

    def _receive(self, peer, selector):
        try:
            data = peer.sock.recv(65536)
        except OSError:
            data = b""
        if not data:
            self._forget(peer, selector)
            if peer.rank not in self.settled:
                self.settled.add(peer.rank)
                self._peer_failed(peer, "died: its connection closed without a goodbye (killed, "
                                        "crashed, or out of memory)")
            return
        peer.last_heard = time.monotonic()
        peer.buffer += data
        while b"\n" in peer.buffer:
            line, peer.buffer = peer.buffer.split(b"\n", 1)
            try:
                message = json.loads(line)
            except ValueError:
                continue
            kind = message.get("t")
            if kind == "bye":
                self.settled.add(peer.rank)
                self._forget(peer, selector)
                return
            if kind == "failed":
                self.settled.add(peer.rank)
                what = f"failed: {message['error']}"
                self._verdict_on(message, lambda what=what: self._peer_failed(peer, what))
            elif kind == "dead":  # rank 0's verdict on another rank, or on itself
                self.settled.add(0)
                self._verdict_on(message, lambda text=message["text"]: self._exit(text))
            elif kind in _handlers:
                _handlers[kind](message)

    def _verdict_on(self, message, action):
        """Act on a peer's failure now, or, for an error every rank raises, once this rank had
        VERDICT_GRACE_SECONDS to raise it too (then it exits with its own traceback instead)."""
        if not message.get("every_rank"):
            action()
        elif self.pending is None:
            self.pending = (time.monotonic() + VERDICT_GRACE_SECONDS, action)

    def _forget(self, peer, selector):
        try:
            selector.unregister(peer.sock)
        except (KeyError, ValueError):
            pass
        peer.sock.close()
        self.peers.pop(peer.rank, None)

    def _peer_failed(self, peer, what):
        if self.stopped or self.failing:
            return  # this rank is already on its way out with its own story
        what = f"{peer.describe()} {what}"
        if self.rank == 0 and self.send_all({"t": "dead", "text": _verdict(what, "every rank"), "every_rank": False}, peer):
            time.sleep(0.2)  # let them read it before this process's exit resets the connections
        self._exit(_verdict(what, f"rank {self.rank} (host {self.host})"))

    def end_job(self, text):
        """Rank 0: print `text`, then tell every other rank to print it; every rank exits with EXIT_CODE."""
        self.settled.update(self.peers)  # they leave on this word: their closing connections are no news
        self._exit(text, then=lambda: self.send_all({"t": "dead", "text": text, "every_rank": False}) and time.sleep(0.2))

    def send_all(self, message, skip=None):
        """Send `message` to every connected rank but `skip` (rank 0: all others; others: rank 0)."""
        others = [p for p in list(self.peers.values()) if p is not skip]
        for other in others:
            other.send(message)
        return others

    def _exit(self, text, then=lambda: None):
        if self.stopped or self.failing:
            return
        # A traceback this rank is printing comes first (the verdict is then the last line).
        printed = self.printing.acquire(timeout=TRACEBACK_SECONDS)
        if self.failing:  # this rank raised meanwhile: its own report stands
            if printed:
                self.printing.release()
            return
        try:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
            then()  # end_job: tell the others once this rank's line is out
        finally:
            os._exit(EXIT_CODE)

    # --- this rank leaving ---------------------------------------------------------------------
    def goodbye(self):
        if self.failing or self.stopped:
            return
        self.stopped = True
        self.send_all({"t": "bye"})

    def report_own_failure(self, summary, every_rank=False, echo=False, claimed=False):
        """Tell the other ranks why this rank is leaving (after its traceback is printed).

        `claimed`: the caller already set `failing` (so no peer's verdict replaces this one)."""
        if not claimed:
            if self.failing or self.stopped:
                return
            if echo:
                # Probably the echo of a peer's death: give the watchdog thread time to name it
                # (it exits the process when it does).
                deadline = time.monotonic() + VERDICT_GRACE_SECONDS
                while time.monotonic() < deadline:
                    time.sleep(0.05)
            self.failing = True
        if self.rank == 0:
            text = _verdict(f"rank 0 (host {self.host}, pid {os.getpid()}) failed: {summary}", "every rank")
            if self.send_all({"t": "dead", "text": text, "every_rank": every_rank}):
                # Stay until the others have left or raised the same error themselves, so that
                # a launcher reacting to this exit does not cut their own report short.
                deadline = time.monotonic() + VERDICT_GRACE_SECONDS + (1 if every_rank else 0)
                others = range(1, self.size)
                while time.monotonic() < deadline and not self.settled.issuperset(others):
                    time.sleep(0.02)
        elif 0 in self.peers:
            self.peers[0].send({"t": "failed", "error": summary, "every_rank": every_rank})


def _verdict(what_happened, who_stops):
    return (f"tfdist watchdog: {what_happened}. Stopping {who_stops} with exit code {EXIT_CODE} "
            "so that no rank waits forever in a collective.")


def _at_exit():
    """Goodbye for a normal end; a report for sys.exit(n) with n not 0 or None."""
    if _active is None:
        return
    status = _exit_request[0] if _exit_request else None
    if status is None or (isinstance(status, int) and status == 0):
        _active.goodbye()
    else:
        _active.report_own_failure(f"sys.exit({clip(repr(status), 100)})")


def _chain_excepthook():
    previous = sys.excepthook

    def excepthook(exc_type, exc, tb):
        dog = _active
        if dog is None or dog.failing or dog.stopped:
            previous(exc_type, exc, tb)
            return
        # The full traceback first, flushed, then the report: a peer's (or a launcher's) reaction
        # to the report may end this process, and the traceback is what explains the failure.
        with dog.printing:
            try:
                previous(exc_type, exc, tb)
            finally:
                try:
                    sys.stderr.flush()
                except (OSError, ValueError):
                    pass
            summary = describe_exception(exc_type, exc, dog.rank)
            # An echo of a peer's death (a Horovod/Gloo error) waits for the watchdog's verdict
            # on that peer; any other error is this rank's own story from here on.
            echo = any(word in summary.lower() for word in _COLLECTIVE_ERROR_WORDS)
            claimed = not echo and not (dog.failing or dog.stopped)
            if claimed:
                dog.failing = True
        dog.report_own_failure(summary, bool(getattr(exc_type, "raised_on_every_rank", False)),
                               echo=echo, claimed=claimed)

    sys.excepthook = excepthook


def _watch_sys_exit():
    """Wrap sys.exit to remember its status: atexit handlers cannot see the exit code."""
    original = sys.exit
    if getattr(original, "_tfdist_watchdog", False):
        return

    def exit(status=None):  # noqa: A001 - sys.exit's own name and signature
        global _exit_request
        _exit_request = (status,)
        original(status)

    exit._tfdist_watchdog = True
    exit.__doc__ = original.__doc__
    sys.exit = exit
