"""Writes that survive a crash: flush a file's or a folder's entry to disk before relying on it.

```python
from tfdist.faults import durable
os.replace(temp, path)
durable.fsync_path(os.path.dirname(path))   # the rename itself is on disk now
```
"""

import os


def fsync_path(path):
    """fsync a file or a directory (a directory's fsync makes the renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
