"""Emulated hosts on one machine: network namespaces on a veth pair or a bridge, links shaped with tc.

    # two "hosts" on a 1 Gbit/s link; run a command in each, then remove everything
    .venv/bin/python tests/emulate_hosts.py --hosts 2 --rate_gbit 1 --measure
    .venv/bin/python tests/emulate_hosts.py --cleanup      # namespaces left by a killed run

```python
from emulate_hosts import Link, NetworkNamespaces
with NetworkNamespaces(2, link=Link(rate_gbit=1)) as hosts:   # removed on every exit path
    proc = hosts.run(1, ["python", "-c", "import socket; print(socket.gethostname())"], core=1)
    print(hosts.addresses, hosts.hostnames, hosts.measure_rate(0, 1, 4 << 20))
```

Layout: host i is namespace `tfd<L><pid>n<k>` (L = A, B, ...) holding `lo` and one veth end
`tv<L><pid>n<k>` with address 10.77.0.<i+1>/24 and no default route, so traffic cannot leave the
namespaces. Two hosts are joined by a veth pair; more by a bridge in a switch namespace of its own
(`tfds<pid>n<k>`), so nothing of the emulation is in the machine's own namespace. Each direction
of each link is shaped once, on the sending side's egress: `tbf` for the rate (a bucket of at least
a 64 KB GSO segment, and a queue of `queue_ms` of traffic so TCP is never dropped pathologically),
plus `netem` for a one-way delay where the kernel has it. On a kernel without `sch_netem` (this
VM's 6.18 is built without `CONFIG_NET_SCH_NETEM`) two hosts with a delay are joined by a TUN
delay line instead of the veth pair (`tests/delay_line.py`: a process that holds each packet for
the delay), and more than two raise `EmulationError`; `measure_rtt` says what the link gives. `/etc/netns/<ns>/hosts` makes every host name (`hosta`,
`hostb`, ...) and this machine's own name resolve inside each namespace as a node's name would.
"""

import argparse
import atexit
import contextlib
import dataclasses
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import delay_line

SUBNET = "10.77.0"
DELAY_LINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "delay_line.py")
NAME = re.compile(r"^tfd([A-Zs])(\d+)n(\d+)$")
_counter = itertools.count()


class EmulationError(RuntimeError):
    """The emulated hosts could not be set up as asked (no root, no `ip`/`tc`, a kernel without a qdisc)."""


@dataclasses.dataclass(frozen=True)
class Link:
    """One direction of every link: `rate_gbit` (None: unshaped veth), one-way `delay_ms`, queue size."""

    rate_gbit: float = None
    delay_ms: float = 0.0
    queue_ms: float = 50.0

    def describe(self):
        rate = f"{self.rate_gbit:g} Gbit/s" if self.rate_gbit else "unshaped"
        return rate + (f", {self.delay_ms:g} ms one-way" if self.delay_ms else ", no added delay")


def _run(args, check=True, timeout=30):
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise EmulationError(f"{' '.join(args)}: {result.stderr.strip() or result.stdout.strip()}")
    return result


def tc_commands(ns, dev, link, netem=True):
    """The `tc` commands that shape egress of `dev` in namespace `ns` (empty for an unshaped link).

    `netem=False`: the delay is added elsewhere (a delay line), only the rate here.
    """
    prefix = ["tc", "-n", ns, "qdisc", "replace", "dev", dev]
    commands = []
    parent = ["root"]
    if link.delay_ms and netem:
        packets = max(1000, int((link.rate_gbit or 10) * 1e9 / 8 / 1500 * link.queue_ms / 1e3))
        commands.append(prefix + ["root", "handle", "1:", "netem", "delay", f"{link.delay_ms * 1000:g}us",
                                  "limit", str(packets)])
        parent = ["parent", "1:1"]
    if link.rate_gbit:
        rate = link.rate_gbit * 1e9
        burst = max(128 * 1024, int(rate / 8 / 1000))  # >= one 64 KB GSO segment, or 1 ms of traffic
        limit = max(4 * burst, int(rate / 8 * link.queue_ms / 1e3))
        commands.append(prefix + parent + ["handle", "2:", "tbf", "rate", f"{rate:.0f}bit",
                                           "burst", str(burst), "limit", str(limit)])
    return commands


class NetworkNamespaces:
    """N hosts on this machine (default 2, 10.77.0.1 and 10.77.0.2); a context manager that removes them.

    `names`: the namespaces; `links`: each host's interface; `addresses`, `hostnames` ('hosta', ...).
    """

    def __init__(self, count=2, link=None, hostnames=None):
        if not 2 <= count <= 26:
            raise ValueError(f"count={count}: between 2 and 26 hosts")
        tag = f"{os.getpid()}n{next(_counter)}"
        letters = [chr(ord("A") + i) for i in range(count)]
        self.names = tuple(f"tfd{x}{tag}" for x in letters)
        self.links = tuple(f"tv{x}{tag}" for x in letters)
        self.switch_links = tuple(f"tw{x}{tag}" for x in letters) if count > 2 else ()
        self.switch = f"tfds{tag}" if count > 2 else None
        self.addresses = tuple(f"{SUBNET}.{i + 1}" for i in range(count))
        self.hostnames = tuple(hostnames or (f"host{x.lower()}" for x in letters))
        self.link = link or Link()
        self.created = []
        self.delay_by = None  # how link.delay_ms is added: "netem" or "delay line"
        self._delay_line = None
        self._previous_handlers = {}

    # ------------------------------------------------------------ set-up and removal

    @staticmethod
    def check_machine():
        """Raise EmulationError saying why this machine cannot host the emulation (or return None)."""
        if os.geteuid() != 0:
            raise EmulationError(f"network namespaces need root (running as uid {os.geteuid()})")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise EmulationError(f"the `{tool}` command (iproute2) is not installed")

    def create(self):
        self.check_machine()
        atexit.register(self.remove)
        for ns in self.names + ((self.switch,) if self.switch else ()):
            _run(["ip", "netns", "add", ns])
            self.created.append(ns)
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        if self.switch and self.link.delay_ms and not _has_netem(self.names[0]):
            raise EmulationError(f"{len(self.names)} hosts with a {self.link.delay_ms:g} ms delay: this kernel "
                                 "has no sch_netem, and the delay line (tests/delay_line.py) joins two hosts only")
        if self.switch:
            _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
            for ns, dev, peer in zip(self.names, self.links, self.switch_links):
                _run(["ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", peer,
                      "netns", self.switch])
                _run(["ip", "-n", self.switch, "link", "set", peer, "master", "br0", "up"])
                self._shape(self.switch, peer)  # the switch port's egress: this host's ingress
        elif self.link.delay_ms and not _has_netem(self.names[0]):
            self._start_delay_line()
        else:
            _run(["ip", "link", "add", self.links[0], "netns", self.names[0], "type", "veth", "peer",
                  "name", self.links[1], "netns", self.names[1]])
        if self.link.delay_ms and not self.delay_by:
            self.delay_by = "netem"
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{a} {h}\n" for a, h in zip(self.addresses, self.hostnames))
        for ns, dev, addr in zip(self.names, self.links, self.addresses):
            # `ip netns exec` mounts /etc/netns/<ns>/hosts over /etc/hosts: inside each namespace
            # this machine's name resolves to that namespace's address, as a node's name does.
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write(hosts_file + f"{addr} {socket.gethostname()}\n")
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev])
            _run(["ip", "-n", ns, "link", "set", dev, "up"])
            self._shape(ns, dev)
        return self

    @property
    def delay_line_pid(self):
        """The delay line's process id (None without one): its CPU comes from the ranks' cores."""
        return self._delay_line.pid if self._delay_line else None

    def _start_delay_line(self):
        self._delay_line = subprocess.Popen(
            [sys.executable, DELAY_LINE, "--delay_us", f"{self.link.delay_ms * 1e3:g}",
             *(a for ns, dev in zip(self.names, self.links) for a in ("--ns", ns, "--dev", dev))],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        ready = self._delay_line.stdout.readline().strip()
        if ready != "ready":
            self._delay_line.kill()
            raise EmulationError(f"the delay line ({DELAY_LINE}) did not start: "
                                 f"{ready} {self._delay_line.stderr.read().strip()[-500:]}")
        for ns, dev in zip(self.names, self.links):
            _run(["ip", "-n", ns, "link", "set", dev, "mtu", str(delay_line.MTU)])
        self.delay_by = "delay line"

    def _shape(self, ns, dev):
        for command in tc_commands(ns, dev, self.link, netem=self.delay_by != "delay line"):
            result = _run(command, check=False)
            if result.returncode != 0:
                why = result.stderr.strip()
                if "netem" in command and "unknown" in why:
                    why += (" -- this kernel has no sch_netem (CONFIG_NET_SCH_NETEM), so a delay cannot "
                            "be added; run with delay 0 (the veth's own latency, see measure_rtt)")
                raise EmulationError(f"{' '.join(command)}: {why}")

    def remove(self):
        """Stop what still runs in the namespaces, delete them (and so their veths), and their files."""
        if self._delay_line is not None:
            _kill([self._delay_line.pid])
            self._delay_line = None
        for ns in self.created:
            pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
            _kill(int(p) for p in pids if p.isdigit())
            _run(["ip", "netns", "delete", ns], check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir("/etc/netns")  # only if no other namespace has files there
        self.created = []

    def __enter__(self):
        # SIGTERM/SIGHUP become SystemExit so that __exit__ runs; SIGINT already raises KeyboardInterrupt
        for sig in (signal.SIGTERM, signal.SIGHUP):
            with contextlib.suppress(ValueError):  # not the main thread: atexit is the backstop
                self._previous_handlers[sig] = signal.signal(sig, _raise_exit)
        try:
            return self.create()
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        self.remove()
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers = {}
        return False

    # ------------------------------------------------------------ running in a host

    def command(self, host, argv, core=None):
        """`argv` to run in host `host` (optionally pinned to cpu `core` with taskset)."""
        pin = ["taskset", "-c", str(core)] if core is not None else []
        return ["ip", "netns", "exec", self.names[host], *pin, *map(str, argv)]

    def run(self, host, argv, core=None, **popen):
        """Start `argv` in host `host`; returns the Popen (its own session, so its group can be killed)."""
        popen.setdefault("start_new_session", True)
        return subprocess.Popen(self.command(host, argv, core), **popen)

    def check_output(self, host, argv, timeout=60):
        return subprocess.run(self.command(host, argv), capture_output=True, text=True, timeout=timeout,
                              check=True).stdout

    # ------------------------------------------------------------ what the link really does

    def measure_rate(self, src, dst, nbytes=8 << 20, port=5999, timeout=60):
        """Gbit/s of one TCP stream sending `nbytes` from host `src` to host `dst` (receiver's clock)."""
        server = self.run(dst, [sys.executable, "-c", _RECEIVER, self.addresses[dst], port, nbytes],
                          stdout=subprocess.PIPE, text=True)
        try:
            _wait_listening(self, dst, port, timeout)
            self.check_output(src, [sys.executable, "-c", _SENDER, self.addresses[dst], port, nbytes], timeout)
            out, _ = server.communicate(timeout=timeout)
        finally:
            _kill([server.pid])
        timed, seconds = out.split()
        return int(timed) * 8 / float(seconds) / 1e9

    def measure_rtt(self, src, dst, count=200, port=5998, timeout=60):
        """Median round trip (ms) of a 1-byte TCP ping-pong between two hosts."""
        server = self.run(dst, [sys.executable, "-c", _ECHO, self.addresses[dst], port, count])
        try:
            _wait_listening(self, dst, port, timeout)
            out = self.check_output(src, [sys.executable, "-c", _PING, self.addresses[dst], port, count], timeout)
            server.wait(timeout=timeout)
        finally:
            _kill([server.pid])
        return float(out)


def _has_netem(ns):
    """Whether this kernel has sch_netem (tried on namespace `ns`'s loopback, then removed)."""
    added = _run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "0us"], check=False)
    if added.returncode == 0:
        _run(["tc", "-n", ns, "qdisc", "del", "dev", "lo", "root"], check=False)
    return added.returncode == 0


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def _kill(pids, grace=3.0):
    pids = list(pids)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            time.sleep(0.05)


def _alive(pid):
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # reap our own children
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):  # a zombie of another parent counts as gone
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    return False


def _wait_listening(hosts, host, port, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        table = [line.split() for line in hosts.check_output(host, ["cat", "/proc/net/tcp"]).splitlines()[1:]]
        if any(f[1].upper().endswith(f":{port:04X}") and f[3] == "0A" for f in table):  # 0A: LISTEN
            return
        time.sleep(0.05)
    raise EmulationError(f"nothing listens on port {port} in host {host} after {timeout}s")


_RECEIVER = """import socket, sys, time
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
c, _ = s.accept(); left = int(sys.argv[3]); start = None; timed = 0
while left > 0:
    data = c.recv(1 << 20)
    if not data: break
    left -= len(data)
    if start is None: start = time.perf_counter()
    else: timed += len(data)
print(timed, time.perf_counter() - start)"""
_SENDER = """import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
c.sendall(bytes(int(sys.argv[3]))); c.shutdown(socket.SHUT_WR); c.recv(1)"""
_ECHO = """import socket, sys
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range(int(sys.argv[3]) + 10): c.sendall(c.recv(1))"""
_PING = """import socket, statistics, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1); times = []
for i in range(int(sys.argv[3]) + 10):
    t = time.perf_counter(); c.sendall(b"x"); c.recv(1)
    if i >= 10: times.append(time.perf_counter() - t)
print(statistics.median(times) * 1e3)"""


def cleanup_stale():
    """Remove namespaces (and their files) left by emulations whose process is gone; returns their names."""
    removed = []
    for ns in _run(["ip", "netns", "list"], check=False).stdout.split():
        match = NAME.match(ns)
        if match and not _alive(int(match.group(2))):
            pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
            _kill(int(p) for p in pids if p.isdigit())
            _run(["ip", "netns", "delete", ns], check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
            removed.append(ns)
    return removed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--rate_gbit", type=float, help="per direction of each link (default: unshaped)")
    parser.add_argument("--delay_ms", type=float, default=0.0,
                        help="one-way: netem where the kernel has it, else a delay line (2 hosts)")
    parser.add_argument("--measure", action="store_true", help="print the measured rate and round trip")
    parser.add_argument("--cleanup", action="store_true", help="remove namespaces of emulations that died")
    parser.add_argument("command", nargs="*", help="after --: run in every host ({host} = its index), wait")
    args = parser.parse_args(argv)
    if args.cleanup:
        print("removed:", " ".join(cleanup_stale()) or "nothing")
        return 0
    try:
        with NetworkNamespaces(args.hosts, Link(args.rate_gbit, args.delay_ms)) as hosts:
            print(f"{args.hosts} hosts {', '.join(f'{h}={a}' for h, a in zip(hosts.hostnames, hosts.addresses))}; "
                  f"link {hosts.link.describe()}" + (f" (by {hosts.delay_by})" if hosts.delay_by else ""), flush=True)
            if args.measure:
                print(f"measured 0->1: {hosts.measure_rate(0, 1):.3f} Gbit/s, round trip "
                      f"{hosts.measure_rtt(0, 1):.3f} ms", flush=True)
            procs = [hosts.run(i, [a.replace("{host}", str(i)) for a in args.command], start_new_session=False)
                     for i in range(args.hosts)] if args.command else []
            return max([p.wait() for p in procs], default=0)
    except EmulationError as e:
        print(f"emulate_hosts: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
