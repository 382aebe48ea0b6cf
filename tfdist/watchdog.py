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
- an uncaught exception on a rank is reported with its error before the rank exits;
- rank 0 tells every survivor, and each prints one line naming the rank and its host to stderr
  and leaves with `os._exit(EXIT_CODE)`; the main thread may be blocked inside an allreduce,
  where no Python exception can reach it. Ranks that lose rank 0 do the same, naming rank 0;
- a rank that ends normally says goodbye (atexit) and is not reported.

Example (normally `HorovodStrategy(watchdog=...)` does this for you):

```python
from tfdist import collectives, watchdog
collectives.init()
watchdog.start(timeout=20.0)      # no-op on one rank; TFDIST_WATCHDOG_TIMEOUT overrides
```

Environment: `TFDIST_WATCHDOG_TIMEOUT` (seconds of silence before a rank counts as stalled; 0 turns
the watchdog off), `TFDIST_WATCHDOG_ADDR` (`host` or `host:port` rank 0 listens on and the others
connect to; default: the address of Horovod's Gloo interface, all interfaces bound).
"""

import atexit
import fcntl
import json
import os
import secrets
import selectors
import socket
import struct
import sys
import threading
import time

import numpy as np
import tensorflow as tf

from tfdist import collectives
from tfdist.errors import WatchdogError

DEFAULT_TIMEOUT = 20.0  # below Gloo's own 30 s recv timeout, so the watchdog names the rank first
HEARTBEAT_SECONDS = 1.0
EXIT_CODE = 3  # "stopped because another rank failed"
# How long a rank whose own collective failed waits for the watchdog's verdict on a peer, so
# the message names the rank that died rather than the survivor that noticed.
VERDICT_GRACE_SECONDS = 3.0
HELLO_SECONDS = 5.0  # how long an accepted connection may take to say which rank it is
_COLLECTIVE_ERROR_WORDS = ("horovod", "gloo", "connection reset", "timed out waiting")
_ADDRESS_BYTES = 512

_active = None


def start(timeout=None):
    """Start the watchdog on every rank (a collective: all ranks call it). Returns it, or None.

    `timeout`: seconds of silence before a rank counts as stalled; None uses
    `TFDIST_WATCHDOG_TIMEOUT` or `DEFAULT_TIMEOUT`. Nothing starts on one rank, with a timeout
    of 0, or when a watchdog already runs in this process.
    """
    global _active
    if _active is not None or collectives.size() == 1:
        return _active
    if timeout is None:
        timeout = float(os.environ.get("TFDIST_WATCHDOG_TIMEOUT", DEFAULT_TIMEOUT))
    if timeout <= 0:
        return None
    rank, size = collectives.rank(), collectives.size()
    listener = _listen() if rank == 0 else None
    token = secrets.token_hex(16)
    if listener is not None:
        advertised = (_advertised_host(), listener.getsockname()[1])
    else:
        advertised = ("", 0)
    hub = _broadcast_json({"addr": advertised, "token": token, "host": host_name(), "pid": os.getpid()})
    dog = _Watchdog(rank, size, float(timeout), hub)
    if rank == 0:
        dog.accept_peers(listener, token)
    else:
        dog.connect_to_hub()
    _active = dog
    atexit.register(_say_goodbye)
    _chain_excepthook()
    threading.Thread(target=dog.run, name="tfdist-watchdog", daemon=True).start()
    return dog


def host_name():
    """This rank's host as the launcher knows it, plus the machine's own name when they differ."""
    own = socket.gethostname()
    launcher = os.environ.get("HOROVOD_HOSTNAME", "")
    if launcher and launcher not in (own, "localhost", "127.0.0.1"):
        return f"{launcher} ({own})"
    return own


class _Peer:
    def __init__(self, sock, rank, host, pid):
        self.sock, self.rank, self.host, self.pid = sock, rank, host, pid
        self.buffer = b""
        self.last_heard = time.monotonic()
        self.lock = threading.Lock()

    def describe(self):
        return f"rank {self.rank} (host {self.host}, pid {self.pid})"

    def send(self, message):
        data = (json.dumps(message) + "\n").encode()
        with self.lock:
            try:
                self.sock.sendall(data)
            except OSError:
                pass  # a dead peer's connection; its closing is reported by the reader


class _Watchdog:
    def __init__(self, rank, size, timeout, hub):
        self.rank, self.size, self.timeout = rank, size, timeout
        self.hub = hub
        self.host = host_name()
        self.peers = {}  # rank -> _Peer (rank 0: every other rank; others: rank 0 only)
        self.failing = False  # this rank is exiting with its own error
        self.stopped = False  # this rank said goodbye

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
                hello, rest = _read_line(sock, min(deadline, time.monotonic() + HELLO_SECONDS))
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
            peer = _Peer(sock, hello["rank"], hello["host"], hello["pid"])
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
        hub = _Peer(sock, 0, self.hub["host"], self.hub["pid"])
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
        while self.peers and not self.stopped:
            for key, _ in selector.select(timeout=max(next_beat - time.monotonic(), 0)):
                self._receive(key.data, selector)
            now = time.monotonic()
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
            selector.unregister(peer.sock)
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
                selector.unregister(peer.sock)
                peer.sock.close()
                del self.peers[peer.rank]
                return
            if kind == "failed":
                self._peer_failed(peer, f"failed: {message['error']}")
            elif kind == "dead":  # rank 0's verdict on another rank
                self._exit(message["text"])

    def _peer_failed(self, peer, what):
        if self.stopped or self.failing:
            return  # this rank is already on its way out with its own story
        if self.rank == 0:
            self._tell_others(_verdict(f"{peer.describe()} {what}", "every rank"), skip=peer)
        self._exit(_verdict(f"{peer.describe()} {what}", f"rank {self.rank} (host {self.host})"))

    def _tell_others(self, text, skip=None):
        others = [p for p in self.peers.values() if p is not skip]
        for other in others:
            other.send({"t": "dead", "text": text})
        if others:
            time.sleep(0.2)  # let them read it before this process's exit resets the connections

    def _exit(self, text):
        if self.stopped or self.failing:
            return
        try:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
        finally:
            os._exit(EXIT_CODE)

    # --- this rank leaving ---------------------------------------------------------------------
    def goodbye(self):
        if self.failing or self.stopped:
            return
        self.stopped = True
        for peer in list(self.peers.values()):
            peer.send({"t": "bye"})

    def report_own_failure(self, error):
        error_text = f"{type(error).__name__}: {str(error).strip()}"
        first_line = error_text.splitlines()[0][:300] if error_text else type(error).__name__
        if any(word in error_text.lower() for word in _COLLECTIVE_ERROR_WORDS):
            # Probably the echo of a peer's death: give the watchdog thread time to name it
            # (it exits the process when it does).
            deadline = time.monotonic() + VERDICT_GRACE_SECONDS
            while time.monotonic() < deadline:
                time.sleep(0.05)
        self.failing = True
        if self.rank == 0:
            self._tell_others(_verdict(f"rank 0 (host {self.host}, pid {os.getpid()}) failed: "
                                       f"{first_line}", "every rank"))
        elif 0 in self.peers:
            self.peers[0].send({"t": "failed", "error": first_line})


def _verdict(what_happened, who_stops):
    return (f"tfdist watchdog: {what_happened}. Stopping {who_stops} with exit code {EXIT_CODE} "
            "so that no rank waits forever in a collective.")


def _say_goodbye():
    if _active is not None:
        _active.goodbye()


def _chain_excepthook():
    previous = sys.excepthook

    def excepthook(exc_type, exc, tb):
        if _active is not None and not issubclass(exc_type, KeyboardInterrupt):
            _active.report_own_failure(exc)
        previous(exc_type, exc, tb)

    sys.excepthook = excepthook


# --- addresses ---------------------------------------------------------------------------------
def _listen():
    bind_host, port = "0.0.0.0", 0
    override = os.environ.get("TFDIST_WATCHDOG_ADDR", "")
    if override:
        bind_host, _, port_text = override.partition(":")
        port = int(port_text or 0)
    try:
        listener = socket.create_server((bind_host, port), backlog=128)
    except OSError as e:
        raise WatchdogError(
            f"tfdist watchdog: rank 0 cannot listen on {bind_host}:{port}"
            f"{' (TFDIST_WATCHDOG_ADDR)' if override else ''}: {e}"
        ) from None
    return listener


def _advertised_host():
    """An address of this host that the other ranks can reach: the one Gloo itself uses."""
    override = os.environ.get("TFDIST_WATCHDOG_ADDR", "")
    if override and not override.startswith(("0.0.0.0", ":")):
        return override.partition(":")[0]
    iface = os.environ.get("HOROVOD_GLOO_IFACE")
    if iface:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", iface[:15].encode()))
            return socket.inet_ntoa(packed[20:24])  # SIOCGIFADDR
        except OSError:
            pass
    rendezvous = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
    if rendezvous:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((rendezvous, 9))  # no packet is sent; picks the route's source address
                return s.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return socket.gethostname()


def _broadcast_json(value):
    """Rank 0's `value` on every rank (one fixed-size broadcast)."""
    buffer = np.zeros([_ADDRESS_BYTES], np.uint8)
    if collectives.rank() == 0:
        data = json.dumps(value).encode()[:_ADDRESS_BYTES]
        buffer[: len(data)] = np.frombuffer(data, np.uint8)
    received = collectives.broadcast(tf.constant(buffer), 0, name="tfdist.watchdog.address")
    return json.loads(bytes(received.numpy()).rstrip(b"\0"))


def _read_line(sock, deadline):
    data = b""
    while b"\n" not in data:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        chunk = sock.recv(4096)
        if not chunk:
            raise ValueError("connection closed before hello")
        data += chunk
    line, rest = data.split(b"\n", 1)
    return json.loads(line), rest
