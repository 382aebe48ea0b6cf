"""Per-rank CPU/GPU tuning: threads, core pinning, oneDNN/OpenMP and GPU settings, with reasons.

```python
from tfdist import tuning
topology = tuning.detect_topology(local_rank=0, local_size=2)
plan = tuning.make_plan(topology)          # pure: same topology, same plan
print(plan.summary())                      # one line: what was chosen and why
tuning.apply(plan)                         # HorovodStrategy() does detect + plan + apply itself
```

CPU: each of the `local_size` ranks on a node gets its share of the physical cores (never two
ranks on one core): intra-op threads = that share, inter-op threads = the sockets the share
spans, and the process is pinned to those cores (with their SMT siblings). oneDNN is switched on
(`TF_ENABLE_ONEDNN_OPTS=1`), and OpenMP builds (intel-tensorflow) get `OMP_NUM_THREADS`,
`KMP_BLOCKTIME`, `KMP_AFFINITY`, `KMP_SETTINGS`. GPU: one GPU per local rank, memory growth on.
Settings TensorFlow reads at start-up are reported as too late when TensorFlow has started.
Horovod: CPU-only jobs get a 10 ms background cycle (`set_horovod_defaults`, before `hvd.init()`).
"""

import dataclasses
import glob
import logging
import os

from tfdist import _compat

log = logging.getLogger("tfdist")


@dataclasses.dataclass(frozen=True)
class Topology:
    """What one rank sees. `cores` lists (socket, core id, [logical cpus]) per physical core."""

    cores: tuple
    local_rank: int = 0
    local_size: int = 1
    gpus: int = 0
    openmp_build: bool = False

    @property
    def sockets(self):
        return len({socket for socket, _, _ in self.cores})

    @property
    def smt(self):
        return max((len(cpus) for _, _, cpus in self.cores), default=1) > 1


@dataclasses.dataclass(frozen=True)
class Plan:
    intra_op_threads: int
    inter_op_threads: int
    cpu_affinity: tuple  # logical cpus this rank is pinned to (empty: no pinning)
    env: dict
    visible_gpu: int = None
    reasons: tuple = ()

    def summary(self):
        gpu = f", GPU {self.visible_gpu}" if self.visible_gpu is not None else ""
        return (f"tfdist tuning: intra_op={self.intra_op_threads} inter_op={self.inter_op_threads} "
                f"cpus={_ranges(self.cpu_affinity)}{gpu}; " + "; ".join(self.reasons))

    def as_dict(self):
        return dataclasses.asdict(self)


def make_plan(topology, *, intra_op_threads=None, inter_op_threads=None, pin=True, onednn=True):
    """The settings for one rank of `topology`; explicit arguments override the choices."""
    reasons = []
    ranks, rank = max(topology.local_size, 1), topology.local_rank
    ordered = sorted(topology.cores, key=lambda c: (c[0], c[1]))
    if len(ordered) >= ranks:
        share = len(ordered) // ranks
        mine = ordered[rank * share : (rank + 1) * share]
        reasons.append(f"{len(ordered)} physical cores / {ranks} local ranks = {share} each"
                       + (" (SMT siblings pinned, not counted)" if topology.smt else ""))
    else:
        mine = [ordered[rank % len(ordered)]] if ordered else []
        reasons.append(f"{ranks} local ranks > {len(ordered)} physical cores: oversubscribed, 1 thread each")
    intra = intra_op_threads or max(len(mine), 1)
    inter = inter_op_threads or max(len({socket for socket, _, _ in mine}), 1)
    affinity = tuple(sorted(cpu for _, _, cpus in mine for cpu in cpus)) if pin else ()
    env = {}
    if onednn:
        env["TF_ENABLE_ONEDNN_OPTS"] = "1"
        reasons.append("oneDNN on")
    if topology.openmp_build:
        env.update({"OMP_NUM_THREADS": str(intra), "KMP_BLOCKTIME": "1",
                    "KMP_AFFINITY": "granularity=fine,compact,1,0", "KMP_SETTINGS": "1"})
        reasons.append("OpenMP build: OMP/KMP settings")
    gpu = None
    if topology.gpus:
        gpu = rank % topology.gpus
        if ranks > topology.gpus:
            reasons.append(f"{ranks} local ranks share {topology.gpus} GPUs")
        else:
            reasons.append(f"one GPU per local rank ({topology.gpus} GPUs)")
    return Plan(intra, inter, affinity, env, gpu, tuple(reasons))


# Horovod's background thread wakes every HOROVOD_CYCLE_TIME ms (1 by default) and, over Gloo,
# exchanges a readiness message with the other ranks each time: measured here, about 3,500
# context switches a second and 6-8% of a core per idle rank, taken from ranks pinned to few
# cores. On CPU a training step takes 100s of ms, so a 10 ms cycle costs nothing measurable in
# latency (2 ranks x 1 core, ResNet50: 3.55 -> 4.48 images/s, docs/PERFORMANCE.md). GPU steps can
# be a few ms, so GPU jobs keep Horovod's default.
CPU_CYCLE_TIME_MS = 10


def horovod_defaults(gpus):
    """Environment defaults for Horovod, to set before `hvd.init()`: {variable: (value, reason)}."""
    if gpus:
        return {}
    return {"HOROVOD_CYCLE_TIME": (str(CPU_CYCLE_TIME_MS),
                                   f"Horovod cycle {CPU_CYCLE_TIME_MS} ms (CPU: fewer background wake-ups)")}


def set_horovod_defaults():
    """Set `horovod_defaults` for this machine where the environment does not already say; returns them."""
    chosen = {}
    for key, (value, reason) in horovod_defaults(_count_gpus()).items():
        if key not in os.environ:
            os.environ[key] = value
            chosen[key] = (value, reason)
    return chosen


def detect_topology(local_rank=0, local_size=1):
    """Read this node's cores (Linux sysfs), GPUs and TensorFlow build kind."""
    cores = {}
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    for path in sorted(glob.glob("/sys/devices/system/cpu/cpu[0-9]*/topology/core_id")):
        cpu = int(path.split("/")[5][3:])
        if allowed is not None and cpu not in allowed:
            continue
        topo = os.path.dirname(path)
        socket = int(_read(os.path.join(topo, "physical_package_id"), "0"))
        core = int(_read(path, str(cpu)))
        cores.setdefault((socket, core), []).append(cpu)
    if not cores:  # no sysfs: treat every usable cpu as a core
        cpus = sorted(allowed or range(os.cpu_count() or 1))
        cores = {(0, c): [c] for c in cpus}
    return Topology(
        cores=tuple((s, c, tuple(cpus)) for (s, c), cpus in sorted(cores.items())),
        local_rank=local_rank, local_size=local_size,
        gpus=_count_gpus(), openmp_build=_is_openmp_build(),
    )


def apply(plan):
    """Apply `plan` to this process; returns the list of settings that came too late."""
    import sys

    too_late = []
    tf_loaded = "tensorflow" in sys.modules
    for key, value in plan.env.items():
        if os.environ.get(key) != value:
            if tf_loaded and key in ("TF_ENABLE_ONEDNN_OPTS", "OMP_NUM_THREADS", "KMP_AFFINITY"):
                # TensorFlow read these when it loaded; oneDNN may be on by default anyway
                if not (key == "TF_ENABLE_ONEDNN_OPTS" and onednn_active() == (value == "1")):
                    too_late.append(f"{key}={value}")
            os.environ[key] = value
    if plan.cpu_affinity and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, plan.cpu_affinity)
    import tensorflow as tf

    try:
        tf.config.threading.set_intra_op_parallelism_threads(plan.intra_op_threads)
        tf.config.threading.set_inter_op_parallelism_threads(plan.inter_op_threads)
    except RuntimeError:
        too_late.append("intra/inter-op threads")
    if plan.visible_gpu is not None:
        gpus = tf.config.list_physical_devices("GPU")
        try:
            tf.config.set_visible_devices(gpus[plan.visible_gpu], "GPU")
            tf.config.experimental.set_memory_growth(gpus[plan.visible_gpu], True)
        except RuntimeError:
            too_late.append("visible GPU / memory growth")
    if too_late:
        log.warning("tfdist tuning: TensorFlow had already started, so these settings did not take "
                    "effect: %s. Create HorovodStrategy before running any TensorFlow op, and set "
                    "environment variables before importing tensorflow (e.g. in the job script).",
                    ", ".join(too_late))
    return too_late


def onednn_active():
    """Whether the loaded TensorFlow runs oneDNN kernels (on by default on some CPUs only)."""
    return _compat.onednn_enabled()


_HOROVOD_KNOBS = {
    "fusion_threshold_mb": ("HOROVOD_FUSION_THRESHOLD", lambda mb: str(int(mb * (1 << 20)))),
    "cycle_time_ms": ("HOROVOD_CYCLE_TIME", str),
    "timeline": ("HOROVOD_TIMELINE", str),
    "autotune": ("HOROVOD_AUTOTUNE", lambda on: "1" if on else "0"),
}


def set_horovod_knobs(knobs):
    """Set `HorovodStrategy(horovod=...)` knobs as HOROVOD_* variables, unless already set."""
    unknown = set(knobs) - set(_HOROVOD_KNOBS)
    if unknown:
        raise ValueError(f"unknown horovod option(s) {sorted(unknown)}; expected {sorted(_HOROVOD_KNOBS)}")
    for key, value in knobs.items():
        env, convert = _HOROVOD_KNOBS[key]
        os.environ.setdefault(env, convert(value))


def tune_this_rank(options, horovod_defaults):
    """Detect this rank's share of the node, make and apply its plan; the chief prints the summary."""
    from tfdist import collectives

    overrides = options if isinstance(options, dict) else {}
    topology = detect_topology(collectives.local_rank(), collectives.local_size())
    plan = make_plan(topology, **overrides)
    if horovod_defaults:  # already applied before hvd.init(); listed so the summary says so
        plan = dataclasses.replace(
            plan, env={**plan.env, **{k: v for k, (v, _) in horovod_defaults.items()}},
            reasons=plan.reasons + tuple(reason for _, reason in horovod_defaults.values()))
    apply(plan)
    if collectives.rank() == 0:
        print(plan.summary(), flush=True)
    log.info("tfdist tuning (rank %d): %s", collectives.rank(), plan.as_dict())
    return plan


def _read(path, default):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


def _count_gpus():
    import tensorflow as tf

    return len(tf.config.list_physical_devices("GPU"))


def _is_openmp_build():
    import tensorflow as tf

    lib_dir = os.path.dirname(tf.__file__)
    return bool(glob.glob(os.path.join(lib_dir, "**", "libiomp5*"), recursive=True))


def _ranges(cpus):
    if not cpus:
        return "unpinned"
    spans, start = [], cpus[0]
    for prev, cur in zip(cpus, list(cpus[1:]) + [None]):
        if cur != prev + 1:
            spans.append(f"{start}-{prev}" if prev != start else str(start))
            start = cur
    return ",".join(spans)
