"""Read a Horovod timeline and print, per step, whether the gradient allreduces overlapped backprop.

    .venv/bin/python scripts/benchmarks/multihost/timeline_overlap.py timeline.json --compute_ms 1650

A Horovod timeline (HOROVOD_TIMELINE, written by rank 0) has one row per collective, named after
it (tfdist's: `tfdist_allreduce_<k>/HorovodGroupedAllreduce.float32_<i>of<n>`), with, per
execution, NEGOTIATE_ALLREDUCE (from the first rank's request to the last one's: a collective is
requested once its input exists on that rank) and ALLREDUCE with the Gloo transfer inside
(GLOO_ALLREDUCE). The k-th execution of every gradient row belongs to step k. Per step:

- start: the end of the previous step's last allreduce (the next forward pass starts right after
  the update), the first step excluded;
- first_transfer: when the first Gloo transfer of the step began, after `start`;
- last_request: when the last bucket was requested (NEGOTIATE begins; Horovod's background loop
  notes requests once per cycle, and not while it runs a transfer, so this is an upper bound);
- overlap: the transfer time (union of Gloo intervals) before last_request, and whether the first
  transfer began before the last bucket was requested. With `--compute_ms` (one rank's step alone),
  also how long before the end of this rank's compute the first transfer began.
"""

import argparse
import gzip
import json
import re
import statistics
import sys

# Horovod's loop: ..._gradient_tape_..._BiasAddGrad; tfdist: tfdist_allreduce_<k>/..., tfdist_powersgd_*
GRADIENT_ROW = re.compile(r"allreduce.*grad|tfdist_allreduce|tfdist_powersgd", re.I)
NOT_GRADIENTS = ("metric_sync", "broadcast", "allgather")


def load(path):
    """The events of a timeline file (or .gz), also one Horovod has not closed (it is written as it goes)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        text = f.read().strip().rstrip(",")
    if not text.endswith("]"):
        text += "]"
    return json.loads(text)


def executions(events):
    """{row name: [{negotiate: (b, e), ticks: {rank: ts}, allreduce: (b, e), gloo: [(b, e)]}, ...]}."""
    names = {e["pid"]: e["args"].get("name") for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    rows = {}
    for pid, name in names.items():
        if not name or not GRADIENT_ROW.search(name) or any(s in name.lower() for s in NOT_GRADIENTS):
            continue
        stack, done = [], []
        for e in sorted((e for e in events if e.get("pid") == pid and e.get("ph") in "BEX"), key=lambda e: e["ts"]):
            if e["ph"] == "B":
                stack.append((e["name"], e["ts"]))
                if e["name"] == "NEGOTIATE_ALLREDUCE":
                    done.append({"ticks": {}, "gloo": []})
            elif e["ph"] == "X" and done:
                done[-1]["ticks"][int(e["name"])] = e["ts"]
            elif e["ph"] == "E" and stack:
                what, begin = stack.pop()
                if not done:
                    continue
                if what == "NEGOTIATE_ALLREDUCE":
                    done[-1]["negotiate"] = (begin, e["ts"])
                elif what == "ALLREDUCE":
                    done[-1]["allreduce"] = (begin, e["ts"])
                elif what.startswith("GLOO_"):
                    done[-1]["gloo"].append((begin, e["ts"]))
        rows[name] = [d for d in done if "negotiate" in d and "allreduce" in d]
    return {k: v for k, v in rows.items() if v}


def _union_before(intervals, limit):
    total, end = 0, None
    for b, e in sorted(intervals):
        b, e = b, min(e, limit)
        if e <= b:
            continue
        if end is not None and b < end:
            b = end
        if e > b:
            total += e - b
            end = e
    return total


def analyse(path, compute_ms=None):
    """Per-step overlap numbers (ms) and their medians; raises ValueError if there is nothing to read."""
    rows = executions(load(path))
    if not rows:
        raise ValueError(f"{path}: no gradient allreduce rows in this Horovod timeline")
    count = min(len(v) for v in rows.values())
    buckets = sorted({name.split("/")[0] for name in rows})
    steps = []
    for k in range(1, count):
        ops = [v[k] for v in rows.values()]
        start = max(v[k - 1]["allreduce"][1] for v in rows.values())
        gloo = [iv for op in ops for iv in op["gloo"]]
        first = min(b for b, _ in gloo)
        last_request = max(op["negotiate"][0] for op in ops)
        end = max(op["allreduce"][1] for op in ops)
        step = {"step": k + 1, "first_transfer_ms": (first - start) / 1e3,
                "last_request_ms": (last_request - start) / 1e3, "end_ms": (end - start) / 1e3,
                "transfer_ms": _union_before(gloo, float("inf")) / 1e3,
                "transfer_before_last_request_ms": _union_before(gloo, last_request) / 1e3,
                "transfers": len(set(gloo)), "overlaps": first < last_request}
        if compute_ms:
            step["first_transfer_before_compute_end_ms"] = compute_ms - step["first_transfer_ms"]
        step["groups"] = {}  # per allreduce group (bucket): requested, transfer begins, done (ms into the step)
        for group in buckets:
            mine = [v[k] for name, v in rows.items() if name.split("/")[0] == group]
            step["groups"][group] = [round((min(op["negotiate"][0] for op in mine) - start) / 1e3, 1),
                                     round((min(b for op in mine for b, _ in op["gloo"]) - start) / 1e3, 1),
                                     round((max(op["allreduce"][1] for op in mine) - start) / 1e3, 1)]
        steps.append(step)
    if not steps:
        raise ValueError(f"{path}: fewer than 2 steps of gradient allreduces")
    keys = [k for k in steps[0] if k.endswith("_ms") or k == "transfers"]
    return {"file": path, "rows": len(rows), "buckets": buckets, "compute_ms": compute_ms, "steps": steps,
            "median": {k: statistics.median(s[k] for s in steps) for k in keys},
            "steps_overlapping": sum(s["overlaps"] for s in steps)}


def describe(found):
    m = found["median"]
    lines = [f"{found['file']}: {len(found['buckets'])} allreduce groups ({found['rows']} rows), "
             f"{len(found['steps'])} steps after the first; times from the end of the previous step's collectives "
             f"(medians): first transfer at {m['first_transfer_ms']:.1f} ms, last bucket requested at "
             f"{m['last_request_ms']:.1f} ms, collectives done at {m['end_ms']:.1f} ms; {m['transfers']:.0f} Gloo "
             f"transfers, {m['transfer_ms']:.1f} ms of transfer, {m['transfer_before_last_request_ms']:.1f} ms of it "
             f"before the last bucket was requested; overlapping steps: {found['steps_overlapping']} of "
             f"{len(found['steps'])}"]
    if found.get("compute_ms"):
        lines.append(f"one rank's whole step alone is {found['compute_ms']:.1f} ms: the first transfer began "
                     f"{m['first_transfer_before_compute_end_ms']:.1f} ms before this rank's compute could have ended")
    return "\n".join(lines)


def compare(found):
    """Lines comparing each bucketed timeline with the one-collective one ({mode: analyse() result})."""
    one = found.get("one-collective")
    if not one:
        return []
    wait = one["median"]["first_transfer_ms"]  # its only collective waits for the last gradient
    lines = []
    for name, f in found.items():
        if name.startswith("bucketed"):
            first = f["median"]["first_transfer_ms"]
            lines.append(f"{name}: first transfer {first:.1f} ms into the step; one-collective's (after the "
                         f"last gradient) {wait:.1f} ms: transfers began {wait - first:.1f} ms before backprop "
                         f"ended, {f['median']['transfer_before_last_request_ms']:.1f} ms of transfer before "
                         "the last bucket was requested")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("timeline")
    parser.add_argument("--compute_ms", type=float, help="one rank's step alone (the 1-rank baseline)")
    parser.add_argument("--steps", action="store_true", help="print every step")
    args = parser.parse_args(argv)
    found = analyse(args.timeline, args.compute_ms)
    print(describe(found))
    if args.steps:
        for s in found["steps"]:
            print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in s.items() if k != "groups"}))
            for group, (asked, begins, done) in s["groups"].items():
                print(f"    {group}: requested {asked} ms, transfer from {begins} ms, done {done} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
