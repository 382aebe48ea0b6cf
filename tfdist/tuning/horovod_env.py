"""Horovod's environment for this machine, set before `hvd.init()`: its cycle, Open MPI's waiting.

```python
from tfdist.tuning import horovod_env
print(horovod_env.horovod_defaults(gpus=0, open_mpi=True))   # cycle 10 ms, started on enqueue; Open MPI yields
horovod_env.set_horovod_knobs({"fusion_threshold_mb": 64})   # HorovodStrategy(horovod=...)
```

Every value is a default: a variable already in the environment (the user's) is left as it is.
"""

import ctypes
import os

from tfdist.tuning import environment
from tfdist.units import MB

# Horovod's background thread wakes every HOROVOD_CYCLE_TIME ms (1 by default) and, over Gloo,
# exchanges a readiness message with the other ranks each time: measured here, about 3,500
# context switches a second and 6-8% of a core per idle rank, taken from ranks pinned to few
# cores (2 ranks x 1 core, ResNet50: 3.55 -> 4.48 images/s at 10 ms,
# docs/benchmarks/records-2026-11-22-intel-xeon.md). GPU steps can be a few ms, so GPU jobs keep
# Horovod's default.
CPU_CYCLE_TIME_MS = 10

# A collective waits for the next cycle: a whole 10 ms cycle for one enqueued just after a cycle
# began (an eager allreduce, each round of a step's collectives). tfdist's Horovod patch 0017
# starts a cycle when a collective is enqueued, so on CPU the 10 ms only spaces an idle rank's
# wake-ups: a 4 KB allreduce on 2 ranks 10.1 -> 0.66 ms (eager; 0.86 in a tf.function), an idle
# rank's CPU 2% of a core either way (Zen 4, docs/benchmarks/records-2026-12-06-cycle-on-enqueue.md). Where Horovod cannot do it
# (a build without the patch), `tfdist.tuning.cycle` sets the cycle from the train steps' length.
CYCLE_ON_ENQUEUE = "HOROVOD_CYCLE_ON_ENQUEUE"
ON_ENQUEUE_MISSING = ("Horovod's cycle does not start on enqueue: this Horovod lacks tfdist's patch 0017 "
                      "(tfdist-install-horovod builds it); the cycle follows the train steps instead")


# Open MPI's progress engine spins while it waits (Horovod's background thread waits in a collective
# every cycle until the slowest rank is ready); on a CPU node that spin shares each rank's cores
# with TensorFlow's compute threads. Yielding lets them run: 2 ranks on a 2-core Zen 4, ResNet50
# batch 16, 1.10x-1.21x the images/s of Open MPI's default spin, 1.04x Gloo's
# (docs/benchmarks/records-2026-11-29-open-mpi-yield.md).
OPEN_MPI_YIELD = "OMPI_MCA_mpi_yield_when_idle"


def horovod_defaults(gpus, choice=None, open_mpi=False):
    """Environment defaults for Horovod, to set before `hvd.init()`: {variable: (value, reason)}.

    `open_mpi`: the job was started by Open MPI's mpirun (then, on CPU, Open MPI yields while it waits).
    """
    defaults = {}
    measured = (choice or {}).get("cycle_time_ms")
    if measured:
        defaults["HOROVOD_CYCLE_TIME"] = (f"{measured:g}", f"Horovod cycle {measured:g} ms (measured by tfdist-tune)")
    elif not gpus:
        defaults["HOROVOD_CYCLE_TIME"] = (str(CPU_CYCLE_TIME_MS),
                                          f"Horovod cycle {CPU_CYCLE_TIME_MS} ms (CPU: fewer background wake-ups)")
    if not gpus:
        defaults[CYCLE_ON_ENQUEUE] = ("1", "a collective starts Horovod's cycle at once (HOROVOD_CYCLE_ON_ENQUEUE=1)")
    if open_mpi and not gpus:
        defaults[OPEN_MPI_YIELD] = ("1", "Open MPI yields while it waits (CPU: its spin would share the "
                                         "compute threads' cores)")
    return defaults


def cycle_is_cpu_default(chosen):
    """Whether `set_horovod_defaults` (returning `chosen`) set Horovod's cycle to the CPU default:
    then `tfdist.tuning.cycle` may follow the steps (a user's or a measured cycle is kept)."""
    return chosen.get("HOROVOD_CYCLE_TIME") == horovod_defaults(gpus=0)["HOROVOD_CYCLE_TIME"]


def open_mpi_waiting():
    """How this process's Open MPI waits, as Open MPI reports it (MPI_T): "yields" or "spins"; None
    where Open MPI did not start the job, is not loaded, or cannot say."""
    if not environment.launched_by_open_mpi():
        return None
    try:
        lib = ctypes.CDLL("libmpi.so.40", mode=os.RTLD_NOLOAD)   # Open MPI 3-5, loaded by Horovod
    except OSError:
        return None
    provided, index, count = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    handle, value = ctypes.c_void_p(), (ctypes.c_uint8 * 8)()
    if lib.MPI_T_init_thread(0, ctypes.byref(provided)) != 0:
        return None
    try:
        if (lib.MPI_T_cvar_get_index(b"mpi_yield_when_idle", ctypes.byref(index)) != 0
                or lib.MPI_T_cvar_handle_alloc(index, None, ctypes.byref(handle), ctypes.byref(count)) != 0):
            return None
        read = lib.MPI_T_cvar_read(handle, value)
        lib.MPI_T_cvar_handle_free(ctypes.byref(handle))
        return None if read != 0 else ("yields" if value[0] else "spins")   # a C bool: one byte
    finally:
        lib.MPI_T_finalize()


def set_horovod_defaults(local_size=None):
    """Set `horovod_defaults` for this machine where the environment does not already say; returns them."""
    from tfdist.tuning import cache as tuning_cache

    chosen = {}
    size = local_size or environment.local_layout()[1]
    defaults = horovod_defaults(environment.gpu_count(), tuning_cache.choice_for(size),
                                open_mpi=environment.launched_by_open_mpi())
    for key, (value, reason) in defaults.items():
        if key not in os.environ:
            os.environ[key] = value
            chosen[key] = (value, reason)
    return chosen


HOROVOD_KNOBS = {
    "fusion_threshold_mb": ("HOROVOD_FUSION_THRESHOLD", lambda mb: str(int(mb * MB))),
    "cycle_time_ms": ("HOROVOD_CYCLE_TIME", str),
    "timeline": ("HOROVOD_TIMELINE", str),
    "autotune": ("HOROVOD_AUTOTUNE", lambda on: "1" if on else "0"),
}


def set_horovod_knobs(knobs):
    """Set `HorovodStrategy(horovod=...)` knobs as HOROVOD_* variables, unless already set."""
    unknown = set(knobs) - set(HOROVOD_KNOBS)
    if unknown:
        raise ValueError(f"unknown horovod option(s) {sorted(unknown)}; expected {sorted(HOROVOD_KNOBS)}")
    for key, value in knobs.items():
        env, convert = HOROVOD_KNOBS[key]
        os.environ.setdefault(env, convert(value))
