"""Where each rank's training step goes, from TensorFlow profiles: `tfdist-profile`.

    tfdist-profile runs/resnet50                              # ProfileSteps(..., ranks=(0, 1)) wrote rank0/, rank1/
    tfdist-profile runs/prof-1proc runs/prof-2ranks --top 12  # op types by self time, side by side

One log dir: per profiled rank (each `rank<R>/` under it, or the dir itself), the mean of its
marked steps: step time, compute, input wait (the step waiting on `IteratorGetNext`) and
communication wait (the step waiting on Horovod collectives), then the slowest rank and why.
In synchronous data parallelism every rank's step takes as long as the slowest rank's work,
so the straggler is the rank that spends the most of its step working (compute + input) rather
than waiting in communication: the others wait for it inside the gradient allreduce.

Two or more paths (or `--view ops`): the op types with the most self time on the host, in ms
per profiled step, side by side; a slower configuration shows which ops it lost time in.
`--by op` lists each op by its name instead, so an op that only one configuration runs (a cast,
a copy, an extra collective) shows as 0 in the others.

Each path is a profile log dir (the newest `*.xplane.pb` under each rank's dir is read) or an
`.xplane.pb` file. Both views read the profile through the TensorBoard profile plugin's
converter (xprof): its trace-viewer events and its "framework_op_stats" table.
"""

import argparse
import glob
import json
import os
import re
import sys

from tfdist.errors import TfdistError

INPUT_KERNELS = ("IteratorGetNext", "MultiDeviceIteratorGetNextFromShard")
COMM_KERNELS = ("Horovod",)
COMM_RANGES = ("tfdist_",)  # collectives.named() ranges around eager collectives


class ProfileError(TfdistError, ValueError):
    """A profile that cannot be summarised; the message names the file and what is missing."""


def newest_trace(path):
    """The newest `*.xplane.pb` under `path` (or `path` itself when it is one)."""
    if path.endswith(".xplane.pb"):
        return path
    traces = glob.glob(os.path.join(path, "**", "*.xplane.pb"), recursive=True)
    if not traces:
        raise ProfileError(f"no *.xplane.pb under {path}: was it written by callbacks.ProfileSteps / --profile_dir?")
    return max(traces, key=os.path.getmtime)


def find_profiles(path):
    """{label: xplane file}: one per `rank<R>/` under `path` (by rank), else `path`'s newest."""
    ranks = {}
    for sub in glob.glob(os.path.join(path, "rank*")):
        match = re.fullmatch(r"rank(\d+)", os.path.basename(sub))
        if match and glob.glob(os.path.join(sub, "**", "*.xplane.pb"), recursive=True):
            ranks[int(match.group(1))] = newest_trace(sub)
    if ranks:
        return {f"rank{r}": ranks[r] for r in sorted(ranks)}
    return {os.path.basename(os.path.normpath(path)): newest_trace(path)}


def trace_events(trace):
    """The complete ("X") events of the trace viewer for one `.xplane.pb`."""
    from xprof.convert import raw_to_tool_data

    data, _ = raw_to_tool_data.xspace_to_tool_data([trace], "trace_viewer", {})
    if not data:
        raise ProfileError(f"{trace}: the profile plugin returned no trace_viewer data")
    events = json.loads(data).get("traceEvents", [])
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _union_length(intervals, lo, hi):
    """Total length of the union of [a, b) intervals, clipped to [lo, hi)."""
    total, end = 0.0, lo
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if b <= max(a, end):
            continue
        total += b - max(a, end)
        end = b
    return total


def _async_intervals(events, kernel_prefixes):
    """[start, done) of asynchronous ops (Horovod's, IteratorGetNext): the executor's
    ProcessAsync::Start and ::Done events for the same op in the same step."""
    starts, dones = {}, {}
    for e in events:
        name, args = e["name"], e.get("args", {})
        if name not in ("ExecutorState::ProcessAsync::Start", "ExecutorState::ProcessAsync::Done"):
            continue
        if not str(args.get("kernel_type", "")).startswith(kernel_prefixes):
            continue
        side = starts if name.endswith("Start") else dones
        side.setdefault((args.get("step_id"), args.get("name")), []).append(e)
    intervals = []
    for key, started in starts.items():
        done = sorted(dones.get(key, []), key=lambda e: e["ts"])
        for s, d in zip(sorted(started, key=lambda e: e["ts"]), done):
            intervals.append((s["ts"], d["ts"] + d["dur"]))
    return intervals


def _op_type(name):
    return name.rsplit(":", 1)[1] if ":" in name else ""


def step_breakdown(events):
    """Mean ms per marked step: {"steps", "step", "compute", "input", "communication"} (+ per step).

    Step markers: events with a `step_num` (ProfileSteps, `step_marker`, tf-keras' own), "train"
    ones when there are any. Input wait: the step's time inside IteratorGetNext. Communication
    wait: inside Horovod ops and tfdist's named eager collectives (outside input wait). Compute:
    the rest of the step.
    """
    marked = [e for e in events if "step_num" in e.get("args", {})]
    train = [e for e in marked if e["name"].startswith("train")]
    steps = sorted(train or marked, key=lambda e: e["ts"])
    outer = []  # a marker nested in another (tf-keras' and one's own) is the same step
    for e in steps:
        if outer and e["ts"] < outer[-1]["ts"] + outer[-1]["dur"]:
            continue
        outer.append(e)
    if not outer:
        return None
    input_spans = _async_intervals(events, INPUT_KERNELS) + [
        (e["ts"], e["ts"] + e["dur"]) for e in events
        if e["name"].startswith(INPUT_KERNELS) or _op_type(e["name"]).startswith(INPUT_KERNELS)]
    comm_spans = _async_intervals(events, COMM_KERNELS) + [
        (e["ts"], e["ts"] + e["dur"]) for e in events
        if e["name"].startswith(COMM_RANGES) or _op_type(e["name"]).startswith(COMM_KERNELS)]
    per_step = []
    for e in outer:
        lo, hi = e["ts"], e["ts"] + e["dur"]
        waiting = _union_length(input_spans, lo, hi)
        both = _union_length(input_spans + comm_spans, lo, hi)
        per_step.append({"step": int(e["args"]["step_num"]), "step_ms": e["dur"] / 1000,
                         "input_ms": waiting / 1000, "communication_ms": (both - waiting) / 1000,
                         "compute_ms": (e["dur"] - both) / 1000})
    mean = {key: sum(s[f"{key}_ms"] for s in per_step) / len(per_step)
            for key in ("step", "compute", "input", "communication")}
    return {"steps": len(per_step), **mean, "per_step": per_step}


def straggler(breakdowns):
    """(label, sentence) for the rank the others wait for, or (None, sentence) when none stands out.

    The straggler works longest per step (step time minus communication wait); its cause is
    whichever of input wait and compute exceeds the other ranks' mean the most.
    """
    ranks = {k: b for k, b in breakdowns.items() if b}
    if not ranks:
        return None, "no step markers: nothing to compare"
    if len(ranks) == 1:
        (label, b), = ranks.items()
        part = max(("compute", "input", "communication"), key=lambda k: b[k])
        return None, f"one rank profiled ({label}): most of its step is {_part_name(part)} ({b[part]:.1f} ms)"
    busy = {k: b["step"] - b["communication"] for k, b in ranks.items()}
    slow = max(busy, key=busy.get)
    others = [b for k, b in ranks.items() if k != slow]
    excess = {part: ranks[slow][part] - sum(b[part] for b in others) / len(others) for part in ("input", "compute")}
    margin = busy[slow] - max(v for k, v in busy.items() if k != slow)
    if margin < max(1.0, 0.05 * ranks[slow]["step"]):
        return None, (f"no straggler: the ranks' working time per step is within {margin:.1f} ms "
                      f"of each other")
    cause = max(excess, key=excess.get)
    waited = max(b["communication"] for b in others)
    mean_others = sum(b[cause] for b in others) / len(others)
    if cause == "input":
        why = (f"input: it waits {ranks[slow]['input']:.1f} ms/step for its input pipeline "
               f"(the other ranks {mean_others:.1f} ms)")
    else:
        why = (f"compute: it computes {ranks[slow]['compute']:.1f} ms/step "
               f"(the other ranks {mean_others:.1f} ms)")
    return slow, f"{why}, and the other ranks wait up to {waited:.1f} ms/step for it in communication"


def _part_name(part):
    return {"compute": "compute", "input": "input wait", "communication": "communication wait"}[part]


def print_steps(path, out=sys.stdout):
    """Print `path`'s per-rank step table and its slowest rank; returns {label: breakdown}."""
    profiles = find_profiles(path)
    breakdowns = {label: step_breakdown(trace_events(trace)) for label, trace in profiles.items()}
    print(f"{path}: {len(profiles)} profile(s); ms per step, mean over the marked steps", file=out)
    print("| rank | steps | step | compute | input wait | communication wait |", file=out)
    print("|---|---|---|---|---|---|", file=out)
    for label, b in breakdowns.items():
        if b is None:
            print(f"| {label} | no step markers ({profiles[label]}: profiled without ProfileSteps or "
                  "step_marker?) | | | | |", file=out)
            continue
        print(f"| {label} | {b['steps']} | {b['step']:.1f} | {b['compute']:.1f} | {b['input']:.1f} | "
              f"{b['communication']:.1f} |", file=out)
    slow, why = straggler(breakdowns)
    print(f"slowest rank: {slow}, {why}" if slow else why, file=out)
    return breakdowns


GROUPS = {"type": "type", "op": "operation"}  # --by: the framework_op_stats column to group by


def _ms(value):
    """ms per step as the ops view prints it: two decimals under 1 ms, where short steps differ."""
    return f"{value:.2f}" if abs(value) < 1 else f"{value:.1f}"


def op_type_self_times(trace, by="type"):
    """{op type (or op name, by="op"): total self time in microseconds} over the profile, host ops only."""
    from xprof.convert import raw_to_tool_data

    data, _ = raw_to_tool_data.xspace_to_tool_data([trace], "framework_op_stats", {})
    if not data:
        raise ProfileError(f"{trace}: the profile plugin returned no framework_op_stats")
    tables = json.loads(data)
    table = tables[0] if isinstance(tables, list) else tables
    labels = [c.get("id") or c.get("label") for c in table["cols"]]
    col = {name: labels.index(name) for name in (GROUPS[by], "host_or_device", "total_self_time")}
    totals = {}
    for row in table["rows"]:
        cells = [c.get("v") if isinstance(c, dict) else c for c in row["c"]]
        if str(cells[col["host_or_device"]]).lower() not in ("host", "cpu"):
            continue
        kind = cells[col[GROUPS[by]]]
        totals[kind] = totals.get(kind, 0.0) + float(cells[col["total_self_time"]])
    return totals


def print_ops(paths, top=15, steps=None, out=sys.stdout, by="type"):
    """Print the op types (or ops, by="op") with the most self time, ms per step (share), a column per path."""
    names = [os.path.basename(os.path.normpath(p)) for p in paths]
    traces = [newest_trace(p) for p in paths]
    stats = [op_type_self_times(t, by) for t in traces]
    if steps is None:
        counted = [step_breakdown(trace_events(t)) for t in traces]
        per_step = [b["steps"] if b else 3 for b in counted]
    else:
        per_step = [steps] * len(paths)
    order = sorted(set().union(*stats), key=lambda k: -max(s.get(k, 0) for s in stats))[:top]
    print(f"| {'op type' if by == 'type' else 'op'} | " + " | ".join(f"{n}: ms/step (share)" for n in names) + " |",
          file=out)
    print("|---|" + "---|" * len(names), file=out)
    for kind in order:
        cells = [f"{_ms(s.get(kind, 0) / 1000 / n)} ({s.get(kind, 0) / max(sum(s.values()), 1):.0%})"
                 for s, n in zip(stats, per_step)]
        print(f"| {kind} | " + " | ".join(cells) + " |", file=out)
    print("| all ops | " + " | ".join(_ms(sum(s.values()) / 1000 / n) for s, n in zip(stats, per_step))
          + " |", file=out)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="tfdist-profile", description=__doc__.splitlines()[0],
                                     allow_abbrev=False)
    parser.add_argument("profiles", nargs="+", help="profile log dirs (rank<R>/ under each) or .xplane.pb files")
    parser.add_argument("--view", choices=("auto", "steps", "ops"), default="auto",
                        help="steps: per-rank step breakdown; ops: op types side by side "
                             "(auto: steps for one path, ops for several)")
    parser.add_argument("--top", type=int, default=15, help="op types (or ops) to show (ops view)")
    parser.add_argument("--by", choices=tuple(GROUPS), default="type",
                        help="ops view: group self time by op type, or list each op by its name")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps in each profile, for the ops view (default: the marked steps, else 3)")
    args = parser.parse_args(argv)
    view = args.view if args.view != "auto" else ("steps" if len(args.profiles) == 1 else "ops")
    try:
        if view == "ops":
            print_ops(args.profiles, args.top, args.steps, by=args.by)
        else:
            for path in args.profiles:
                print_steps(path)
    except ProfileError as e:
        sys.exit(f"tfdist-profile: {e}")


if __name__ == "__main__":
    main()
