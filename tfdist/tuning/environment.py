"""What the launcher and this node say about this process, read without TensorFlow.

The local rank and rank count (horovodrun, Open MPI, MPICH/Intel MPI, an srun step, a TF_CONFIG
cluster), the global rank,
the switches `TFDIST_TUNING`, `TFDIST_QUIET_RANKS` and `TFDIST_TF_STARTUP_LINES`, core binding by
the launcher, and the record that `tfdist.tuning.startup` leaves of what it set before TensorFlow loaded.

```python
from tfdist.tuning import environment
local_rank, local_size = environment.local_layout()
```
"""

import json
import os

STATE_VARIABLE = "TFDIST_STARTUP"
SWITCH_VARIABLE = "TFDIST_TUNING"  # "0"/"off": no early settings (HorovodStrategy(tuning=...) still runs)
QUIET_VARIABLE = "TFDIST_QUIET_RANKS"  # "0"/"off": ranks other than 0 print as rank 0 does
STARTUP_LINES_VARIABLE = "TFDIST_TF_STARTUP_LINES"  # "1"/"on": TensorFlow's C++ start-up lines are kept
# The global rank as each launcher sets it: horovodrun, Open MPI, PMIx, MPICH/Intel MPI, srun.
_RANK_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")
_LAYOUT_VARIABLES = (
    ("HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


def launched_by_open_mpi(env=None):
    """Whether Open MPI's mpirun started this process (it sets OMPI_COMM_WORLD_SIZE before MPI_Init)."""
    env = os.environ if env is None else env
    return "OMPI_COMM_WORLD_SIZE" in env


def enabled(env=None):
    return _switch(SWITCH_VARIABLE, env)


def _switch(name, env=None):
    env = os.environ if env is None else env
    return env.get(name, "1").strip().lower() not in ("0", "off", "false", "no")


def quiet_ranks(env=None):
    """Whether ranks other than 0 stay quiet (`TFDIST_QUIET_RANKS`, on unless "0"/"off")."""
    return _switch(QUIET_VARIABLE, env)


def startup_lines_wanted(env=None):
    """Whether TensorFlow's C++ start-up lines are kept under `python -m tfdist --`
    (`TFDIST_TF_STARTUP_LINES`, off unless "1"/"on")."""
    env = os.environ if env is None else env
    return env.get(STARTUP_LINES_VARIABLE, "0").strip().lower() in ("1", "on", "true", "yes")


def launcher_rank(env=None):
    """This process's global rank as its launcher set it; None outside a launched job."""
    env = os.environ if env is None else env
    for name in _RANK_VARIABLES:
        if env.get(name, "").strip().isdigit():
            return int(env[name])
    cluster = _tf_config_cluster(env)
    return cluster.rank if cluster is not None else None


def _tf_config_cluster(env):
    """The TF_CONFIG cluster this process joins as a rank (no launcher started it), or None."""
    from tfdist.launch import tf_config

    return tf_config.peek(env)


def quiet_log_level(env=None):
    """`TF_CPP_MIN_LOG_LEVEL` for this rank, or None (rank 0, one process, or turned off).

    "2" (no INFO or WARNING lines) where an NVIDIA driver is loaded, so GPU errors still show;
    "3" on a host without one, where TensorFlow's only start-up error is the failed `cuInit`.
    """
    if not launcher_rank(env) or not quiet_ranks(env):
        return None
    return "2" if os.path.exists("/proc/driver/nvidia/version") else "3"


def local_layout(env=None):
    """(local rank, ranks on this node) from the launcher's environment; (0, 1) for one process."""
    env = os.environ if env is None else env
    for rank_name, size_name in _LAYOUT_VARIABLES:
        if rank_name in env and size_name in env:
            return int(env[rank_name]), int(env[size_name])
    if "SLURM_STEP_ID" in env and "SLURM_LOCALID" in env and "SLURM_STEP_TASKS_PER_NODE" in env:
        from tfdist.launch.slurm import expand_tasks_per_node

        counts = expand_tasks_per_node(env["SLURM_STEP_TASKS_PER_NODE"])
        node = int(env.get("SLURM_NODEID", "0"))
        return int(env["SLURM_LOCALID"]), counts[min(node, len(counts) - 1)]
    cluster = _tf_config_cluster(env)
    if cluster is not None:
        placement = cluster.placement()
        return placement["local_rank"], placement["local_size"]
    return 0, 1


def externally_bound(env=None):
    """Whether the launcher already bound this process to cores (srun --cpu-bind, mpirun --bind-to)."""
    env = os.environ if env is None else env
    slurm = env.get("SLURM_CPU_BIND_TYPE", "").strip(",").lower()
    ompi = env.get("OMPI_MCA_hwloc_base_binding_policy", "").lower()
    return bool(slurm and slurm not in ("none", "none,")) or bool(ompi and ompi != "none")


def state():
    """What the early settings did in this process, or None: {"route", "set", "kept", "layout", ...}."""
    found = _read_state()
    return found if found and found.get("pid") == os.getpid() else None


def set_by_tfdist():
    """Variables that tfdist's early settings put in the environment (here or in a parent process)."""
    return set((_read_state() or {}).get("set", {}))


def node_cpus():
    """The cpus this node lets the job use, before tfdist pinned this process to its share."""
    mine = state()
    if mine and mine.get("affinity_before"):
        return set(mine["affinity_before"])
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def _read_state():
    try:
        return json.loads(os.environ[STATE_VARIABLE])
    except (KeyError, ValueError):
        return None


def sysfs_value(path, default):
    """The text of a small system file (sysfs), or `default` where it cannot be read."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


def gpu_count():
    """The GPUs TensorFlow sees (imports TensorFlow)."""
    import tensorflow as tf

    return len(tf.config.list_physical_devices("GPU"))


def openmp_build():
    """Whether the installed TensorFlow is an OpenMP build (intel-tensorflow), without importing it."""
    import glob
    import importlib.util

    spec = importlib.util.find_spec("tensorflow")  # finds the package without importing it
    lib_dirs = list(spec.submodule_search_locations or []) if spec else []
    patterns = ("libiomp5*", "*/libiomp5*", "_solib_*/*/libiomp5*")  # not a recursive walk: it must stay fast
    return any(glob.glob(os.path.join(d, p)) for d in lib_dirs for p in patterns)
