"""Horovod's cycle follows the training step: measured over the first steps of `fit`, then set.

A collective waits for the next wake-up of Horovod's background thread: half a cycle on average,
for each round of collectives in a step (a small CNN's timeline shows three). Every wake-up also
costs CPU (over Gloo a readiness message to every rank; about 7% of a core at a 1 ms cycle,
docs/benchmarks/records-2026-11-22-intel-xeon.md), which a CPU rank takes from its compute.
Minimising `rounds * cycle / 2 + step * wake_cost / cycle` gives a cycle of
`sqrt(2 * wake_cost * step / rounds)`, about `sqrt(0.05 ms * step)`: CPU steps of 2 s and more
(ResNet50's) keep 10 ms (the CPU default), a CNN step of 40 ms gets 1.5 ms, a step of 5 ms 0.5 ms.

`HorovodStrategy()` turns this on where it set the CPU default cycle itself (not where the
user set `HOROVOD_CYCLE_TIME` or `horovod={"cycle_time_ms": ...}`, tfdist-tune measured one,
or Horovod's autotuner runs) and Horovod does not start a cycle when a collective is enqueued
(`starts_on_enqueue()`, tfdist's patch 0017: then no collective waits for the cycle, and a
shorter one would only wake an idle rank more often). The chosen cycle is set through tfdist's
Horovod patch 0015, read back from Horovod, and the chief prints it:

```python
from tfdist.tuning import cycle
cycle.cycle_for_step_ms(40.0)    # 1.5
```
"""

import math
import os
import statistics
import time

WAKE_COST_MS = 0.05   # 2 * wake-up cost a ms of cycle (0.07 of a core at 1 ms) / rounds (3), rounded
MIN_CYCLE_MS = 0.5
MAX_CYCLE_MS = 10.0
SKIPPED_STEPS = 2     # the first step traces the function, the second warms caches
MEASURED_STEPS = 10

_state = {"follow": False, "done": False, "previous_ms": None, "choice": None}


def cycle_for_step_ms(step_ms):
    """The cycle (ms) for training steps of `step_ms`: sqrt(WAKE_COST_MS * step), in [0.5, 10],
    rounded to 0.5 ms (to whole ms from 5 ms), so ranks whose steps differ by noise agree."""
    cycle = min(MAX_CYCLE_MS, max(MIN_CYCLE_MS, math.sqrt(WAKE_COST_MS * step_ms)))
    return float(round(cycle)) if cycle >= 5 else max(MIN_CYCLE_MS, round(cycle * 2) / 2)


def follow_steps(cycle_ms):
    """Called by `HorovodStrategy()` where tfdist set Horovod's cycle (`cycle_ms`) as a default."""
    _state.update(follow=True, done=False, previous_ms=float(cycle_ms))


def choice():
    """What this process measured and chose: {"step_ms", "cycle_ms", "in_effect_ms"}; None before."""
    return _state["choice"]


def following():
    return _state["follow"] and not _state["done"] and os.environ.get("HOROVOD_AUTOTUNE", "0") in ("", "0")


def starts_on_enqueue():
    """Whether Horovod starts its cycle when a collective is enqueued (HOROVOD_CYCLE_ON_ENQUEUE=1,
    tfdist's patch 0017), as Horovod reports it; None where this Horovod cannot say (a build
    without the patch) or is not initialized."""
    from tfdist import _compat_state

    getter = getattr(_compat_state.horovod_ctypes_library(), "horovod_cycle_on_enqueue", None)
    if getter is None:
        return None
    import ctypes

    getter.restype = ctypes.c_int
    value = getter()
    return None if value < 0 else bool(value)


def set_cycle_ms(cycle_ms):
    """Set Horovod's cycle while it runs; returns the cycle Horovod then reports (ms), or None
    where this Horovod has no `horovod_set_cycle_time_ms` (a build without tfdist's patch 0015)."""
    from tfdist import _compat_state

    library = _compat_state.horovod_ctypes_library()
    setter = getattr(library, "horovod_set_cycle_time_ms", None)
    if setter is None:
        return None
    import ctypes

    setter.argtypes, setter.restype = [ctypes.c_double], ctypes.c_int
    library.horovod_cycle_time_ms.restype = ctypes.c_double
    if setter(float(cycle_ms)) != 1:
        return None
    deadline = time.monotonic() + 1.0 + 2 * (_state["previous_ms"] or MAX_CYCLE_MS) / 1000
    while time.monotonic() < deadline:   # the background thread takes it at its next cycle
        in_effect = library.horovod_cycle_time_ms()
        if abs(in_effect - cycle_ms) < 1e-9:
            return in_effect
        time.sleep(0.001)
    return library.horovod_cycle_time_ms()


class StepClock:
    """Times the train steps of a `fit` (batch begin to batch begin) and, after SKIPPED_STEPS +
    MEASURED_STEPS of them, sets the cycle once for the process."""

    def __init__(self, report):
        self._report = report   # report(line): the chief prints it
        self._begins = []

    def batch_begins(self):
        if not following():
            return
        self._begins.append(time.perf_counter())
        if len(self._begins) < SKIPPED_STEPS + MEASURED_STEPS + 1:
            return
        times = self._begins[SKIPPED_STEPS:]
        step_ms = statistics.median(b - a for a, b in zip(times, times[1:])) * 1000
        _state["done"] = True
        chosen = cycle_for_step_ms(step_ms)
        previous = _state["previous_ms"]
        _state["choice"] = {"step_ms": step_ms, "cycle_ms": chosen, "in_effect_ms": previous}
        if chosen == previous:
            self._report(f"tfdist tuning: Horovod cycle kept at {previous:g} ms for train steps of "
                         f"{step_ms:.1f} ms (median of {MEASURED_STEPS})")
            return
        in_effect = set_cycle_ms(chosen)
        _state["choice"]["in_effect_ms"] = previous if in_effect is None else in_effect
        if in_effect is None:
            self._report(f"tfdist tuning: Horovod cycle stays {previous:g} ms: this Horovod cannot set it while "
                         "running (build it with tfdist-install-horovod: patch 0015)")
        else:
            self._report(f"tfdist tuning: Horovod cycle {previous:g} -> {in_effect:g} ms for train steps of "
                         f"{step_ms:.1f} ms (median of {MEASURED_STEPS}; Horovod reports {in_effect:g} ms)")
