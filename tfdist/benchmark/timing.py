"""Step timing and the throughput report of `tfdist-benchmark` (tf_cnn_benchmarks' format).

```python
from tfdist.benchmark.timing import StepTimer
timer = StepTimer()
timer.begin(); loss = train_step(); timer.end(loss)   # the loss is fetched: the step has finished
```
"""

import statistics
import time


class StepTimer:
    """Wall time of every step, the step's loss fetched so the step has really finished."""

    def __init__(self):
        self.times, self.losses, self._start = [], [], None

    def begin(self):
        self._start = time.perf_counter()

    def end(self, loss):
        self.losses.append(float(loss))
        self.times.append(time.perf_counter() - self._start)


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
