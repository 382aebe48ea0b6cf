"""Per-rank settings that TensorFlow reads when it loads, applied before it loads.

oneDNN (`TF_ENABLE_ONEDNN_OPTS`), the thread pools (`TF_NUM_INTRAOP_THREADS`,
`TF_NUM_INTEROP_THREADS`), OpenMP variables and core pinning only count if they are in place
before `import tensorflow`; set later, they silently do nothing. Three routes put them in place:

- `tfdist-run` starts every rank as `python -m tfdist -- <command>`, which applies this
  rank's settings and then executes the command (same process, so Python starts already tuned);
- `import tfdist` before `import tensorflow` applies them in the importing process;
- `tfdist-benchmark` and `tfdist-tune` import tfdist first.

```python
import tfdist                 # applies this rank's settings (TFDIST_TUNING=0 turns this off)
import tensorflow as tf
print(tfdist.startup.state()) # what was set, by which route, and what the user had set already
```

The local rank and rank count come from the launcher's environment (horovodrun, Open MPI,
MPICH/Intel MPI, an srun step). This module never imports TensorFlow: `tfdist-run` stays fast.

Ranks other than 0 also get `TF_CPP_MIN_LOG_LEVEL` (`quiet_log_level`) unless it is set already,
and under `python -m tfdist --` a filter that applies that level (or yours) to the start-up lines
that escape it (`tfdist.stderr_filter`): TensorFlow's C++ start-up lines come once, from rank 0.
`TFDIST_QUIET_RANKS=0` leaves every rank as TensorFlow has it (see `tfdist.quiet_ranks`).
"""

import json
import os
import sys

STATE_VARIABLE = "TFDIST_STARTUP"
SWITCH_VARIABLE = "TFDIST_TUNING"  # "0"/"off": no early settings (HorovodStrategy(tuning=...) still runs)
QUIET_VARIABLE = "TFDIST_QUIET_RANKS"  # "0"/"off": ranks other than 0 print as rank 0 does
# The global rank as each launcher sets it: horovodrun, Open MPI, PMIx, MPICH/Intel MPI, srun.
_RANK_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")
_LAYOUT_VARIABLES = (
    ("HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


def enabled(env=None):
    return _switch(SWITCH_VARIABLE, env)


def _switch(name, env=None):
    env = os.environ if env is None else env
    return env.get(name, "1").strip().lower() not in ("0", "off", "false", "no")


def quiet_ranks(env=None):
    """Whether ranks other than 0 stay quiet (`TFDIST_QUIET_RANKS`, on unless "0"/"off")."""
    return _switch(QUIET_VARIABLE, env)


def launcher_rank(env=None):
    """This process's global rank as its launcher set it; None outside a launched job."""
    env = os.environ if env is None else env
    for name in _RANK_VARIABLES:
        if env.get(name, "").strip().isdigit():
            return int(env[name])
    return None


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
        from tfdist.launch import expand_tasks_per_node

        counts = expand_tasks_per_node(env["SLURM_STEP_TASKS_PER_NODE"])
        node = int(env.get("SLURM_NODEID", "0"))
        return int(env["SLURM_LOCALID"]), counts[min(node, len(counts) - 1)]
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


def apply_early(route):
    """Apply this rank's settings if TensorFlow has not loaded yet; returns `state()` (None: nothing done)."""
    if "tensorflow" in sys.modules or not enabled():
        return state()
    if state():
        return state()
    from tfdist import tuning

    inherited = (_read_state() or {}).get("set", {})  # a parent tfdist process set these: ours to replace
    local_rank, local_size = local_layout()
    allowed = node_cpus()
    plan, choice = tuning.plan_for_rank(local_rank, local_size, with_tf=False)
    done, kept, previous = {}, {}, {}
    quiet = {"TF_CPP_MIN_LOG_LEVEL": quiet_log_level()} if quiet_log_level() else {}
    for key, value in {**plan.env, **quiet}.items():
        # The user's own setting wins; CUDA_VISIBLE_DEVICES is the list this rank's GPU came from.
        if key in os.environ and key not in inherited and key != "CUDA_VISIBLE_DEVICES":
            kept[key] = os.environ[key]
            continue
        previous[key] = inherited.get(key, {}).get("previous") if key in inherited else os.environ.get(key)
        os.environ[key] = value
        done[key] = {"value": value, "previous": previous[key]}
    pinned = False
    if plan.cpu_affinity and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, plan.cpu_affinity)
        pinned = True
    record = {"pid": os.getpid(), "route": route, "layout": [local_rank, local_size], "set": done,
              "kept": kept, "pinned": list(plan.cpu_affinity) if pinned else [],
              "affinity_before": sorted(allowed), "bound_by_launcher": externally_bound(),
              "cached_choice": choice.get("source"), "reasons": list(plan.reasons)}
    os.environ[STATE_VARIABLE] = json.dumps(record, separators=(",", ":"))
    return record


def undo():
    """Take back what `apply_early` did in this process (launchers call this: their children tune
    themselves). Only possible before TensorFlow loads; returns whether anything was undone."""
    mine = state()
    if not mine or "tensorflow" in sys.modules:
        return False
    for key, entry in mine["set"].items():
        if entry["previous"] is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = entry["previous"]
    if mine["pinned"] and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, mine["affinity_before"])
    os.environ.pop(STATE_VARIABLE, None)
    return True


def _read_state():
    try:
        return json.loads(os.environ[STATE_VARIABLE])
    except (KeyError, ValueError):
        return None


def main(argv=None):
    """`python -m tfdist -- command ...`: apply this rank's settings, then exec the command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("usage: python -m tfdist -- command [args ...]", file=sys.stderr)
        return 2
    if apply_early("tfdist-run") is not None:
        record = state()
        record["route"] = "tfdist-run"
        os.environ[STATE_VARIABLE] = json.dumps(record, separators=(",", ":"))
    if argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    sys.stdout.flush()
    if launcher_rank() and quiet_ranks() and os.environ.get("TF_CPP_MIN_LOG_LEVEL"):
        from tfdist import stderr_filter

        # The level (quiet_log_level's, or the user's) also for the start-up lines that escape it.
        stderr_filter.start(os.environ["TF_CPP_MIN_LOG_LEVEL"])
    try:
        os.execvp(argv[0], argv)
    except OSError as e:  # e.g. a program that is not on this host's PATH
        import socket

        rank = launcher_rank()
        who = f"rank {rank} (host {socket.gethostname()})" if rank is not None else f"host {socket.gethostname()}"
        fix = ("install it on every host, or give its full path" if isinstance(e, FileNotFoundError)
               else "make it an executable file (chmod +x), or run it through its interpreter")
        print(f"tfdist: {who}: cannot run {argv[0]!r}: {e.strerror}{'' if '/' in argv[0] else ' (not on the PATH)'}. "
              f"Fix: {fix}.", file=sys.stderr, flush=True)
        return 127


if __name__ == "__main__":
    sys.exit(main())
