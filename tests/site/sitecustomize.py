"""The suite's Python processes skip their last garbage collection at exit (tests/conftest.py's
make_job_env puts this folder on PYTHONPATH for every process a test starts).

With TensorFlow and Keras loaded, Python's final collection takes about a second per process on
an idle 2-core machine (8-11 s under load, against 0.7-1.5 s with it skipped), horovodrun waits
for its slowest rank, and the suite starts a few hundred such processes. What a test checks is
written before exit (rank<R>.json, logs, checkpoints); tfdist's own preempted exit skips the same
collection (tfdist.faults.preemption). Test processes only: nothing here is part of tfdist.
"""

import atexit
import gc

atexit.register(gc.freeze)
