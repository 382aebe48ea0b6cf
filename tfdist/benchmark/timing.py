"""Step timing and the throughput report of `tfdist-benchmark` (tf_cnn_benchmarks' format).

```python
from tfdist.benchmark.timing import StepTimer
timer = StepTimer(cpu_steps=(1, 3))   # and the process's CPU a step over steps 2 and 3
for _ in range(3):
    timer.begin(); loss = train_step(); timer.end(loss)   # the loss is fetched: the step has finished
print(timer.times, timer.thread_cpu)
```
"""

import statistics
import time

from tfdist.benchmark import thread_cpu


class StepTimer:
    """Wall time of every step, the step's loss fetched so the step has really finished.

    With `cpu_steps=(a, b)` it also takes this process's CPU a step by kind of thread
    (`thread_cpu.per_step`) from the start of step a + 1 to the end of step b, as `thread_cpu`,
    and that of each process in `processes` ({name: pid}, e.g. an emulated link's) by its name;
    `thread_cpu` stays None where /proc cannot be read. `thread_cpu_by_name` is this process's
    CPU a step by thread name (`thread_cpu.by_name`). With `steps_per_call` N (Keras'
    `steps_per_execution`, whose batch hooks fire once a call) each begin/end pair times N steps:
    the call's time and its loss count N times, the time split evenly.
    """

    def __init__(self, cpu_steps=None, processes=None, steps_per_call=1):
        self.times, self.losses, self._start, self.steps_per_call = [], [], None, steps_per_call
        self.cpu_steps, self.processes, self.thread_cpu, self._before = cpu_steps, processes or {}, None, None
        self.thread_cpu_by_name = None

    def begin(self):
        if self.cpu_steps and len(self.times) == self.cpu_steps[0]:
            self._before = self._snapshots()
        self._start = time.perf_counter()

    def end(self, loss):
        elapsed = time.perf_counter() - self._start
        self.losses.extend([float(loss)] * self.steps_per_call)
        self.times.extend([elapsed / self.steps_per_call] * self.steps_per_call)
        if self.cpu_steps and len(self.times) == self.cpu_steps[1] and self._before and self._before[None]:
            after, steps = self._snapshots(), self.cpu_steps[1] - self.cpu_steps[0]
            self.thread_cpu = thread_cpu.per_step(self._before[None], after[None], steps)
            self.thread_cpu_by_name = thread_cpu.by_name(self._before[None], after[None], steps)
            self.thread_cpu.update({name: thread_cpu.process_ms(self._before[name], after[name], steps)
                                    for name in self.processes})

    def _snapshots(self):
        return {None: thread_cpu.snapshot(), **{name: thread_cpu.snapshot(pid) for name, pid in self.processes.items()}}


def report(args, timer, global_batch, rank, unit="images", per_example=1):
    """Print tf_cnn_benchmarks' lines on rank 0 (per interval, then the total); returns the total
    examples/s. `unit` and `per_example` name what is counted (tokens: `seq_len` an example)."""
    timed = timer.times[args.num_warmup_batches:]
    speeds = [global_batch * per_example / t for t in timed]
    if rank == 0:
        for start in range(0, len(speeds), args.display_every):
            chunk = speeds[start : start + args.display_every]
            mean = statistics.mean(chunk)
            std = statistics.pstdev(chunk) if len(chunk) > 1 else 0.0
            mad = statistics.median([abs(s - statistics.median(chunk)) for s in chunk])
            print(f"{start + len(chunk)}\t{unit}/sec: {mean:.2f} +/- {std:.2f} (jitter = {mad:.2f})")
        print(f"total {unit}/sec: {len(timed) * global_batch * per_example / sum(timed):.2f}")
    return len(timed) * global_batch / sum(timed)


def accuracy_summary(args, history):
    reached = [h for h in history if args.target_accuracy and (h["test_accuracy"] or 0) >= args.target_accuracy]
    return {"epochs": history, "final_test_accuracy": history[-1]["test_accuracy"],
            "target_accuracy": args.target_accuracy,
            "seconds_to_target": round(reached[0]["seconds"], 1) if reached else None}
