"""Where the time went: TensorFlow op types by self time, from profiles written by ProfileSteps.

    python scripts/profile_summary.py runs/prof-1proc runs/prof-2ranks --top 15

Each argument is a profile log dir (the newest `*.xplane.pb` under it is read) or an `.xplane.pb`
file. Prints, per profile, the op types with the most self time on the host (ms per profiled
step and share of all op time), then a side-by-side table when given two or more, so a slower
configuration shows which ops it lost time in. Uses the TensorBoard profile plugin's converter
(xprof), the same data as its "framework_op_stats" page.
"""

import argparse
import glob
import json
import os
import sys


def newest_trace(path):
    if path.endswith(".xplane.pb"):
        return path
    traces = glob.glob(os.path.join(path, "**", "*.xplane.pb"), recursive=True)
    if not traces:
        sys.exit(f"no *.xplane.pb under {path}: was it written by callbacks.ProfileSteps / --profile_dir?")
    return max(traces, key=os.path.getmtime)


def op_type_self_times(trace):
    """{op type: total self time in microseconds} over the profile, host ops only."""
    from xprof.convert import raw_to_tool_data

    data, _ = raw_to_tool_data.xspace_to_tool_data([trace], "framework_op_stats", {})
    if not data:
        sys.exit(f"{trace}: the profile plugin returned no framework_op_stats")
    tables = json.loads(data)
    table = tables[0] if isinstance(tables, list) else tables
    labels = [c.get("id") or c.get("label") for c in table["cols"]]
    col = {name: labels.index(name) for name in ("type", "host_or_device", "total_self_time")}
    totals = {}
    for row in table["rows"]:
        cells = [c.get("v") if isinstance(c, dict) else c for c in row["c"]]
        if str(cells[col["host_or_device"]]).lower() not in ("host", "cpu"):
            continue
        kind = cells[col["type"]]
        totals[kind] = totals.get(kind, 0.0) + float(cells[col["total_self_time"]])
    return totals


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profiles", nargs="+")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--steps", type=int, default=3, help="steps in each profile (ProfileSteps' range)")
    args = parser.parse_args()
    names = [os.path.basename(os.path.normpath(p)) for p in args.profiles]
    stats = [op_type_self_times(newest_trace(p)) for p in args.profiles]
    order = sorted(set().union(*stats), key=lambda k: -max(s.get(k, 0) for s in stats))[: args.top]
    header = "| op type | " + " | ".join(f"{n}: ms/step (share)" for n in names) + " |"
    print(header + "\n|---|" + "---|" * len(names))
    for kind in order:
        cells = [f"{s.get(kind, 0) / 1000 / args.steps:.0f} ({s.get(kind, 0) / max(sum(s.values()), 1):.0%})"
                 for s in stats]
        print(f"| {kind} | " + " | ".join(cells) + " |")
    print("| all ops | " + " | ".join(f"{sum(s.values()) / 1000 / args.steps:.0f}" for s in stats) + " |")


if __name__ == "__main__":
    main()
