"""Copy a dataset's shards from shared storage to node-local disk, once per node, before training.

```python
from tfdist.pipelines import read_dataset
from tfdist.pipelines.staging import stage_dataset
local = stage_dataset("/project/def-me/digits")   # every rank; -> $SLURM_TMPDIR/tfdist-stage/digits-<hash>
ds, plan = read_dataset(local.directory, batch_size=32, input_context=ctx, training=True)
```

Local rank 0 copies each shard under a temporary name, checks its size (and SHA-256 with
`verify="checksum"`) against the source manifest, and renames it into place; then it writes the
local manifest and, last, a completion marker holding the SHA-256 of the source manifest. The other
local ranks poll for that marker, so staging needs no Horovod and works before `hvd.init()`. When
rank 0 fails it leaves a failure marker with its error, which the waiters raise at once.

A valid earlier copy is reused: nothing is copied when the marker matches the source manifest and
every shard has the right size (and checksum). A damaged local shard is reported and copied again;
a source shard that disagrees with its manifest raises `ManifestError` naming it.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import logging
import os
import shutil
import sys
import time
from typing import TYPE_CHECKING

from tfdist.errors import TfdistError
from tfdist.pipelines import manifest as manifest_lib
from tfdist.units import MB

if TYPE_CHECKING:
    from tfdist.pipelines.manifest import Manifest

log = logging.getLogger("tfdist.pipelines")

VERIFY_MODES = ("checksum", "size")
MARKER = ".tfdist-staged"
FAILURE_MARKER = ".tfdist-staging-failed"
LOCK_FILE = ".tfdist-staging.lock"
LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "HOROVOD_LOCAL_RANK")
POLL_SECONDS = 0.2
# Waiters believe a failure marker only if it was written at most this long before they started:
# a marker left by an earlier job must not fail this one before this job's rank 0 removes it.
FAILURE_MAX_AGE_S = 60
CHUNK = 8 << 20


class StagingError(TfdistError):
    """Local rank 0 failed to stage the dataset (raised on the local ranks waiting for it)."""


def stage_dataset(source: str | os.PathLike[str], local_dir: str | os.PathLike[str] | None = None, *,
                  local_rank: int | None = None, timeout: float = 600, verify: str = "checksum") -> Manifest:
    """Stage the dataset in directory `source` into node-local `local_dir`; return the local `Manifest`.

    Call it on every rank (local rank 0 copies, the others wait up to `timeout` seconds).

    Args:
        source: the dataset directory (with manifest.json) on shared storage.
        local_dir: where the copy goes; default: `default_local_dir(source)`.
        local_rank: this process's rank on its node; default: Horovod's when Horovod is
            initialised, else `$OMPI_COMM_WORLD_LOCAL_RANK`, `$SLURM_LOCALID`,
            `$HOROVOD_LOCAL_RANK`, else 0.
        timeout: seconds to wait for the lock (local rank 0) or for local rank 0's copy (the others).
        verify: "checksum" compares each shard's SHA-256 with the manifest; "size" skips
            checksums: faster, but a damaged byte goes unnoticed.

    Returns:
        The manifest of the local copy.

    Raises:
        ValueError: `verify` is unknown, or `local_dir` is `source`.
        ManifestError: the source manifest is missing or malformed, or a source shard
            disagrees with it.
        StagingError: local rank 0 failed (raised on the other local ranks).
        TimeoutError: the copy or the lock was not ready within `timeout` seconds.

    Example:
        ```python
        from tfdist.pipelines import read_dataset, stage_dataset
        local = stage_dataset("/project/def-me/digits")   # on every rank
        ds, plan = read_dataset(local.directory, batch_size=32, training=True)
        ```
    """
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify={verify!r}; expected one of {VERIFY_MODES}")
    source = os.path.abspath(source)
    local_dir = os.path.abspath(local_dir or default_local_dir(source))
    if local_dir == source:
        raise ValueError(f"local_dir is the source directory {source}; stage into another directory")
    if local_rank is None:
        local_rank = _detect_local_rank()
    if local_rank == 0:
        _stage(source, local_dir, verify, timeout)
    else:
        _wait(source, local_dir, local_rank, timeout)
    return manifest_lib.load(local_dir)


def default_local_dir(source: str | os.PathLike[str]) -> str:
    """`$SLURM_TMPDIR/tfdist-stage/<name>-<hash of the source path>`; `$TMPDIR` or /tmp off Slurm.

    Args:
        source: the dataset directory on shared storage.

    Returns:
        The node-local directory `stage_dataset` copies it to by default.
    """
    source = os.path.abspath(source)
    base = os.environ.get("SLURM_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    digest = hashlib.sha256(source.encode()).hexdigest()[:10]
    return os.path.join(base, "tfdist-stage", f"{os.path.basename(source)}-{digest}")


def _detect_local_rank():
    # Horovod cannot be initialised without having been imported, so look, don't import.
    if "horovod.tensorflow" in sys.modules:
        from tfdist import collectives

        if collectives.is_initialized():
            return collectives.local_rank()
    for name in LOCAL_RANK_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value:
            return int(value)
    return 0


def _stage(source, local_dir, verify, timeout):
    os.makedirs(local_dir, exist_ok=True)
    # Two jobs on one node may stage into the same default directory: one copies at a time.
    with _exclusive_lock(os.path.join(local_dir, LOCK_FILE), timeout):
        try:
            stats = _copy_dataset(source, local_dir, verify)
        except BaseException as e:
            failure = os.path.join(local_dir, FAILURE_MARKER)
            with contextlib.suppress(OSError):  # keep rank 0's own error if the disk is the problem
                manifest_lib.atomic_write_text(failure, f"{type(e).__name__}: {e}")
            raise
    total = stats["copied"] + stats["reused"]
    if stats["copied"]:
        mb, seconds = stats["bytes"] / MB, stats["seconds"]
        log.info(
            "staged %s into %s: copied %d of %d shards (%.3g MB in %.2f s, %.3g MB/s)",
            source, local_dir, stats["copied"], total, mb, seconds, mb / max(seconds, 1e-9),
            extra={"staging": stats},
        )
    else:
        log.info("reused the staged copy of %s in %s (%d shards, verified by %s)",
                 source, local_dir, total, verify, extra={"staging": stats})


def _copy_dataset(source, local_dir, verify):
    src = manifest_lib.load(source)
    source_manifest = os.path.join(source, manifest_lib.FILENAME)
    digest = manifest_lib.sha256_of(source_manifest)
    marker = os.path.join(local_dir, MARKER)
    trusted = _read(marker) == digest
    _remove(marker)
    _remove(os.path.join(local_dir, FAILURE_MARKER))
    previous = _listed_files(local_dir)
    targets = [_inside(local_dir, shard.file) for shard in src.shards]
    for folder in {local_dir, *map(os.path.dirname, targets)}:
        for stale in glob.glob(os.path.join(folder, "*.tmp-*")):  # from an interrupted staging
            _remove(stale)

    started, copied, copied_bytes = time.monotonic(), 0, 0
    for shard, target in zip(src.shards, targets):
        problem = _local_problem(target, shard, verify, trusted)
        if problem is None:
            continue
        if problem:
            (log.warning if trusted else log.info)("%s; copying it again from %s", problem, src.path(shard))
        _copy_shard(src.path(shard), target, shard, verify, source_manifest)
        copied, copied_bytes = copied + 1, copied_bytes + shard.bytes
    seconds = time.monotonic() - started

    for gone in previous - {shard.file for shard in src.shards}:  # shards of an older version
        _remove(_inside(local_dir, gone))
    manifest_lib.Manifest(local_dir, src.features, src.shards, src.class_names).save()
    manifest_lib.atomic_write_text(marker, digest)
    return {"local_rank": 0, "copied": copied, "reused": len(src.shards) - copied,
            "bytes": copied_bytes, "seconds": seconds}


def _local_problem(path, shard, verify, trusted):
    """None when the local copy can be kept, else why not ("" when there is no copy)."""
    size = _size(path)
    if size is None:
        return ""
    if size != shard.bytes:
        return f"local shard {path} has {size} bytes, the manifest says {shard.bytes}"
    if verify == "checksum":
        actual = manifest_lib.sha256_of(path)
        if actual != shard.sha256:
            return f"local shard {path} has sha256 {actual[:16]}..., the manifest says {shard.sha256[:16]}..."
        return None
    return None if trusted else ""  # sizes alone cannot tell versions apart


def _copy_shard(source_path, target, shard, verify, source_manifest):
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = f"{target}.tmp-{os.getpid()}"
    try:
        if verify == "checksum":
            digest = hashlib.sha256()
            with open(source_path, "rb") as src, open(tmp, "wb") as dst:
                while block := src.read(CHUNK):
                    digest.update(block)
                    dst.write(block)
            actual = digest.hexdigest()
        else:
            shutil.copyfile(source_path, tmp)
            actual = shard.sha256
        size = os.path.getsize(tmp)
        if size != shard.bytes or actual != shard.sha256:
            found = f"{size} bytes" if size != shard.bytes else f"sha256 {actual}"
            wanted = f"{shard.bytes} bytes" if size != shard.bytes else f"sha256 {shard.sha256}"
            raise manifest_lib.ManifestError(
                f"source shard {source_path} has {found}, but {source_manifest} says {wanted}: "
                f"the source is damaged or changed after its manifest was written; rewrite the dataset"
            )
        os.replace(tmp, target)
    except BaseException:
        _remove(tmp)
        raise


def _wait(source, local_dir, local_rank, timeout):
    manifest_lib.load(source)  # a missing or broken source fails here too, not after the timeout
    digest = manifest_lib.sha256_of(os.path.join(source, manifest_lib.FILENAME))
    marker, failure = os.path.join(local_dir, MARKER), os.path.join(local_dir, FAILURE_MARKER)
    started_wall, started = time.time(), time.monotonic()
    while True:
        message = _recent_failure(failure, started_wall - FAILURE_MAX_AGE_S)
        if message is not None:
            raise StagingError(f"local rank 0 failed to stage {source} into {local_dir}: {message}")
        waiting_for = _not_ready(local_dir, marker, digest)
        if waiting_for is None:
            break
        if time.monotonic() - started >= timeout:
            raise TimeoutError(
                f"local rank {local_rank} waited {timeout} s for local rank 0 to stage {source} into "
                f"{local_dir}, for a completion marker {marker} matching the source manifest, but "
                f"{waiting_for}. Does local rank 0 call stage_dataset with the same source and local_dir?"
            )
        time.sleep(POLL_SECONDS)
    waited = time.monotonic() - started
    log.debug("local rank %d: using %s, staged by local rank 0 (waited %.1f s)", local_rank, local_dir,
              waited, extra={"staging": {"local_rank": local_rank, "copied": 0, "waited": waited}})


def _not_ready(local_dir, marker, digest):
    """None when rank 0 has finished staging this version of the dataset, else what is missing."""
    content = _read(marker)
    if content is None:
        return "the marker does not exist"
    if content != digest:
        return (f"the marker is for another version of the dataset (source manifest sha256 "
                f"{digest[:16]}..., marker {content[:16]}...)")
    try:
        local = manifest_lib.load(local_dir)
    except manifest_lib.ManifestError as e:
        return f"the local manifest is unusable: {e}"
    for shard in local.shards:  # cheap check; rank 0 may be replacing a damaged shard
        size = _size(local.path(shard))
        if size != shard.bytes:
            return f"{local.path(shard)} has {size} bytes instead of {shard.bytes}"
    return None


@contextlib.contextmanager
def _exclusive_lock(path, timeout):
    started = time.monotonic()
    with open(path, "a") as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - started >= timeout:
                    raise TimeoutError(
                        f"waited {timeout} s for the lock {path}, held by another process staging "
                        f"into the same directory"
                    ) from None
                time.sleep(POLL_SECONDS)
        yield  # closing the file releases the lock


def _listed_files(local_dir):
    try:
        return {shard.file for shard in manifest_lib.load(local_dir).shards}
    except manifest_lib.ManifestError:
        return set()


def _inside(local_dir, relative):
    path = os.path.normpath(os.path.join(local_dir, relative))
    if os.path.commonpath([local_dir, path]) != local_dir:
        raise manifest_lib.ManifestError(f"shard path {relative!r} points outside {local_dir}")
    return path


def _recent_failure(path, not_before):
    try:
        if os.stat(path).st_mtime < not_before:
            return None
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def _size(path):
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return None


def _remove(path):
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
