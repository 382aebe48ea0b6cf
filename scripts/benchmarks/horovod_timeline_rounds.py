"""A step's collectives from Horovod's timeline, round by round: what waited, how long it moved.

Horovod's coordinator (rank 0) writes the timeline (`HOROVOD_TIMELINE=path`); each collective
there shows its negotiation (from the first rank's request to the last one's: the wait for the
cycle and for the slower rank) and its run (the fused buffer's copies and Gloo's transfer and sum).
Collectives that start their negotiation together are one round. For the last steps:

    python scripts/benchmarks/horovod_timeline_rounds.py timeline.json --last_ms 300

prints, per round, its start (ms, from the first shown), its tensors, the longest negotiation, and
the run's length.
"""

import argparse
import collections
import json


def read_events(path):
    text = open(path).read().rstrip().rstrip(",")   # a timeline still open has no closing bracket
    return json.loads(text if text.endswith("]") else text + "]")


def spans(events):
    """(begin us, end us, tensor name, phase) of the top-level phases (NEGOTIATE_*, ALLREDUCE, ...)."""
    names, open_spans, found = {}, collections.defaultdict(list), []
    for event in events:
        if event.get("name") == "process_name" and "name" in event.get("args", {}):
            names[event["pid"]] = event["args"]["name"]
        elif event.get("ph") == "B":
            open_spans[event["pid"]].append(event)
        elif event.get("ph") == "E" and open_spans[event["pid"]]:
            begin = open_spans[event["pid"]].pop()
            if not open_spans[event["pid"]]:
                found.append((begin["ts"], event["ts"], names.get(event["pid"], "?"), begin["name"]))
    return sorted(found)


def rounds(found, gap_us=200):
    """Negotiations that begin within `gap_us` of each other, with the runs of their tensors."""
    grouped = []
    for begin, end, tensor, phase in found:
        if phase.startswith("NEGOTIATE"):
            if grouped and begin - grouped[-1]["begin"] <= gap_us:
                grouped[-1]["tensors"].append(tensor)
                grouped[-1]["negotiated"] = max(grouped[-1]["negotiated"], end)
            else:
                grouped.append({"begin": begin, "negotiated": end, "tensors": [tensor], "ran": end})
    for begin, end, tensor, phase in found:
        if not phase.startswith("NEGOTIATE"):
            for group in grouped:
                if tensor in group["tensors"] and group["begin"] <= begin:
                    last = group
            last["ran"] = max(last["ran"], end)
    return grouped


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("timeline")
    parser.add_argument("--last_ms", type=float, default=300.0, help="show the rounds of this last stretch")
    args = parser.parse_args()
    grouped = rounds(spans(read_events(args.timeline)))
    start = grouped[-1]["begin"] - args.last_ms * 1000
    shown = [g for g in grouped if g["begin"] >= start]
    print("start ms | negotiation ms | run ms | tensors")
    for group in shown:
        tensors = sorted({t.rsplit("/", 2)[-2] if "/" in t else t for t in group["tensors"]})
        print(f"{(group['begin'] - shown[0]['begin']) / 1000:8.2f} | {(group['negotiated'] - group['begin']) / 1000:14.2f}"
              f" | {(group['ran'] - group['negotiated']) / 1000:6.2f} | {', '.join(tensors)}")


if __name__ == "__main__":
    main()
