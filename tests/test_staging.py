"""Node-local staging: copy once per node, reuse valid copies, repair damaged ones, fail loudly."""

import filecmp
import hashlib
import json
import logging
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ROOT, run_job
from tfdist.pipelines import ManifestError, load_manifest, write_arrays
from tfdist.pipelines.staging import FAILURE_MARKER, MARKER, StagingError, default_local_dir, stage_dataset

WORKERS = ROOT / "tests" / "multirank"


@pytest.fixture
def source(tmp_path):
    write_arrays({"id": np.arange(50, dtype=np.int64)}, tmp_path / "src", min_shards=3)
    return tmp_path / "src"


@pytest.fixture
def stats(caplog):
    """The statistics of each stage_dataset call in this test, from its log records."""
    caplog.set_level(logging.DEBUG, logger="tfdist.pipelines")
    return lambda: [r.staging for r in caplog.records if hasattr(r, "staging")]


def assert_same_files(source, local):
    src, dst = load_manifest(source), load_manifest(local)
    assert dst.directory == str(local)
    assert [(s.file, s.records, s.bytes, s.sha256) for s in dst.shards] == [
        (s.file, s.records, s.bytes, s.sha256) for s in src.shards
    ]
    assert dst.features == src.features and dst.records == src.records == 50
    for shard in src.shards:
        assert filecmp.cmp(src.path(shard), dst.path(shard), shallow=False), shard.file


def mtimes(manifest):
    return {s.file: os.stat(manifest.path(s)).st_mtime_ns for s in manifest.shards}


def flip_byte(path, offset=20):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_stage_copies_every_shard_then_reuses(source, tmp_path, stats):
    local = tmp_path / "node"
    staged = stage_dataset(source, local, local_rank=0)
    assert_same_files(source, local)
    assert staged == load_manifest(local)
    assert stats()[-1]["copied"] == 3 and stats()[-1]["bytes"] == sum(s.bytes for s in staged.shards)
    assert (local / MARKER).read_text() == hashlib.sha256((source / "manifest.json").read_bytes()).hexdigest()

    before = mtimes(staged)
    again = stage_dataset(source, local, local_rank=0)
    assert again == staged
    assert mtimes(again) == before
    last = stats()[-1]
    assert (last["copied"], last["reused"], last["bytes"]) == (0, 3, 0)


def test_waiter_returns_the_copy_staged_by_local_rank_0(source, tmp_path):
    local = tmp_path / "node"
    staged = stage_dataset(source, local, local_rank=0)
    assert stage_dataset(source, local, local_rank=1, timeout=5) == staged


@pytest.mark.parametrize("damage", ["truncate", "flip_byte"])
def test_damaged_local_shard_is_reported_and_copied_again(source, tmp_path, stats, caplog, damage):
    local = tmp_path / "node"
    staged = stage_dataset(source, local, local_rank=0)
    victim = staged.path(staged.shards[1])
    if damage == "truncate":
        os.truncate(victim, 10)
    else:
        flip_byte(victim)
    stage_dataset(source, local, local_rank=0)
    assert stats()[-1]["copied"] == 1 and stats()[-1]["reused"] == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(victim in w for w in warnings), warnings
    assert_same_files(source, local)


def test_size_only_verification_still_catches_truncation(source, tmp_path, stats):
    local = tmp_path / "node"
    staged = stage_dataset(source, local, local_rank=0, verify="size")
    os.truncate(staged.path(staged.shards[0]), 5)
    stage_dataset(source, local, local_rank=0, verify="size")
    assert stats()[-1]["copied"] == 1
    assert_same_files(source, local)
    with pytest.raises(ValueError, match="verify"):
        stage_dataset(source, local, local_rank=0, verify="md5")


def test_damaged_source_shard_raises_naming_it(source, tmp_path):
    bad = load_manifest(source).path(load_manifest(source).shards[2])
    flip_byte(bad)
    local = tmp_path / "node"
    with pytest.raises(ManifestError, match="source shard .*" + os.path.basename(bad)) as error:
        stage_dataset(source, local, local_rank=0)
    assert bad in str(error.value)
    assert not list(local.glob("*.tmp-*")) and not (local / MARKER).exists()
    assert bad in (local / FAILURE_MARKER).read_text()


def test_waiter_raises_rank_0_failure_at_once(source, tmp_path):
    bad = load_manifest(source).path(load_manifest(source).shards[0])
    os.truncate(bad, 7)
    local = tmp_path / "node"
    with pytest.raises(ManifestError):
        stage_dataset(source, local, local_rank=0)
    started = time.monotonic()
    with pytest.raises(StagingError, match="local rank 0 failed") as error:
        stage_dataset(source, local, local_rank=1, timeout=60)
    assert time.monotonic() - started < 5
    assert bad in str(error.value) and "7 bytes" in str(error.value)


def test_failure_marker_left_by_an_earlier_job_is_ignored(source, tmp_path):
    local = tmp_path / "node"
    local.mkdir()
    (local / FAILURE_MARKER).write_text("OSError: disk full (yesterday)")
    an_hour_ago = time.time() - 3600
    os.utime(local / FAILURE_MARKER, (an_hour_ago, an_hour_ago))
    with pytest.raises(TimeoutError):
        stage_dataset(source, local, local_rank=1, timeout=0.5)


def test_waiter_without_rank_0_times_out_naming_the_marker(source, tmp_path):
    local = tmp_path / "node"
    started = time.monotonic()
    with pytest.raises(TimeoutError) as error:
        stage_dataset(source, local, local_rank=1, timeout=0.6)
    assert 0.6 <= time.monotonic() - started < 5
    message = str(error.value)
    assert str(local / MARKER) in message and "does not exist" in message and str(source) in message


def test_marker_of_another_dataset_version_is_not_trusted(source, tmp_path, stats):
    local = tmp_path / "node"
    stage_dataset(source, local, local_rank=0)
    write_arrays({"id": np.arange(100, 150, dtype=np.int64)}, source, min_shards=3)  # version 2
    with pytest.raises(TimeoutError, match="another version"):
        stage_dataset(source, local, local_rank=1, timeout=0.5)
    stage_dataset(source, local, local_rank=0)
    assert stats()[-1]["copied"] == 3
    assert_same_files(source, local)


def test_local_rank_and_directory_come_from_the_environment(source, tmp_path, monkeypatch, stats):
    monkeypatch.delitem(sys.modules, "horovod.tensorflow", raising=False)  # as if Horovod never started
    for name in ("OMPI_COMM_WORLD_LOCAL_RANK", "HOROVOD_LOCAL_RANK", "TMPDIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_TMPDIR", str(tmp_path / "slurm"))
    monkeypatch.setenv("SLURM_LOCALID", "1")
    with pytest.raises(TimeoutError):
        stage_dataset(source, timeout=0.3)
    monkeypatch.setenv("SLURM_LOCALID", "0")
    staged = stage_dataset(source)
    assert stats()[-1]["copied"] == 3
    assert staged.directory == default_local_dir(source)
    assert staged.directory.startswith(str(tmp_path / "slurm" / "tfdist-stage" / "src-"))
    monkeypatch.delenv("SLURM_TMPDIR")
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    assert default_local_dir(source).startswith(str(tmp_path / "tmp" / "tfdist-stage" / "src-"))
    assert default_local_dir(source) != default_local_dir(tmp_path / "other" / "src")


def test_two_processes_without_horovod_copy_once(source, tmp_path):
    local, out = tmp_path / "node", tmp_path / "out"
    out.mkdir()
    others = ("OMPI_COMM_WORLD_LOCAL_RANK", "HOROVOD_LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in others}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT))
    command = [sys.executable, str(WORKERS / "staging_checks.py"), "--plain",
               "--source", str(source), "--local", str(local), "--out", str(out)]
    procs = [  # the waiter starts first, so it is usually polling when rank 0 begins
        subprocess.Popen(command, env={**env, "SLURM_LOCALID": rank}, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
        for rank in ("1", "0")
    ]
    for proc in procs:
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, output[-3000:]
    results = {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert results[0]["before_init"]["copied"] == 3
    assert results[1]["before_init"]["copied"] == 0 and "waited" in results[1]["before_init"]
    assert results[0]["manifest"] == results[1]["manifest"]
    assert results[0]["directory"] == results[1]["directory"] == str(local)
    assert_same_files(source, local)


@pytest.mark.multirank
def test_horovod_ranks_on_one_node_copy_once_and_read_their_shares(tmp_path):
    source, local = tmp_path / "src", tmp_path / "node"
    write_arrays({"id": np.arange(50, dtype=np.int64)}, source, min_shards=4)
    args = [WORKERS / "staging_checks.py", "--source", source, "--local", local]
    results = run_job(args, tmp_path / "out", np=2)
    before = {r: results[r]["before_init"] for r in results}
    assert sorted(s["local_rank"] for s in before.values()) == [0, 1]
    assert sorted(s["copied"] for s in before.values()) == [0, 4]  # exactly one rank copied
    for r, res in results.items():
        assert before[r]["local_rank"] == res["local_rank"]
        assert res["after_init"]["local_rank"] == res["local_rank"]  # from Horovod, not the environment
        assert res["after_init"]["copied"] == 0
        assert res["directory"] == str(local)
        assert res["manifest"] == res["manifest_after_init"] == results[0]["manifest"]
        assert res["files_read"] and all(path.startswith(str(local) + os.sep) for path in res["files_read"])
    assert_same_files(source, local)
    ids = results[0]["ids"] + results[1]["ids"]
    assert sorted(ids) == list(range(50)) and results[0]["ids"] and results[1]["ids"]
