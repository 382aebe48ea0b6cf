"""pipelines: writer round trips, manifests, exactly-once shard plans, clear errors."""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

from pipelines import ManifestError, load_manifest, plan_shards, read_dataset, write_arrays, write_image_folder


def arrays(n=103):
    rng = np.random.default_rng(3)
    return {
        "id": np.arange(n, dtype=np.int64),
        "x": rng.normal(size=(n, 4, 3)).astype("float32"),
        "label": rng.integers(0, 5, size=n).astype("int32"),
        "weight": rng.random(n).astype("float32"),
    }


def read_all(source, **kwargs):
    ds, plan = read_dataset(source, batch_size=7, training=False, **kwargs)
    out = {}
    for batch in ds:
        for k, v in batch.items():
            out.setdefault(k, []).append(v.numpy())
    return {k: np.concatenate(v) for k, v in out.items()}, plan


def test_array_round_trip_preserves_every_value(tmp_path):
    data = arrays()
    m = write_arrays(data, tmp_path / "ds", shard_bytes=2_000, min_shards=3)
    assert m.records == 103 and len(m.shards) >= 3
    got, plan = read_all(tmp_path / "ds")
    order = np.argsort(got["id"])
    for k, v in data.items():
        np.testing.assert_array_equal(got[k][order], v)
        assert got[k].dtype == v.dtype


def test_manifest_counts_sizes_and_checksums_are_exact(tmp_path):
    m = write_arrays(arrays(), tmp_path / "ds", shard_bytes=2_000, min_shards=2)
    loaded = load_manifest(str(tmp_path / "ds"))
    assert loaded == m
    for shard in loaded.shards:
        path = loaded.path(shard)
        assert sum(1 for _ in tf.data.TFRecordDataset(path)) == shard.records
        assert os.path.getsize(path) == shard.bytes
    assert sum(s.records for s in loaded.shards) == 103
    assert not [f for f in os.listdir(tmp_path / "ds") if ".tmp-" in f]


@pytest.mark.parametrize("shards,pipelines", [(4, 2), (3, 2), (1, 2), (5, 3), (2, 4), (7, 7), (6, 4)])
def test_shard_plans_cover_every_record_exactly_once(tmp_path, shards, pipelines):
    m = write_arrays(arrays(41), tmp_path / "ds", shard_bytes=1 << 30, min_shards=shards)
    assert len(m.shards) == shards
    seen = []
    for p in range(pipelines):
        plan = plan_shards(m, pipelines, p)
        assert plan.mode == ("file" if shards % pipelines == 0 else "range")
        for path, start, count in plan.segments:
            ids = [tf.io.parse_single_example(r, {"id": tf.io.FixedLenFeature([], tf.int64)})["id"].numpy()
                   for r in tf.data.TFRecordDataset(path).skip(start).take(count)]
            seen += ids
    assert sorted(seen) == list(range(41))


def test_image_folder_keeps_encoded_bytes_and_sorted_labels(tmp_path):
    root = tmp_path / "images"
    originals = {}
    for c, cls in enumerate(["zebra", "ant"]):
        (root / cls).mkdir(parents=True)
        for i in range(3):
            pixels = np.full((5, 6, 3), 40 * c + i, np.uint8)
            encoded = tf.io.encode_png(pixels).numpy()
            (root / cls / f"{i}.png").write_bytes(encoded)
            originals[encoded] = cls
    m = write_image_folder(str(root), tmp_path / "ds", min_shards=2)
    assert m.class_names == ("ant", "zebra")
    got, _ = read_all(tmp_path / "ds")
    assert len(got["image"]) == 6
    for encoded, label in zip(got["image"], got["label"]):
        assert m.class_names[label] == originals[encoded]


def test_missing_manifest_and_missing_shard_name_the_file(tmp_path):
    with pytest.raises(ManifestError, match="no manifest at .*nowhere"):
        load_manifest(str(tmp_path / "nowhere"))
    m = write_arrays(arrays(20), tmp_path / "ds", min_shards=2)
    os.remove(m.path(m.shards[1]))
    with pytest.raises(FileNotFoundError, match=m.shards[1].file):
        read_dataset(tmp_path / "ds", batch_size=4)


def test_training_mode_gives_equal_steps_and_reshuffles(tmp_path):
    write_arrays(arrays(50), tmp_path / "ds", min_shards=3)
    ds, plan = read_dataset(tmp_path / "ds", batch_size=8, training=True, seed=1)
    assert plan.steps_per_epoch == 50 // 8
    it = iter(ds)
    epoch1 = np.concatenate([next(it)["id"].numpy() for _ in range(plan.steps_per_epoch)])
    epoch2 = np.concatenate([next(it)["id"].numpy() for _ in range(plan.steps_per_epoch)])
    assert len(set(epoch1)) == len(epoch1) == 48
    assert not np.array_equal(epoch1, epoch2)
