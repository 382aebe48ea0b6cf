"""tfdist.benchmark.thread_cpu and StepTimer's CPU window: a process's CPU by kind of thread, read
from the kernel's own per-thread accounting, against each thread's own clock; and the names
tfdist.launch.thread_names gives the threads Horovod starts."""

import subprocess
import sys
import threading
import time

import pytest

from tfdist.benchmark import thread_cpu
from tfdist.benchmark.timing import StepTimer
from tfdist.launch import thread_names

TICK_MS = 1e3 / thread_cpu._TICKS_PER_S


def busy(seconds, spent=None, hold=None):
    """Spin for `seconds` of this thread's CPU, add it to `spent`, then wait for `hold` (a thread
    that has ended is no longer in /proc)."""
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass
    if spent is not None:
        spent.append(time.thread_time() - start)
    if hold is not None:
        hold.wait()


def own_name(tid=None):
    return open(f"/proc/self/task/{tid or threading.get_native_id()}/comm").read().strip()


def test_threads_started_in_the_block_and_theirs_carry_the_name_and_the_caller_keeps_its_own():
    mine, seen, hold = own_name(), {}, threading.Event()

    def child():
        seen["child"] = own_name()
        hold.wait()

    def loop():  # as Horovod's background loop, which starts Gloo's threads after init returns
        seen["loop"] = own_name()
        grandchild = threading.Thread(target=child)
        grandchild.start()
        hold.wait()
        grandchild.join()

    with thread_names.started_as(thread_names.EXCHANGE):
        started = threading.Thread(target=loop)
        started.start()
    after = threading.Thread(target=lambda: seen.setdefault("after", own_name()))
    after.start()
    after.join()
    while len(seen) < 3:
        time.sleep(0.01)
    hold.set()
    started.join()
    assert seen == {"loop": "hvd_exchange", "child": "hvd_exchange", "after": mine} and own_name() == mine


def test_threads_are_counted_by_kind_as_their_own_clocks_say():
    before, spent, hold = thread_cpu.snapshot(), {"exchange": [], "rest": []}, threading.Event()
    with thread_names.started_as(thread_names.EXCHANGE):
        exchange = threading.Thread(target=busy, args=(0.3, spent["exchange"], hold))
        exchange.start()
    rest = threading.Thread(target=busy, args=(0.3, spent["rest"], hold))
    rest.start()
    main_start = time.thread_time()
    busy(0.2)
    main = time.thread_time() - main_start
    while sum(map(len, spent.values())) < 2:
        time.sleep(0.01)
    after = thread_cpu.snapshot()
    hold.set()
    for t in (exchange, rest):
        t.join()
    ours = {exchange.native_id, rest.native_id, threading.get_native_id()}  # not an earlier test's Horovod
    snapshots = [{t: v for t, v in s.items() if t in ours} for s in (before, after)]
    cpu = thread_cpu.per_step(*snapshots, steps=2)
    # the named thread is the exchange; the unnamed one and the main thread (TensorFlow's, Python's) the rest
    assert cpu["exchange_ms"] == pytest.approx(spent["exchange"][0] * 1e3 / 2, abs=2 * TICK_MS)
    assert cpu["rest_ms"] == pytest.approx((spent["rest"][0] + main) * 1e3 / 2, abs=3 * TICK_MS)
    assert 0 <= cpu["exchange_kernel_ms"] <= cpu["exchange_ms"] and 0 <= cpu["rest_kernel_ms"] <= cpu["rest_ms"]
    assert cpu["exchange_threads"] == 1 and "Horovod's threads" in thread_cpu.describe(cpu)
    # by name: the main thread as "main", the unnamed thread by the name it inherited
    names = thread_cpu.by_name(*snapshots, steps=2)
    assert set(names) == {"hvd_exchange", "main", after[rest.native_id][0]} and list(names)[-1] == "main"
    assert names["main"] == pytest.approx(main * 1e3 / 2, abs=2 * TICK_MS)
    assert names["hvd_exchange"] == pytest.approx(cpu["exchange_ms"]) and sum(names.values()) == pytest.approx(
        cpu["exchange_ms"] + cpu["rest_ms"])


def test_another_process_and_a_missing_one():
    spin = "import time\nwhile time.process_time() < 0.5: pass\nprint(time.process_time(), flush=True)\ntime.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True)
    try:
        before = thread_cpu.snapshot(child.pid)  # before its start-up is over, so before it spins
        total_ms = float(child.stdout.readline()) * 1e3  # all its CPU: start-up and spin
        spent = thread_cpu.process_ms(before, thread_cpu.snapshot(child.pid), steps=1)
        assert 300 < spent <= total_ms + 2 * TICK_MS
    finally:
        child.kill()
        child.wait()
    assert thread_cpu.snapshot(child.pid) == {}


def test_step_timer_takes_the_window_it_was_given():
    timer = StepTimer(cpu_steps=(1, 3), processes={"itself": __import__("os").getpid()})
    for step in range(4):
        timer.begin()
        busy(0.05)
        timer.end(0.0)
        assert (timer.thread_cpu is None) == (step < 2)
    cpu = timer.thread_cpu  # steps 2 and 3: about 50 ms each, in the main thread
    assert cpu["rest_ms"] == pytest.approx(50, abs=TICK_MS + 5) and cpu["exchange_ms"] <= TICK_MS
    assert cpu["itself"] == pytest.approx(cpu["rest_ms"] + cpu["exchange_ms"], abs=TICK_MS)
    assert ", itself " in thread_cpu.describe(cpu)
    assert timer.thread_cpu_by_name["main"] == pytest.approx(50, abs=TICK_MS + 5)
    short = StepTimer(cpu_steps=(1, 3))
    for _ in range(2):
        short.begin()
        short.end(0.0)
    assert short.thread_cpu is None  # the run ended inside the window: nothing made up
