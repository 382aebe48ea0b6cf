"""CPU time of this process's threads, by kind: where a rank's core goes besides the step.

A CPU rank's exchange runs on threads of its own (Horovod's background loop, Gloo's), on the
cores its compute uses. Their CPU time, against the compute's, says how much of a step the
exchange took from the model, which the step time alone cannot.

```python
from tfdist.benchmark import thread_cpu
before = thread_cpu.snapshot()
sum(i * i for i in range(10**6))
print(thread_cpu.describe(thread_cpu.per_step(before, thread_cpu.snapshot(), steps=1)))
```
"""

import os

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def snapshot(pid=None):
    """{thread id: (name, user s, kernel s)} of a process's threads, from /proc ({} where it has none)."""
    tasks = f"/proc/{pid or os.getpid()}/task"
    try:
        tids = os.listdir(tasks)
    except OSError:
        return {}
    threads = {}
    for tid in tids:
        try:
            with open(f"{tasks}/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread has ended
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # the name, in parentheses, may hold spaces
        threads[int(tid)] = (stat[stat.index("(") + 1 : stat.rindex(")")],
                             int(fields[11]) / _TICKS_PER_S, int(fields[12]) / _TICKS_PER_S)
    return threads


def kind(tid, name, pid=None):
    """A thread's kind: "compute" for TensorFlow's threads (named tf_*) and the main thread, which
    runs a step's ops inline; "other" for the rest (Horovod's loop, Gloo's, Python's)."""
    return "compute" if name.startswith("tf_") or tid == (pid or os.getpid()) else "other"


def per_step(before, after, steps, pid=None):
    """CPU-ms a step by kind between two snapshots of one process, with the kernel's part of each.

    A thread started between them counts from zero; one that ended before `after` is not counted.
    """
    totals = {"compute_ms": 0.0, "compute_kernel_ms": 0.0, "other_ms": 0.0, "other_kernel_ms": 0.0}
    for tid, (name, user, kernel) in after.items():
        _, user0, kernel0 = before.get(tid, (name, 0.0, 0.0))
        k = kind(tid, name, pid)
        totals[f"{k}_ms"] += (user - user0 + kernel - kernel0) * 1e3 / steps
        totals[f"{k}_kernel_ms"] += (kernel - kernel0) * 1e3 / steps
    return totals


def process_ms(before, after, steps):
    """CPU-ms a step of a whole process (every thread) between two of its snapshots."""
    return sum(user + kernel - sum(before.get(tid, (name, 0.0, 0.0))[1:])
               for tid, (name, user, kernel) in after.items()) * 1e3 / steps


def describe(cpu):
    """`per_step`'s result (and any other process's CPU-ms a step in it, by name) in one line."""
    line = (f"CPU a step: compute threads {cpu['compute_ms']:.1f} ms ({cpu['compute_kernel_ms']:.1f} in the kernel), "
            f"other threads (Horovod, Gloo, Python) {cpu['other_ms']:.1f} ms ({cpu['other_kernel_ms']:.1f} in the kernel)")
    known = ("compute_ms", "compute_kernel_ms", "other_ms", "other_kernel_ms")
    return line + "".join(f", {name} {ms:.1f} ms" for name, ms in cpu.items() if name not in known)
