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
print(tfdist.tuning.startup.state()) # what was set, by which route, and what the user had set already
```

The local rank and rank count come from the launcher's environment (horovodrun, Open MPI,
MPICH/Intel MPI, an srun step). This module never imports TensorFlow: `tfdist-run` stays fast.

Ranks other than 0 also get `TF_CPP_MIN_LOG_LEVEL` (`quiet_log_level`) unless it is set already.
Under `python -m tfdist --` every rank's stderr goes through a filter (`tfdist.launch.stderr_filter`)
that drops TensorFlow's C++ start-up lines (rank 0's too; `TFDIST_TF_STARTUP_LINES=1` keeps them)
and applies the rank's level (that one, or yours) to the lines that escape it.
`TFDIST_QUIET_RANKS=0` leaves ranks other than 0 at TensorFlow's level, as rank 0 (see `tfdist.keras.progress`).
"""

import json
import os
import sys


from tfdist.tuning.environment import (  # noqa: F401  (part of this module's interface)
    QUIET_VARIABLE,
    STATE_VARIABLE,
    SWITCH_VARIABLE,
    _read_state,
    enabled,
    externally_bound,
    launcher_rank,
    local_layout,
    node_cpus,
    quiet_log_level,
    quiet_ranks,
    set_by_tfdist,
    startup_lines_wanted,
    state,
)


def apply_early(route):
    """Apply this rank's settings if TensorFlow has not loaded yet; returns `state()` (None: nothing done)."""
    if "tensorflow" in sys.modules or not enabled():
        return state()
    if state():
        return state()
    from tfdist.tuning import plan as tuning

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
    if launcher_rank() is not None:
        from tfdist.launch import stderr_filter

        # Every rank, rank 0 too: TensorFlow's start-up lines, and the level (quiet_log_level's, or
        # the user's) also for the lines that escape it.
        stderr_filter.start(os.environ.get("TF_CPP_MIN_LOG_LEVEL"), start_up=not startup_lines_wanted())
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
