"""Helpers of `tfdist.faults.watchdog`: rank 0's address and its broadcast, the one-line error text, and a peer.

Rank 0 binds one TCP port: `TFDIST_WATCHDOG_ADDR` (`host`, `host:port` or `:port`) or, by
default, any free port on all interfaces. It then sends its address record (address, token, host,
pid) to every rank in one fixed-size Horovod broadcast, or the error that stopped it from
listening, so that every rank fails with the same message instead of waiting in the broadcast.
"""

import fcntl
import json
import os
import re
import socket
import struct
import threading
import time

from tfdist.errors import WatchdogError

HOST_CHARS = 120  # longest host name a message carries (cut visibly)
LINE_CHARS = 300  # longest error line sent to the other ranks (cut visibly in the middle)
# Lines that follow the cause at the end of TensorFlow and Keras errors: Keras' argument list
# ("Arguments received by Dense.call():", "  • inputs=...") and TF's "[[{{node ...}}]]".
_NOISE_LINE = re.compile(r"^(\[\[|\[Op:|•|(Call )?[Aa]rguments received by\b)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Keras 3 writes the cause in bold
FIX = ("Set TFDIST_WATCHDOG_ADDR to host:port with a free port on rank 0's host (host:0, or no "
       "port, picks any free port), or pass HorovodStrategy(watchdog=False).")


def clip(text, limit):
    """`text` in at most `limit` characters; a longer one loses its middle to a visible ' ... '."""
    text = str(text)
    if len(text) <= limit:
        return text
    keep = max(limit - 5, 2)
    head = (keep * 2) // 3
    return text[:head] + " ... " + text[len(text) - (keep - head):]


def describe_exception(exc_type, exc, rank=None):
    """`Type: last meaningful line` of an exception: what the other ranks print about it.

    TensorFlow and Keras put the cause last ("ValueError: in user code: ... <cause>"), followed
    at most by Keras' argument list or TF's "[[{{node ...}}]]", which are skipped. A longer line
    loses its middle to " ... "; a message of several lines says so.
    """
    name = getattr(exc_type, "__name__", None) or repr(exc_type)
    try:
        text = _ANSI.sub("", str(exc))
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the failure itself
        text = "<its message could not be read>"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return name
    last = ([line for line in lines if not _NOISE_LINE.match(line)] or lines)[-1]
    if not last.startswith(f"{name}:"):  # TF repeats the type on its last line
        last = f"{name}: {last}"
    summary = clip(last, LINE_CHARS)
    if len(lines) > 1:
        whose = "its" if rank is None else f"rank {rank}'s"
        summary += f" [last line of a {len(lines)}-line message; {whose} traceback has all of it]"
    return summary


def host_name():
    """This rank's host as the launcher knows it, plus the machine's own name when they differ."""
    own = socket.gethostname()
    launcher = os.environ.get("HOROVOD_HOSTNAME", "")
    if launcher and launcher not in (own, "localhost", "127.0.0.1"):
        return clip(f"{launcher} ({own})", HOST_CHARS)
    return clip(own, HOST_CHARS)


def _bind_address():
    """(host, port, where it came from) for rank 0's listening socket."""
    override = os.environ.get("TFDIST_WATCHDOG_ADDR", "").strip()
    if not override:
        return "0.0.0.0", 0, "any free port"
    host, _, port_text = override.partition(":")
    where = f"TFDIST_WATCHDOG_ADDR={clip(override, 80)!r}"
    try:
        port = int(port_text or 0)
        if not 0 <= port <= 65535:
            raise ValueError
    except ValueError:
        raise WatchdogError(
            f"tfdist watchdog: rank 0 (host {host_name()}) cannot listen on {clip(override, 80)}: "
            f"{where} has port {clip(port_text, 40)!r}, not a number from 0 to 65535. {FIX}"
        ) from None
    return host or "0.0.0.0", port, where


def listen():
    """Rank 0's listening socket, or WatchdogError naming the address and the fix."""
    host, port, where = _bind_address()
    try:
        return socket.create_server((host, port), backlog=128)
    except (OSError, OverflowError, UnicodeError) as e:
        raise WatchdogError(
            f"tfdist watchdog: rank 0 (host {host_name()}) cannot listen on "
            f"{clip(host, 80)}:{port} ({where}): {clip(e, 160)}. {FIX}"
        ) from None


def advertised_host():
    """An address of this host that the other ranks can reach: the one Gloo itself uses."""
    override = os.environ.get("TFDIST_WATCHDOG_ADDR", "").strip()
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


def read_line(sock, deadline):
    """The first JSON line from `sock` (before `deadline`) and the bytes after it."""
    data = b""
    while b"\n" not in data:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        chunk = sock.recv(4096)
        if not chunk:
            raise ValueError("connection closed before hello")
        data += chunk
    line, rest = data.split(b"\n", 1)
    return json.loads(line), rest


class Peer:
    """One connection between rank 0's watchdog and another rank's: who it is, and a locked send."""

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
