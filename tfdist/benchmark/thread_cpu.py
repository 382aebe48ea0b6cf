"""CPU time of this process's threads, by kind: what the exchange takes from a rank's cores.

A CPU rank's exchange runs on threads of its own, on the cores its compute uses: Horovod's
background loop and the Gloo and MPI threads it starts, which tfdist names `hvd_exchange`
(`tfdist.launch.thread_names`; the benchmark's Horovod modes name theirs alike). Their CPU time,
against that of the rest (TensorFlow's threads, the main thread that runs a step's ops, Python's),
says how much of a step the exchange took from the model, which the step time alone cannot.

```python
from tfdist.benchmark import thread_cpu
before = thread_cpu.snapshot()
sum(i * i for i in range(10**6))
print(thread_cpu.describe(thread_cpu.per_step(before, thread_cpu.snapshot(), steps=1)))
```
"""

import os

from tfdist.launch.thread_names import EXCHANGE

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


def kind(name):
    """A thread's kind by its name: "exchange" (Horovod's threads) or "rest"."""
    return "exchange" if name == EXCHANGE else "rest"


def _spent(before, after, steps):
    """(thread id, name, CPU-ms a step, its kernel part) of each thread of `after` since `before`;
    a thread started between them counts from zero."""
    for tid, (name, user, kernel) in after.items():
        _, user0, kernel0 = before.get(tid, (name, 0.0, 0.0))
        yield tid, name, (user - user0 + kernel - kernel0) * 1e3 / steps, (kernel - kernel0) * 1e3 / steps


def per_step(before, after, steps):
    """CPU-ms a step by kind between two snapshots of one process, with the kernel's part of each,
    and how many of its threads are the exchange's ("exchange_threads").

    A thread started between them counts from zero; one that ended before `after` is not counted.
    """
    totals = {"exchange_ms": 0.0, "exchange_kernel_ms": 0.0, "rest_ms": 0.0, "rest_kernel_ms": 0.0,
              "exchange_threads": sum(kind(name) == "exchange" for name, _, _ in after.values())}
    for _, name, spent, kernel in _spent(before, after, steps):
        totals[f"{kind(name)}_ms"] += spent
        totals[f"{kind(name)}_kernel_ms"] += kernel
    return totals


def by_name(before, after, steps, pid=None):
    """CPU-ms a step of each thread name between two snapshots of process `pid` (default: this
    one), "main" for its main thread, the busiest first: which of "the rest" (tf.data's threads,
    TensorFlow's pools, the main thread's Python) a difference between two runs sits in. Threads
    that share a name are summed.
    """
    main = pid or os.getpid()  # the main thread's id is the process id
    names = {}
    for tid, name, spent, _ in _spent(before, after, steps):
        label = "main" if tid == main else name
        names[label] = names.get(label, 0.0) + spent
    return dict(sorted(names.items(), key=lambda item: -item[1]))


def process_ms(before, after, steps):
    """CPU-ms a step of a whole process (every thread) between two of its snapshots."""
    cpu = per_step(before, after, steps)
    return cpu["exchange_ms"] + cpu["rest_ms"]


def describe(cpu):
    """`per_step`'s result (and any other process's CPU-ms a step in it, by name) in one line."""
    line = (f"CPU a step: Horovod's threads {cpu['exchange_ms']:.1f} ms ({cpu['exchange_kernel_ms']:.1f} in the "
            f"kernel), the rest (TensorFlow, Python) {cpu['rest_ms']:.1f} ms ({cpu['rest_kernel_ms']:.1f} in the kernel)")
    known = ("exchange_ms", "exchange_kernel_ms", "rest_ms", "rest_kernel_ms", "exchange_threads")
    return line + "".join(f", {name} {ms:.1f} ms" for name, ms in cpu.items() if name not in known)
