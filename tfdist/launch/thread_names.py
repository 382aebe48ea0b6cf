"""Names for the threads Horovod starts, so `top -H`, `perf` and `thread_cpu` can tell them apart.

On Linux a new thread takes its name (`/proc/<pid>/task/<tid>/comm`, 15 characters) from the
thread that starts it. Horovod's background loop starts inside `hvd.init()`, and Gloo's and MPI's
threads are started by that loop, so naming the calling thread for that one call names all of
them, and only them: TensorFlow's threads and Python's keep their own names. Elsewhere, or where
the name cannot be set, the block runs unchanged.

```python
import horovod.tensorflow as hvd
from tfdist.launch import thread_names
with thread_names.started_as(thread_names.EXCHANGE):
    hvd.init()
```
"""

import contextlib
import ctypes
import sys

EXCHANGE = "hvd_exchange"  # Horovod's background loop and the Gloo and MPI threads it starts
_PR_SET_NAME, _PR_GET_NAME = 15, 16


@contextlib.contextmanager
def started_as(name):
    """Threads started inside the block (and the threads they start) are named `name`."""
    prctl = _prctl()
    before = ctypes.create_string_buffer(16)
    if prctl is None or prctl(_PR_GET_NAME, before, 0, 0, 0) != 0:
        yield
        return
    prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    try:
        yield
    finally:
        prctl(_PR_SET_NAME, before.value, 0, 0, 0)


def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).prctl
    except (OSError, AttributeError):
        return None
