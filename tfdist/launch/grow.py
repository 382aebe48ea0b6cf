"""Growing back: a job that went on with fewer ranks returns to more when its hosts come back.

`tfdist-run --min-np K --max-restarts N` relaunches on fewer ranks when hosts are gone
(`tfdist.launch.recovery`). While such a job runs below `-np`, this watcher asks the host source
(the discovery script, or the Slurm allocation) again every `TFDIST_GROW_CHECK_SECONDS` (default
60). Once more ranks fit, it writes the job's control file (`TFDIST_CONTROL_FILE`, which rank 0
reads once a second): every rank stops at the end of the running epoch, the epoch's checkpoint
is saved, and the job exits 75 (`tfdist.faults.preemption`). tfdist-run then relaunches on the larger
rank count, keeping the global batch (`--global-batch`), and the job resumes from that epoch.

```python
watcher = GrowWatcher(control_file, lambda: plan_ranks(...)[0], np_now=2, log=print)
watcher.start()
...                       # the launch runs
watcher.stop()            # True: it asked the job to grow
```

Rank 0 must see the control file: it runs on tfdist-run's host (horovodrun and srun start rank 0
on the first host) or the file is on a shared file system. No TensorFlow here.
"""

import json
import os
import threading

INTERVAL_ENV = "TFDIST_GROW_CHECK_SECONDS"
DEFAULT_INTERVAL = 60.0


class GrowWatcher:
    """Polls `ranks_possible()` while a launch of `np_now` ranks runs; asks the job to grow once it
    is larger (the control file), at most once per launch."""

    def __init__(self, control_file, ranks_possible, np_now, log, interval=None):
        self.control_file, self.ranks_possible, self.np_now, self.log = control_file, ranks_possible, np_now, log
        self.interval = float(os.environ.get(INTERVAL_ENV, DEFAULT_INTERVAL) if interval is None else interval)
        self.asked = None  # the rank count the job was asked to grow to
        self._done = threading.Event()
        self._lock = threading.Lock()  # no request is written once stop() began
        self._thread = None

    def start(self):
        self._thread = threading.Thread(target=self._watch, name="tfdist-grow", daemon=True)
        self._thread.start()
        return self

    def _watch(self):
        while not self._done.wait(self.interval):
            try:
                possible = self.ranks_possible()
            except Exception as e:  # noqa: BLE001 - a failing discovery must not end the running job
                self.log(f"growing back: asking for hosts failed ({type(e).__name__}: {e}); trying again later")
                continue
            if possible > self.np_now:
                with self._lock:
                    if self._done.is_set():
                        return
                    self._ask(possible)
                return

    def _ask(self, possible):
        self.asked = possible
        why = f"tfdist-run: hosts for {possible} ranks are back (this launch has {self.np_now})"
        scratch = self.control_file + ".tmp"
        with open(scratch, "w") as f:
            json.dump({"stop": "epoch_end", "why": why, "ranks": possible}, f)
        os.replace(scratch, self.control_file)
        self.log(f"{possible} rank(s) fit again; asking the job to stop at the end of this epoch "
                 f"and relaunching on {possible}")

    def stop(self):
        """End the watch (the launch ended); clear the request so the next launch runs on. Returns
        whether the job was asked to grow."""
        with self._lock:
            self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            os.remove(self.control_file)
        except OSError:
            pass
        return self.asked is not None
