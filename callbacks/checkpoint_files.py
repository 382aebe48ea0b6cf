"""The checkpoint directory of `Checkpointer`: atomic writes, validation, the newest good one, pruning.

A checkpoint is a folder `ckpt-<epoch>` holding `state.npz` and, written last, `complete.json`
with the state file's size and checksum. A folder without a valid marker is unfinished or
damaged, and never restored.

```python
from tfdist.callbacks.checkpoint_files import latest_checkpoint
found = latest_checkpoint("/scratch/ckpt")   # (path, marker) of the newest complete one, or None
```
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from typing import Any

import numpy as np

from tfdist.faults import durable
from tfdist.errors import TfdistError

log = logging.getLogger("tfdist")

STATE_FILE = "state.npz"
RANK_STATE = "rank_state_"  # state.npz keys of per-rank state (gradient compression), stacked by rank
MARKER_FILE = "complete.json"
_NAME = re.compile(r"ckpt-(\d+)(?:-(\d+))?")  # ckpt-<epoch>, or ckpt-<epoch>-<batches done> mid-epoch


class CheckpointError(TfdistError):
    """A checkpoint cannot be restored into this model (different variables), or saving failed."""


# --- the directory: atomic writes, validation, pruning ----------------------------------------

def checkpoint_problem(path: str, verify_data: bool = True) -> str | None:
    """Why checkpoint directory `path` is unusable (a sentence), or None when it is good.

    Args:
        path: a `ckpt-<epoch>` directory.
        verify_data: also compare the files' SHA-256 with the marker (else sizes only).

    Returns:
        The problem, or None.
    """
    marker_path = os.path.join(path, MARKER_FILE)
    try:
        with open(marker_path) as f:
            marker = json.load(f)
        epoch, files = int(marker["epoch"]), marker["files"]
    except FileNotFoundError:
        return f"no {MARKER_FILE} (the save did not finish)"
    except (ValueError, KeyError, TypeError) as e:
        return f"{MARKER_FILE} is corrupt ({type(e).__name__}: {e})"
    named = _NAME.fullmatch(os.path.basename(path))
    if named and int(named[1]) != epoch:
        return f"{MARKER_FILE} says epoch {epoch}, the directory name says {int(named[1])}"
    if named and int(named[2] or 0) != int(marker.get("batches_done", 0)):
        return (f"{MARKER_FILE} says {marker.get('batches_done', 0)} batches done, the directory name says "
                f"{int(named[2] or 0)}")
    for name, expected in files.items():
        file_path = os.path.join(path, name)
        if not os.path.exists(file_path):
            return f"{name} is missing"
        size = os.path.getsize(file_path)
        if size != expected["bytes"]:
            return f"{name} has {size} bytes, the marker says {expected['bytes']}"
        if verify_data and _sha256(file_path) != expected["sha256"]:
            return f"{name} does not match the SHA-256 in {MARKER_FILE}"
    return None


def latest_checkpoint(directory: str | os.PathLike[str]) -> tuple[str, dict[str, Any]] | None:
    """The newest good checkpoint in `directory` as (path, marker dict), or None.

    Newer directories that are unfinished or damaged are skipped with a warning naming them.

    Args:
        directory: a `Checkpointer`'s directory.

    Returns:
        The checkpoint's path and its `complete.json` (epoch, optimizer step, ranks, time,
            files), or None when there is no good checkpoint (or no directory).

    Example:
        ```python
        from tfdist.callbacks import latest_checkpoint
        found = latest_checkpoint("/scratch/run1/checkpoints")
        if found:
            path, marker = found
            print(path, marker["epoch"], marker["step"])
        ```
    """
    if not os.path.isdir(directory):
        return None
    for entry in sorted(os.listdir(directory)):
        if entry.startswith(".tmp-"):
            log.warning("tfdist checkpoint: ignoring %s: an unfinished save", os.path.join(directory, entry))
    for path in reversed(_checkpoint_dirs(directory)):
        problem = checkpoint_problem(path)
        if problem is None:
            with open(os.path.join(path, MARKER_FILE)) as f:
                return path, json.load(f)
        log.warning("tfdist checkpoint: ignoring %s: %s", path, problem)
    return None


def write_checkpoint(directory: str, epoch: int, arrays: dict[str, np.ndarray], info: dict[str, Any],
                     batches_done: int = 0) -> str:
    """Write `arrays` (name -> numpy array) as checkpoint `ckpt-<epoch>`, atomically; its path.

    Args:
        directory: the checkpoint directory (created if missing).
        epoch: the number of finished epochs; names the checkpoint.
        arrays: name -> value, saved in `state.npz`.
        info: JSON-able entries for the marker, beside `epoch` and the state file's checksum.
        batches_done: batches of epoch `epoch` already trained (a stop mid-epoch, on preemption);
            such a checkpoint is `ckpt-<epoch>-<batches_done>`.

    Returns:
        The checkpoint's path.
    """
    os.makedirs(directory, exist_ok=True)
    name = f"ckpt-{epoch:06d}" + (f"-{batches_done:06d}" if batches_done else "")
    scratch = tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=directory)
    state_path = os.path.join(scratch, STATE_FILE)
    with open(state_path, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    marker = {**info, "epoch": int(epoch), "batches_done": int(batches_done), "time": datetime.datetime.now().isoformat(timespec="seconds"),
              "files": {STATE_FILE: {"bytes": os.path.getsize(state_path), "sha256": _sha256(state_path)}}}
    with open(os.path.join(scratch, MARKER_FILE), "w") as f:
        json.dump(marker, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    durable.fsync_path(scratch)
    final = os.path.join(directory, name)
    stale = None
    if os.path.exists(final):  # a leftover of the same epoch: replaced only once the new one is in place
        stale = tempfile.mkdtemp(prefix=f".tmp-stale-{name}-", dir=directory)
        os.rename(final, os.path.join(stale, name))
    os.rename(scratch, final)
    durable.fsync_path(directory)
    if stale is not None:
        shutil.rmtree(stale)
    return final


def prune_checkpoints(directory: str, keep: int) -> None:
    """Delete all but the newest `keep` finished checkpoints, and unfinished `.tmp-*` saves.

    Args:
        directory: the checkpoint directory.
        keep: finished checkpoints to keep (0: all).
    """
    finished = [p for p in _checkpoint_dirs(directory) if checkpoint_problem(p, verify_data=False) is None]
    for path in finished[:-keep] if keep else []:
        shutil.rmtree(path, ignore_errors=True)
    for entry in os.listdir(directory):
        if entry.startswith(".tmp-"):
            shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)


def _checkpoint_dirs(directory):
    found = [(int(m[1]), int(m[2] or 0), e) for e in os.listdir(directory) if (m := _NAME.fullmatch(e))]
    return [os.path.join(directory, e) for _, _, e in sorted(found)]


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
