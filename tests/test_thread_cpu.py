"""tfdist.benchmark.thread_cpu and StepTimer's CPU window: a process's CPU by kind of thread, read
from the kernel's own per-thread accounting, against each thread's own clock."""

import ctypes
import subprocess
import sys
import threading
import time

import pytest

from tfdist.benchmark import thread_cpu
from tfdist.benchmark.timing import StepTimer

TICK_MS = 1e3 / thread_cpu._TICKS_PER_S


def busy(seconds, name=None, spent=None, hold=None):
    """Spin for `seconds` of this thread's CPU (named `name` for the kernel), add it to `spent`,
    then wait for `hold` (a thread that has ended is no longer in /proc)."""
    if name:
        ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME: what /proc/.../comm shows
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass
    if spent is not None:
        spent.append(time.thread_time() - start)
    if hold is not None:
        hold.wait()


def test_threads_are_counted_by_kind_as_their_own_clocks_say():
    before, spent, hold = thread_cpu.snapshot(), {"tf_worker": [], None: []}, threading.Event()
    threads = [threading.Thread(target=busy, args=(0.3, name, spent[name], hold)) for name in spent]
    for t in threads:
        t.start()
    main_start = time.thread_time()
    busy(0.2)
    main = time.thread_time() - main_start
    while sum(map(len, spent.values())) < 2:
        time.sleep(0.01)
    cpu = thread_cpu.per_step(before, thread_cpu.snapshot(), steps=2)
    hold.set()
    for t in threads:
        t.join()
    # the named thread and the main thread are compute; the unnamed one is "other" (as Horovod's loop)
    assert cpu["other_ms"] == pytest.approx(spent[None][0] * 1e3 / 2, abs=2 * TICK_MS)
    assert cpu["compute_ms"] >= (spent["tf_worker"][0] + main) * 1e3 / 2 - 2 * TICK_MS
    assert 0 <= cpu["other_kernel_ms"] <= cpu["other_ms"] and 0 <= cpu["compute_kernel_ms"] <= cpu["compute_ms"]
    assert "other threads (Horovod, Gloo, Python)" in thread_cpu.describe(cpu)


def test_another_process_and_a_missing_one():
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.4: pass\ntime.sleep(30)"])
    try:
        before = thread_cpu.snapshot(child.pid)
        time.sleep(1.0)
        spent = thread_cpu.process_ms(before, thread_cpu.snapshot(child.pid), steps=1)
        assert 100 < spent <= 400 + 2 * TICK_MS  # the spin, less what it did before the first snapshot
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
    assert cpu["compute_ms"] == pytest.approx(50, abs=TICK_MS + 5) and cpu["other_ms"] < TICK_MS
    assert cpu["itself"] == pytest.approx(cpu["compute_ms"] + cpu["other_ms"], abs=TICK_MS)
    assert ", itself " in thread_cpu.describe(cpu)
    short = StepTimer(cpu_steps=(1, 3))
    for _ in range(2):
        short.begin()
        short.end(0.0)
    assert short.thread_cpu is None  # the run ended inside the window: nothing made up
