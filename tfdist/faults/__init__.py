"""What keeps a job alive, or ends it with the truth: each rank's watchdog, hang detection,
preemption, and the start-up consistency check.

- `watchdog` (with `watchdog_support`): rank 0 listens for every rank's heartbeat; a rank that
  dies or stops ends the job on every rank, naming it.
- `hang`, `hang_detector`: which collective each rank waits in; ranks in different collectives are
  named, then stopped (`TFDIST_HANG_WARN_SECONDS`, `TFDIST_HANG_TIMEOUT`).
- `preemption`: SIGTERM / SIGUSR1 agreed on by every rank, a save at one step, exit 75.
- `consistency`: versions, code, model and dataset compared across ranks before training.
- `durable`: files replaced atomically and flushed (checkpoints, manifests).

```python
import tfdist
strategy = tfdist.HorovodStrategy(watchdog=True, check_consistency=True)  # the defaults
```

docs/FAULTS.md has a page per failure.
"""
