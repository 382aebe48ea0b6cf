"""Per-rank CPU/GPU tuning: threads, core pinning, oneDNN/OpenMP and GPU settings, with reasons.

```python
from tfdist.tuning import plan as tuning
topology = tuning.detect_topology(local_rank=0, local_size=2)
plan = tuning.make_plan(topology)          # pure: same topology, same plan
print(plan.summary())                      # one line: what was chosen and why
tuning.apply(plan)                         # HorovodStrategy() does detect + plan + apply itself
print(tuning.in_effect())                  # what TensorFlow reports: oneDNN, thread pools, cpus
```

CPU: each of the `local_size` ranks on a node gets its share of the physical cores (never two
ranks on one core): intra-op threads = that share, and the process is pinned to those cores
(with their SMT siblings). Inter-op threads stay TensorFlow's default (measured: forcing 1 lost
to it) but never fewer than 2: TensorFlow's default is the rank's cpu count, and with one inter-op
thread a `tf.function` that makes its own iterator over a distributed dataset deadlocks
(`MIN_INTER_OP_THREADS`). oneDNN is switched on (`TF_ENABLE_ONEDNN_OPTS=1`; TensorFlow leaves it off on CPUs
without AVX-512 VNNI/BF16, where it is worth about 1.45x for ResNet50), and OpenMP builds
(intel-tensorflow) get `OMP_NUM_THREADS`, `KMP_BLOCKTIME`, `KMP_AFFINITY`, `KMP_SETTINGS`. GPU: one
GPU per local rank (`CUDA_VISIBLE_DEVICES`), memory growth on (`tfdist.tuning.gpu`). A `tfdist-tune`
measurement cached for this machine (`tfdist.tuning.cache`) replaces these choices. Settings TensorFlow reads when it loads are
applied before it loads by `tfdist.tuning.startup`; the summary reports what TensorFlow says is in
effect, never the plan alone. Horovod's environment (a 10 ms cycle on CPU, Open MPI yielding):
`tfdist.tuning.horovod_env`.
"""

import dataclasses
import glob
import logging
import os

from tfdist import _compat
from tfdist.tuning import gpu as gpu_lib
from tfdist.tuning import environment, horovod_env

log = logging.getLogger("tfdist")


@dataclasses.dataclass(frozen=True)
class Topology:
    """What one rank sees. `cores` lists (socket, core id, [logical cpus]) per physical core."""

    cores: tuple
    local_rank: int = 0
    local_size: int = 1
    gpus: int = 0
    openmp_build: bool = False
    gpu_ids: tuple = ()  # as CUDA_VISIBLE_DEVICES names them; default: "0" ... str(gpus - 1)

    @property
    def sockets(self):
        return len({socket for socket, _, _ in self.cores})

    @property
    def smt(self):
        return max((len(cpus) for _, _, cpus in self.cores), default=1) > 1


@dataclasses.dataclass(frozen=True)
class Plan:
    intra_op_threads: int
    inter_op_threads: int  # None: TensorFlow's default
    cpu_affinity: tuple  # logical cpus this rank is pinned to (empty: no pinning)
    env: dict
    visible_gpu: int = None
    reasons: tuple = ()
    effect: dict = None  # after `apply`: what TensorFlow reports (`in_effect()`)

    def summary(self):
        if self.effect is not None:
            return f"tfdist tuning: {describe(self.effect, self)}; " + "; ".join(self.reasons)
        gpu = f", GPU {self.visible_gpu}" if self.visible_gpu is not None else ""
        inter = self.inter_op_threads if self.inter_op_threads is not None else "TF default"
        return (f"tfdist tuning: intra_op={self.intra_op_threads} inter_op={inter} "
                f"cpus={_ranges(self.cpu_affinity)}{gpu}; " + "; ".join(self.reasons))

    def as_dict(self):
        return dataclasses.asdict(self)


def make_plan(topology, *, intra_op_threads=None, inter_op_threads=None, pin=True, onednn=True):
    """The settings for one rank of `topology`; explicit arguments override the choices.

    `onednn`: True/False set `TF_ENABLE_ONEDNN_OPTS` to 1/0, None leaves TensorFlow's default.
    `inter_op_threads`: None leaves TensorFlow's default (the cpus the rank may run on) where that
    is at least `MIN_INTER_OP_THREADS`; fewer, asked for or by default, become that minimum.
    """
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
    affinity = tuple(sorted(cpu for _, _, cpus in mine for cpu in cpus)) if pin else ()
    usable = len(affinity) or sum(len(cpus) for _, _, cpus in topology.cores)
    inter = _inter_op_threads(inter_op_threads or None, usable, reasons)
    env = {"TF_NUM_INTRAOP_THREADS": str(intra)}
    if inter:
        env["TF_NUM_INTEROP_THREADS"] = str(inter)
    if onednn is not None:
        env["TF_ENABLE_ONEDNN_OPTS"] = "1" if onednn else "0"
        reasons.append("asked for oneDNN " + ("on" if onednn else "off"))
    if topology.openmp_build:
        env.update({"OMP_NUM_THREADS": str(intra), "KMP_BLOCKTIME": "1",
                    "KMP_AFFINITY": "granularity=fine,compact,1,0", "KMP_SETTINGS": "1"})
        reasons.append("OpenMP build: OMP/KMP settings")
    gpu = None
    ids = topology.gpu_ids or tuple(str(i) for i in range(topology.gpus))
    if ids:
        gpu = rank % len(ids)
        env.update(gpu_lib.early_env(rank, ids))
        if len(ids) == 1:
            reasons.append("the one GPU this rank may use, memory growth on")
        elif ranks > len(ids):
            reasons.append(f"{ranks} local ranks share {len(ids)} GPUs, memory growth on")
        else:
            reasons.append(f"one GPU per local rank ({len(ids)} GPUs), memory growth on")
    return Plan(intra, inter, affinity, env, gpu, tuple(reasons))


# TensorFlow's inter-op pool runs a graph's blocking kernels. With one thread, a tf.function that
# makes an iterator over a distributed dataset (`next(iter(dist_dataset))` in the function, as
# tf-keras' custom-loop tests do) deadlocks on every rank, under MWMS too: its iterator, the
# partial-batch check's cross-rank reduce and the iterator's teardown wait for one another.
MIN_INTER_OP_THREADS = 2


def _inter_op_threads(asked, cpus, reasons):
    """The inter-op pool size to set (None: TensorFlow's default, which is `cpus`)."""
    if asked is None and cpus >= MIN_INTER_OP_THREADS:
        return None
    if asked is not None and asked >= MIN_INTER_OP_THREADS:
        return asked
    was = f"{asked} asked for" if asked is not None else f"TF's default {cpus} for {cpus} cpu"
    reasons.append(f"inter_op {MIN_INTER_OP_THREADS}, not {was}: one inter-op thread deadlocks a "
                   "tf.function that iterates a distributed dataset")
    return MIN_INTER_OP_THREADS


def detect_topology(local_rank=0, local_size=1, allowed=None, with_tf=True):
    """Read this node's cores (Linux sysfs), GPUs and TensorFlow build kind.

    `allowed`: the cpus to use (default: this process's affinity). `with_tf=False` counts GPUs and
    recognises OpenMP builds without importing TensorFlow (for settings applied before it loads).
    """
    cores = {}
    if allowed is None and hasattr(os, "sched_getaffinity"):
        allowed = os.sched_getaffinity(0)
    for path in sorted(glob.glob("/sys/devices/system/cpu/cpu[0-9]*/topology/core_id")):
        cpu = int(path.split("/")[5][3:])
        if allowed is not None and cpu not in allowed:
            continue
        topo = os.path.dirname(path)
        socket = int(environment.sysfs_value(os.path.join(topo, "physical_package_id"), "0"))
        core = int(environment.sysfs_value(path, str(cpu)))
        cores.setdefault((socket, core), []).append(cpu)
    if not cores:  # no sysfs: treat every usable cpu as a core
        cpus = sorted(allowed or range(os.cpu_count() or 1))
        cores = {(0, c): [c] for c in cpus}
    ids = gpu_lib.visible_ids()
    if with_tf:  # TensorFlow's count is the truth; the names are CUDA_VISIBLE_DEVICES' where they match
        count = environment.gpu_count()
        ids = ids if len(ids) == count else tuple(str(i) for i in range(count))
    return Topology(
        cores=tuple((s, c, tuple(cpus)) for (s, c), cpus in sorted(cores.items())),
        local_rank=local_rank, local_size=local_size, gpus=len(ids),
        openmp_build=environment.openmp_build(), gpu_ids=ids,
    )


_SET_BY_APPLY = set()  # variables `apply` put in the environment: tfdist's, not the user's

# Read once when TensorFlow loads and never again. (TF_NUM_*_THREADS are read at load too, but the
# thread pools can still be set through tf.config until the first op runs: `apply` does that.)
_FIXED_AT_LOAD = ("TF_ENABLE_ONEDNN_OPTS", "OMP_NUM_THREADS", "KMP_AFFINITY", "KMP_BLOCKTIME", "KMP_SETTINGS")


def plan_for_rank(local_rank, local_size, overrides=None, with_tf=True):
    """This rank's plan: its share of the node (unless the launcher bound it) and any cached choice.

    One place for what `tfdist.tuning.startup` (before TensorFlow loads) and `HorovodStrategy` (after)
    both decide; returns (plan, cached choice).
    """
    from tfdist.tuning import cache as tuning_cache

    bound = environment.externally_bound()
    topology = detect_topology(local_rank, 1 if bound else local_size, allowed=environment.node_cpus(),
                               with_tf=with_tf)
    choice = tuning_cache.choice_for(local_size)
    plan = make_plan(topology, **{**choice.get("overrides", {}), **({"pin": False} if bound else {}),
                                  **(overrides or {})})
    return plan, choice


def apply(plan):
    """Apply `plan` to this process; returns the list of settings that came too late.

    Environment variables are set where they differ; TensorFlow reads them when it loads, so
    `tfdist.tuning.startup` applies them before that. Here, after the load, only pinning and the thread
    pools (until the first op runs) can still change; what cannot is returned, not hidden.
    """
    import sys

    too_late = []
    tf_loaded = "tensorflow" in sys.modules
    for key, value in plan.env.items():
        if tf_loaded and key in (gpu_lib.VISIBLE, gpu_lib.GROWTH):
            continue  # TensorFlow has read them: tf.config below does the same while it can
        if os.environ.get(key) != value:
            if tf_loaded and key in _FIXED_AT_LOAD:
                if not (key == "TF_ENABLE_ONEDNN_OPTS" and onednn_active() == (value == "1")):
                    too_late.append(f"{key}={value}")
            os.environ[key] = value
            _SET_BY_APPLY.add(key)
    if plan.cpu_affinity and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, plan.cpu_affinity)
    import tensorflow as tf

    try:
        tf.config.threading.set_intra_op_parallelism_threads(plan.intra_op_threads)
        if plan.inter_op_threads:
            tf.config.threading.set_inter_op_parallelism_threads(plan.inter_op_threads)
    except RuntimeError:
        if tf.config.threading.get_intra_op_parallelism_threads() != plan.intra_op_threads:
            too_late.append("intra/inter-op threads")
    if plan.visible_gpu is not None:
        gpus = tf.config.list_physical_devices("GPU")
        mine = gpus[plan.visible_gpu % len(gpus)] if gpus else None
        try:
            if mine is not None and tf.config.get_visible_devices("GPU") != [mine]:
                tf.config.set_visible_devices(mine, "GPU")
            if mine is not None and os.environ.get(gpu_lib.GROWTH, "true").lower() != "false":
                tf.config.experimental.set_memory_growth(mine, True)
        except RuntimeError:  # TensorFlow already initialised its GPUs
            if tf.config.get_visible_devices("GPU") != [mine]:
                too_late.append("one visible GPU per rank")
            if not (tf.config.experimental.get_memory_growth(mine) or os.environ.get(gpu_lib.GROWTH) == "true"):
                too_late.append("GPU memory growth")
    return too_late


def in_effect():
    """What this process runs with, as TensorFlow and the OS report it (not what was asked for)."""
    import tensorflow as tf

    def pool(configured, variable):
        if configured:
            return configured
        from_env = os.environ.get(variable, "")
        return int(from_env) if from_env.isdigit() and int(from_env) > 0 else None

    cpus = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else ()
    return {"onednn": onednn_active(),
            "intra_op_threads": pool(tf.config.threading.get_intra_op_parallelism_threads(), "TF_NUM_INTRAOP_THREADS"),
            "inter_op_threads": pool(tf.config.threading.get_inter_op_parallelism_threads(), "TF_NUM_INTEROP_THREADS"),
            "cpus": cpus, "gpu": gpu_lib.in_effect(), "open_mpi": horovod_env.open_mpi_waiting()}


def describe(effect, plan=None):
    """One line from `in_effect()`: threads, cpus and oneDNN as TensorFlow has them."""
    tf_default = f"TF default ({len(effect['cpus']) or os.cpu_count()})"
    parts = [f"intra_op={effect['intra_op_threads'] or tf_default}",
             f"inter_op={effect['inter_op_threads'] or tf_default}",
             f"cpus={_ranges(effect['cpus'])}", f"oneDNN {'on' if effect['onednn'] else 'off'}"]
    if effect.get("open_mpi"):
        parts.append(f"Open MPI {effect['open_mpi']}")
    gpus = gpu_lib.describe(effect["gpu"]) if effect.get("gpu") else ""
    if gpus:
        parts.append(gpus)
    elif plan is not None and plan.visible_gpu is not None:
        parts.append(f"GPU {plan.visible_gpu}")
    return " ".join(parts)


LATE_FIX = ("import tfdist before tensorflow (first line of the script), or launch with tfdist-run, so "
            "these are set before TensorFlow loads")


def tune_this_rank(options, horovod_defaults):
    """Detect this rank's share of the node, make and apply its plan (`announce` prints it).

    The plan's settings that TensorFlow reads when it loads were applied then by `tfdist.tuning.startup`
    (if it ran). What did not take effect is kept in the plan's effect for `announce`.
    """
    from tfdist import collectives
    from tfdist.tuning import environment

    early = environment.state()
    plan, choice = plan_for_rank(collectives.local_rank(), collectives.local_size(),
                                 options if isinstance(options, dict) else {})
    reasons = list(plan.reasons)
    if choice:
        reasons.append(f"settings from {choice['source']}")
    reasons += [reason for _, reason in horovod_defaults.values()]
    ours = environment.set_by_tfdist() | _SET_BY_APPLY
    # CUDA_VISIBLE_DEVICES is the list the rank's GPU is picked from, never a choice to keep.
    users = {k: os.environ[k] for k in plan.env if k in os.environ and k not in ours and k != gpu_lib.VISIBLE}
    if users:
        reasons.append("kept your " + " ".join(f"{k}={v}" for k, v in users.items()))
    env = {k: v for k, v in plan.env.items() if k not in users}
    if "TF_NUM_INTRAOP_THREADS" in users and users["TF_NUM_INTRAOP_THREADS"].isdigit():
        plan = dataclasses.replace(plan, intra_op_threads=int(users["TF_NUM_INTRAOP_THREADS"]))
    plan = dataclasses.replace(plan, reasons=tuple(reasons),
                               env={**env, **{k: v for k, (v, _) in horovod_defaults.items()}})
    too_late = apply(plan)
    effect = {**in_effect(), "too_late": too_late,
              "route": f"set before TensorFlow loaded by {early['route']}" if early else "no early settings"}
    log.debug("tfdist tuning (rank %d): plan %s", collectives.rank(), plan.as_dict())
    return dataclasses.replace(plan, effect=effect)


def announce(plan, also=()):
    """On the chief: one line with what is in effect and why (`also`: more facts, e.g. the
    collectives' transport and the Keras policy), and a warning naming what came too late."""
    from tfdist import collectives

    if collectives.rank() != 0:
        return
    effect = plan.effect
    parts = [f"{describe(effect, plan)} ({effect['route']})", *(fact for fact in also if fact), *plan.reasons]
    print("tfdist tuning: " + "; ".join(parts), flush=True)
    if effect["too_late"]:
        log.warning("tfdist tuning: TensorFlow had loaded before these settings, so they are NOT in "
                    "effect: %s. Fix: %s.", ", ".join(effect["too_late"]), LATE_FIX)


def onednn_active():
    """Whether the loaded TensorFlow runs oneDNN kernels (on by default on some CPUs only)."""
    return _compat.onednn_enabled()


def _ranges(cpus):
    if not cpus:
        return "unpinned"
    spans, start = [], cpus[0]
    for prev, cur in zip(cpus, list(cpus[1:]) + [None]):
        if cur != prev + 1:
            spans.append(f"{start}-{prev}" if prev != start else str(start))
            start = cur
    return ",".join(spans)
