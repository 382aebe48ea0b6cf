"""A link's one-way delay for two emulated hosts, on kernels without `sch_netem`: a TUN delay line.

    # in emulate_hosts: two namespaces joined by this instead of a veth pair when a delay is asked
    # for and the kernel has no netem; run alone to see it forward (Ctrl-C stops it):
    .venv/bin/python tests/delay_line.py --ns <nsA> --dev tdA --ns <nsB> --dev tdB --delay_us 500

Each host gets a TUN device (opened inside its namespace, so the device lives there; the open file
stays with this process). Every packet one host's stack sends to its device is read here and
written to the other host's device `delay_us` later, in order: a constant one-way delay on top of
the path's own (a read and a write through this process, about 20-40 us; `emulate_hosts` measures
the round trip it gives). The rate is shaped as on a veth, by `tbf` on each device's egress, so a
packet waits in the sender's queue for its turn on the wire, then travels the delay: serialisation
plus propagation, as on a real link. The devices carry 64 KB packets (the MTU below) as a NIC with
segmentation offload hands the stack 64 KB segments. One TCP stream through it reaches 6-8
Gbit/s on a 10 Gbit/s link here, and it costs CPU that the ranks' cores share: 66% of a core while
a 256 MB transfer ran at 6.7 Gbit/s, 7% at 1 Gbit/s (Zen 5, 2026-12-06; part of it is the
receiving host's network stack, which a write to its device runs, as a veth runs it on the
sender's core).
"""

import argparse
import collections
import ctypes
import fcntl
import os
import select
import struct
import sys
import time

MTU = 65000
TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
CLONE_NEWNET = 0x40000000
PR_SET_TIMERSLACK = 29


def open_tun_in(namespace, device):
    """Open (creating) TUN device `device` inside network namespace `namespace`; returns the fd."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {namespace}")
        fd = os.open("/dev/net/tun", os.O_RDWR)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", device.encode(), IFF_TUN | IFF_NO_PI))
        os.set_blocking(fd, False)
        return fd
    finally:
        if libc.setns(home, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns back to this process' network namespace")
        os.close(home)
        os.close(target)


def forward(fds, delay_s):
    """Copy each packet read from fds[i] to fds[1 - i] `delay_s` after it was read, in order; forever."""
    queues = [collections.deque(), collections.deque()]
    while True:
        now = time.monotonic()
        timeout = None
        for i, queue in enumerate(queues):
            while queue and queue[0][0] <= now:
                try:
                    os.write(fds[1 - i], queue.popleft()[1])
                except OSError:  # the far device is down (EIO) or its backlog full: dropped, as on a wire
                    pass
            if queue:
                wait = queue[0][0] - now
                timeout = wait if timeout is None else min(timeout, wait)
        readable, _, _ = select.select(fds, [], [], timeout)
        now = time.monotonic()
        for fd in readable:
            i = fds.index(fd)
            while True:
                try:
                    packet = os.read(fd, MTU + 64)
                except BlockingIOError:
                    break
                queues[i].append((now + delay_s, packet))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ns", action="append", required=True, help="a host's namespace (twice)")
    parser.add_argument("--dev", action="append", required=True, help="its TUN device's name (twice)")
    parser.add_argument("--delay_us", type=float, required=True, help="one-way delay added to every packet")
    args = parser.parse_args(argv)
    if len(args.ns) != 2 or len(args.dev) != 2:
        parser.error("--ns and --dev twice each: one per host")
    # Wake-ups as asked, not up to the default 50 us late (the delay may be 50 us itself).
    ctypes.CDLL(None).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
    fds = [open_tun_in(ns, dev) for ns, dev in zip(args.ns, args.dev)]
    print("ready", flush=True)
    try:
        forward(fds, args.delay_us / 1e6)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
