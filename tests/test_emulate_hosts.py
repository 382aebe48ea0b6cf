"""tests/emulate_hosts.py: shaped links really limit throughput, traffic stays inside, nothing is left behind.

Fast (no TensorFlow): a few MB over python sockets between namespaces.
"""

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts" / "benchmarks"))  # multihost_benchmark
sys.path.insert(0, str(ROOT / "scripts" / "benchmarks" / "multihost"))  # timeline_overlap
import emulate_hosts  # noqa: E402
import timeline_overlap  # noqa: E402
from emulate_hosts import EmulationError, Link, NetworkNamespaces  # noqa: E402


@pytest.fixture
def machine():
    try:
        NetworkNamespaces.check_machine()
    except EmulationError as e:
        pytest.skip(f"cannot emulate hosts here: {e}")


needs_namespaces = pytest.mark.usefixtures("machine")


def leftovers(hosts):
    """What of `hosts` still exists: namespaces, /etc/netns files, interfaces seen from this namespace."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    links = subprocess.run(["ip", "link"], capture_output=True, text=True, timeout=30).stdout
    found = [ns for ns in hosts.names + ((hosts.switch,) if hosts.switch else ()) if ns in listed]
    found += [f"/etc/netns/{ns}" for ns in hosts.names if os.path.exists(f"/etc/netns/{ns}")]
    found += [dev for dev in hosts.links + hosts.switch_links if dev in links]
    return found


def netem_available():
    with NetworkNamespaces(2) as hosts:
        probe = ["tc", "-n", hosts.names[0], "qdisc", "add", "dev", hosts.links[0], "root", "netem", "delay", "1ms"]
        return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0


@needs_namespaces
def test_shaping_limits_throughput_to_the_set_rate():
    with NetworkNamespaces(2) as hosts:
        unshaped = hosts.measure_rate(0, 1, 8 << 20)
    for rate, nbytes in ((0.2, 4 << 20), (1.0, 16 << 20)):
        with NetworkNamespaces(2, Link(rate_gbit=rate)) as hosts:
            forward, backward = hosts.measure_rate(0, 1, nbytes), hosts.measure_rate(1, 0, nbytes)
        # tbf counts Ethernet/IP/TCP headers: TCP payload reaches ~96% of the set rate
        for measured in (forward, backward):
            assert 0.85 * rate <= measured <= 1.05 * rate, (rate, forward, backward, unshaped)
    assert unshaped > 2 * 1.0, f"unshaped veth {unshaped:.2f} Gbit/s: the 1 Gbit/s check above proves nothing"


@needs_namespaces
def test_bridge_joins_three_hosts_each_link_shaped():
    with NetworkNamespaces(3, Link(rate_gbit=0.2)) as hosts:
        assert hosts.switch is not None
        for src, dst in ((0, 2), (2, 1)):
            assert 0.85 * 0.2 <= hosts.measure_rate(src, dst, 4 << 20) <= 1.05 * 0.2
        names = hosts.check_output(1, [sys.executable, "-c", "import socket; print(*(socket.gethostbyname(h) "
                                       "for h in ('hosta', 'hostb', 'hostc', socket.gethostname())))"]).split()
        assert names == ["10.77.0.1", "10.77.0.2", "10.77.0.3", "10.77.0.2"]


@needs_namespaces
def test_latency_is_the_set_delay_by_netem_or_the_delay_line():
    with NetworkNamespaces(2) as hosts:
        veth = hosts.measure_rtt(0, 1)
    assert veth < 1.0 and hosts.delay_by is None, f"veth round trip {veth:.3f} ms"
    by = "netem" if netem_available() else "delay line"
    with NetworkNamespaces(2, Link(rate_gbit=1, delay_ms=0.001)) as hosts:  # the path's own round trip
        base = hosts.measure_rtt(0, 1)
    with NetworkNamespaces(2, Link(rate_gbit=1, delay_ms=0.25)) as hosts:
        assert hosts.delay_by == by
        rtt = hosts.measure_rtt(0, 1)
        rate = hosts.measure_rate(0, 1, 16 << 20)
        line = hosts._delay_line
    assert 0.5 <= rtt - base <= 0.5 * 1.3 + 0.1, (by, rtt, base, veth)
    assert 0.8 <= rate <= 1.05, f"{by}: {rate:.3f} Gbit/s on a 1 Gbit/s link with 0.5 ms round trip"
    if line is not None:
        assert line.poll() is not None, "the delay line outlived its hosts"
    if by == "delay line":
        with pytest.raises(EmulationError, match="joins two hosts only"):
            NetworkNamespaces(3, Link(delay_ms=0.25)).__enter__()


def test_tc_commands_put_the_rate_under_the_delay():
    assert emulate_hosts.tc_commands("n", "d", Link()) == []
    (tbf,) = emulate_hosts.tc_commands("n", "d", Link(rate_gbit=1))
    assert tbf[:8] == ["tc", "-n", "n", "qdisc", "replace", "dev", "d", "root"]
    assert tbf[tbf.index("rate") + 1] == "1000000000bit" and int(tbf[tbf.index("limit") + 1]) >= 6_000_000
    netem, tbf = emulate_hosts.tc_commands("n", "d", Link(rate_gbit=10, delay_ms=0.1))
    assert netem[7:12] == ["root", "handle", "1:", "netem", "delay"] and netem[12] == "100us"
    assert tbf[7:9] == ["parent", "1:1"]
    (tbf,) = emulate_hosts.tc_commands("n", "d", Link(rate_gbit=10, delay_ms=0.1), netem=False)  # a delay line's
    assert tbf[7] == "root" and "netem" not in tbf


@needs_namespaces
def test_traffic_stays_inside_the_namespaces():
    def root_bytes():  # every interface of this (the machine's own) namespace but loopback
        total = 0
        for dev in os.listdir("/sys/class/net"):
            if dev != "lo":
                for way in ("rx", "tx"):
                    total += int(open(f"/sys/class/net/{dev}/statistics/{way}_bytes").read())
        return total

    with NetworkNamespaces(2, Link(rate_gbit=1)) as hosts:
        routes = hosts.check_output(0, ["ip", "route"])
        assert routes.strip().splitlines() == [f"10.77.0.0/24 dev {hosts.links[0]} proto kernel scope link "
                                               "src 10.77.0.1"]
        probe = ("import socket\ntry:\n    socket.create_connection(('192.0.2.1', 80), timeout=5)\n"
                 "except OSError as e:\n    print(e.errno)")
        assert int(hosts.check_output(0, [sys.executable, "-c", probe])) == errno.ENETUNREACH
        before = root_bytes()
        hosts.measure_rate(0, 1, 32 << 20)
        grown = root_bytes() - before
        assert not set(os.listdir("/sys/class/net")) & set(hosts.links)
    assert grown < 16 << 20, f"this namespace's interfaces carried {grown} bytes during a 32 MB transfer"


@needs_namespaces
def test_cleanup_on_exception_and_with_processes_still_running():
    hosts = NetworkNamespaces(2)
    with pytest.raises(ZeroDivisionError):
        with hosts:
            sleeper = hosts.run(1, ["sleep", "300"])
            assert len(leftovers(hosts)) == 4
            1 / 0
    assert leftovers(hosts) == []
    assert sleeper.wait(timeout=10) is not None  # stopped by the cleanup, not left running


@needs_namespaces
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_cleanup_on_signal(sig):
    script = ("import sys, time; sys.path.insert(0, sys.argv[1]); from emulate_hosts import NetworkNamespaces\n"
              "with NetworkNamespaces(3) as h:\n    print(*h.names, flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", script, str(ROOT / "tests")], stdout=subprocess.PIPE, text=True)
    try:
        names = proc.stdout.readline().split()
        assert len(names) == 3
        proc.send_signal(sig)
        try:  # the cleanup's own `ip` commands may take up to 30 s each (emulate_hosts._run)
            code = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail(f"no exit 90 s after {sig.name}; still running under it: {_children(proc.pid)}")
        assert code != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    assert not [ns for ns in names if ns in listed] and not any(os.path.exists(f"/etc/netns/{ns}") for ns in names)


def _children(pid):
    """The command lines of `pid`'s child processes (what a cleanup that does not end waits on)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    found.append(f.read().replace(b"\0", b" ").decode(errors="replace").strip())
        except (OSError, ValueError, IndexError):
            continue
    return sorted(set(found)) or "no child process"


@needs_namespaces
def test_stale_namespaces_of_a_killed_run_are_cleaned_up():
    script = ("import sys, time; sys.path.insert(0, sys.argv[1]); from emulate_hosts import NetworkNamespaces\n"
              "h = NetworkNamespaces(2).create(); print(*h.names, flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", script, str(ROOT / "tests")], stdout=subprocess.PIPE, text=True)
    names = proc.stdout.readline().split()
    proc.kill()  # SIGKILL: nothing can clean up
    proc.wait(timeout=10)
    time.sleep(0.1)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    assert all(ns in listed for ns in names)
    assert set(names) <= set(emulate_hosts.cleanup_stale())
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    assert not [ns for ns in names if ns in listed]


# ---------------------------------------------------------------- the Horovod timeline reader (no namespaces)

def synthetic_timeline(path, overlapped):
    """Two buckets, three steps of 1 s; bucket 1 requested at 0.3 s (overlapped) or with bucket 2 at 0.7 s."""
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {}}]
    names = ["tfdist_allreduce/HorovodGroupedAllreduce_grad_dense1_1of1",
             "tfdist_allreduce_1/HorovodGroupedAllreduce_grad_dense0_1of1", "tfdist_metric_sync/HorovodAllreduce_x"]
    for pid, name in enumerate(names, start=1):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
    for step in range(3):
        t0 = step * 1_000_000
        requested = (300_000 if overlapped else 700_000, 700_000)
        transfer = ((310_000, 600_000), (710_000, 900_000)) if overlapped else ((710_000, 1_000_000),) * 2
        for pid, asked, (b, e) in zip((1, 2), requested, transfer):
            events += [{"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": t0 + asked, "pid": pid},
                       {"ph": "X", "name": "0", "ts": t0 + asked, "pid": pid, "dur": 0},
                       {"ph": "E", "ts": t0 + asked + 5, "pid": pid},
                       {"ph": "B", "name": "ALLREDUCE", "ts": t0 + b - 5, "pid": pid},
                       {"ph": "B", "name": "GLOO_ALLREDUCE", "ts": t0 + b, "pid": pid},
                       {"ph": "E", "ts": t0 + e, "pid": pid}, {"ph": "E", "ts": t0 + e + 5, "pid": pid}]
    path.write_text("[\n" + ",\n".join(map(json.dumps, events)) + ",")  # unterminated, as Horovod leaves it
    return str(path)


def test_timeline_reader_tells_overlap_from_none(tmp_path):
    found = timeline_overlap.analyse(synthetic_timeline(tmp_path / "a.json", True), compute_ms=900)
    assert found["rows"] == 2 and found["buckets"] == ["tfdist_allreduce", "tfdist_allreduce_1"]
    assert found["steps_overlapping"] == len(found["steps"]) == 2
    m = found["median"]
    assert (round(m["first_transfer_ms"]), round(m["last_request_ms"]), round(m["end_ms"])) == (410, 800, 1000)  # from the previous step's end
    assert round(m["transfer_before_last_request_ms"]) == 290 and round(m["transfer_ms"]) == 480
    assert round(m["first_transfer_before_compute_end_ms"]) == 490
    none = timeline_overlap.analyse(synthetic_timeline(tmp_path / "b.json", False))
    assert none["steps_overlapping"] == 0 and none["median"]["transfer_before_last_request_ms"] == 0
    lines = timeline_overlap.compare({"bucketed": found, "one-collective": none})
    assert lines == ["bucketed: first transfer 410.0 ms into the step; one-collective's (after the last gradient) "
                     "710.0 ms: transfers began 300.0 ms before backprop ended, 290.0 ms of transfer before the "
                     "last bucket was requested"]


def test_benchmark_mode_names_parse_into_schedule_cycle_and_compression():
    import multihost_benchmark

    parse = multihost_benchmark.parse_mode
    assert parse("ready", 25) == ("tfdist", "ready", None, None)
    assert parse("bucketed", 25) == ("tfdist", 25, None, None)
    assert parse("bucketed:4~1", 25) == ("tfdist", 4.0, 1.0, None)
    assert parse("ready~1+powersgd:4", 25) == ("tfdist", "ready", 1.0, "powersgd:4")
    assert parse("one-collective+topk:0.001", 25) == ("tfdist", 0.0, None, "topk:0.001")
    assert parse("horovod@1", 25) == ("horovod", 0.0, None, None)
    assert parse("none@each", 25) == ("none", 0.0, None, None) and multihost_benchmark.apart("none@each")
    assert not multihost_benchmark.apart("none") and not multihost_benchmark.apart("horovod@1")
    assert parse("HOROVOD_CYCLE_ON_ENQUEUE=0 ready~10", 25) == ("tfdist", "ready", 10.0, None)
    assert multihost_benchmark.mode_env("A=1 B=x=y ready") == ({"A": "1", "B": "x=y"}, "ready")
    assert multihost_benchmark.sharded("HOROVOD_CYCLE_ON_ENQUEUE=0 ready/sharded")
    for bad in ("horovod+powersgd", "ready:4", "buckets", "A ready", "ready@each", "none@2"):
        with pytest.raises(SystemExit, match="--modes"):
            parse(bad, 25)


def test_benchmark_summary_sets_each_mode_against_every_hosts_baseline_at_once():
    """none@each (every host's 1-rank baseline at once, no exchange) shows what the emulated hosts'
    sharing of one machine costs: each mode's step beyond it is the exchange's own cost."""
    import argparse

    import multihost_benchmark

    def run(step_ms, gradient_bytes=None, ranks=1, cpu=None):
        rank = {"step_seconds": [1.0] + [ms / 1e3 for ms in step_ms], "warmup_steps_excluded": 1,
                "gradient_bytes": gradient_bytes}
        names = {r: cpu and {"main": 2.0, **({"tf_data": 4.0} if r else {})} for r in range(ranks)}  # by name
        return {"ranks": {str(r): {**rank, "thread_cpu_per_step": cpu and cpu(r), "thread_cpu_by_name": names[r]}
                          for r in range(ranks)}}

    def cpu(other):  # what the worker's timer writes: CPU-ms a step by kind of thread, and the delay line's
        return lambda rank: {"exchange_ms": other + rank, "exchange_kernel_ms": 2.0, "rest_ms": 40.0,
                             "rest_kernel_ms": 1.0, "delay line": 3.0}

    runs = {"none": [run([30, 31, 29], 4096)], "none@each": [run([40, 41, 39], ranks=2)],
            "ready": [run([45, 46, 44], ranks=2, cpu=cpu(6)), run([45, 46, 44], ranks=2, cpu=cpu(9))]}
    args = argparse.Namespace(bucket_mb=25, horovod_model_bucket_mb=1.0, rate_gbit=10.0)
    summary = multihost_benchmark.summarize(runs, args, {"goodput_gbit": 8.0, "rtt_ms": 0.1})
    rows = {r["mode"]: r for r in summary["rows"]}
    assert summary["baseline_ms"] == pytest.approx(30) and summary["apart_ms"] == pytest.approx(40)
    assert rows["ready"]["exposed_ms"] == pytest.approx(15) and rows["ready"]["beyond_apart_ms"] == pytest.approx(5)
    assert "exposed_ms" not in rows["none@each"] and "beyond_apart_ms" not in rows["none@each"]
    meta = {"model": "m", "batch_size": 8, "hosts": 2, "link": "10 Gbit/s"}
    text = multihost_benchmark.markdown(summary, meta)
    assert "- ready: 5.0 ms a step beyond none@each" in text
    # the exchange's threads' CPU: the median of every rank of every run (6, 7, 9, 10), not rank 0's
    assert rows["ready"]["thread_cpu_ms"]["exchange_ms"] == pytest.approx(8) and "thread_cpu_ms" not in rows["none"]
    # by thread name likewise, a name one rank lacks counting 0 there (tf_data: 0, 4, 0, 4)
    assert rows["ready"]["thread_cpu_by_name_ms"] == {"main": 2.0, "tf_data": 2.0}
    assert "thread_cpu_by_name_ms" not in rows["none"]
    assert ("- ready: CPU a step: Horovod's threads 8.0 ms (2.0 in the kernel), the rest (TensorFlow, Python) "
            "40.0 ms (1.0 in the kernel), delay line 3.0 ms (medians of ranks and runs)") in text
