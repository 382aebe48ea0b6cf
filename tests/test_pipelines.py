"""pipelines: writer round trips, manifests, exactly-once shard plans, clear errors."""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

from tfdist.pipelines import ManifestError, load_manifest, plan_shards, read_dataset, write_arrays, write_image_folder
from tfdist.pipelines.reader import explain_record


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


def corrupt_byte(path, record_index, records):
    data = bytearray(open(path, "rb").read())
    data[len(data) // records * record_index + 20] ^= 0xFF  # inside the record's payload
    open(path, "wb").write(bytes(data))


def rewrite_manifest(directory, **changes):
    path = os.path.join(directory, "manifest.json")
    data = json.load(open(path))
    for name, spec in changes.items():
        data["features"][name] = spec
    json.dump(data, open(path, "w"))


def test_empty_pattern_and_truncated_shard_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no TFRecord files match .*nothing-"):
        read_dataset(str(tmp_path / "nothing-*.tfrecord"), batch_size=2)
    m = write_arrays(arrays(20), tmp_path / "ds", min_shards=2)
    path = m.path(m.shards[1])
    with open(path, "r+b") as f:
        f.truncate(m.shards[1].bytes - 10)
    with pytest.raises(ManifestError, match=f"shard {path} has .* bytes but the manifest says"):
        read_dataset(tmp_path / "ds", batch_size=2)


def test_file_pattern_without_manifest_counts_records(tmp_path):
    write_arrays({"id": np.arange(30, dtype=np.int64)}, tmp_path / "ds", min_shards=3)
    got, plan = read_all(str(tmp_path / "ds" / "*.tfrecord"))
    assert plan.records == 30 and sorted(got["id"].tolist()) == list(range(30))


def test_corrupt_record_names_shard_and_record(tmp_path):
    m = write_arrays({"id": np.arange(20, dtype=np.int64)}, tmp_path / "ds", min_shards=2)
    path = m.path(m.shards[0])
    corrupt_byte(path, 5, m.shards[0].records)
    with pytest.raises(tf.errors.InvalidArgumentError, match=rf"shard .*{m.shards[0].file}.*: records from 5 on could not be read or parsed \(5 of 10 read\)"):
        read_all(tmp_path / "ds")
    assert "record 5 is unreadable" in explain_record(str(tmp_path / "ds"), path, 5)


def test_missing_feature_and_wrong_shape_are_named(tmp_path):
    m = write_arrays(arrays(12), tmp_path / "ds", min_shards=1)
    rewrite_manifest(tmp_path / "ds", extra={"dtype": "int64", "shape": [], "encoding": "int64"})
    with pytest.raises(tf.errors.InvalidArgumentError, match=r'record 0: feature .*"extra.* is missing'):
        read_all(tmp_path / "ds")
    assert "feature 'extra'" in explain_record(str(tmp_path / "ds"), m.path(m.shards[0]), 0)

    m = write_arrays(arrays(12), tmp_path / "ds2", min_shards=1)
    rewrite_manifest(tmp_path / "ds2", x={"dtype": "float32", "shape": [4, 2], "encoding": "raw"})
    with pytest.raises(tf.errors.InvalidArgumentError, match=r'record 0: feature .*"x.* does not match'):
        read_all(tmp_path / "ds2")
    assert "feature 'x'" in explain_record(str(tmp_path / "ds2"), m.path(m.shards[0]), 0)


def test_skip_corrupt_counts_per_shard(tmp_path):
    m = write_arrays({"id": np.arange(40, dtype=np.int64)}, tmp_path / "ds", min_shards=2)
    corrupt_byte(m.path(m.shards[1]), 15, m.shards[1].records)  # records 15..19 of shard 1 are lost
    got, plan = read_all(tmp_path / "ds", skip_corrupt=True)
    assert len(got["id"]) == 35
    assert plan.skipped.report() == {m.path(m.shards[1]): 5}
    plan.skipped.reset()
    assert plan.skipped.report() == {}


def test_undecodable_image_names_the_file(tmp_path):
    (tmp_path / "img" / "cat").mkdir(parents=True)
    (tmp_path / "img" / "cat" / "ok.png").write_bytes(tf.io.encode_png(np.zeros((4, 4, 3), np.uint8)).numpy())
    (tmp_path / "img" / "cat" / "broken.jpg").write_bytes(b"\xff\xd8\xff not really a jpeg")
    with pytest.raises(ValueError, match=r"image .*broken\.jpg cannot be decoded"):
        write_image_folder(str(tmp_path / "img"), tmp_path / "ds")


def test_cli_converts_npz_and_validate_finds_the_bad_shard(tmp_path, capsys):
    from tfdist.pipelines.cli import main

    np.savez(tmp_path / "d.npz", x=np.arange(60, dtype=np.float32).reshape(30, 2), y=np.arange(30))
    assert main(["convert", str(tmp_path / "d.npz"), str(tmp_path / "ds"), "--min-shards", "3"]) == 0
    assert "wrote 30 records in 3 shards" in capsys.readouterr().out
    assert main(["validate", str(tmp_path / "ds"), "--checksum"]) == 0
    m = load_manifest(str(tmp_path / "ds"))
    corrupt_byte(m.path(m.shards[2]), 4, m.shards[2].records)
    assert main(["validate", str(tmp_path / "ds")]) == 1
    out = capsys.readouterr().out
    assert f"BAD  {m.path(m.shards[2])}: 6 of 10 records unreadable" in out and "record 4" in out


def test_cli_validate_takes_a_glob_as_the_reader_does_and_names_a_directory_without_manifest(tmp_path, capsys):
    from tfdist.pipelines.cli import main

    m = write_arrays({"id": np.arange(30, dtype=np.int64)}, tmp_path / "ds", min_shards=3)
    os.remove(tmp_path / "ds" / "manifest.json")  # TFRecord files written elsewhere: no manifest
    assert main(["validate", str(tmp_path / "ds" / "*.tfrecord"), "--checksum"]) == 0
    out = capsys.readouterr().out
    assert out.count("ok   ") == 3 and "3 of 3 shards ok" in out and "no SHA-256 to compare" in out
    corrupt_byte(m.path(m.shards[1]), 4, m.shards[1].records)
    assert main(["validate", str(tmp_path / "ds" / "*.tfrecord")]) == 1
    out = capsys.readouterr().out  # counted file by file: the damaged one is named, the others still checked
    assert f"BAD  {m.path(m.shards[1])}: records from 4 on cannot be read" in out and "2 of 3 shards ok" in out
    # a directory without a manifest, an empty glob, a missing path: one line naming it, no traceback
    for source, expect in ((tmp_path / "ds", f"{tmp_path / 'ds'} has no manifest.json"),
                           (tmp_path / "ds" / "*.npz", "no TFRecord files match"),
                           (tmp_path / "nowhere", f"{tmp_path / 'nowhere'} does not exist")):
        assert main(["validate", str(source)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("tfdist-data validate: ") and expect in err and "Traceback" not in err
        if source == tmp_path / "ds":  # and says what to do: convert, or validate its files by a glob
            assert "tfdist-data convert" in err and f"'{tmp_path / 'ds' / '*.tfrecord'}'" in err


def test_skipped_records_report_logs_each_epoch_and_resets(tmp_path, caplog):
    import keras

    from tfdist.callbacks import SkippedRecordsReport

    m = write_arrays({"x": np.ones((40, 2), np.float32), "y": np.zeros(40, np.float32)}, tmp_path / "ds", min_shards=2)
    corrupt_byte(m.path(m.shards[0]), 10, m.shards[0].records)  # 10 of shard 0's 20 records lost
    # one full pass per epoch (training=False), so each epoch meets the corrupt record once
    ds, plan = read_dataset(tmp_path / "ds", batch_size=5, training=False, skip_corrupt=True)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    history = model.fit(ds.map(lambda e: (e["x"], e["y"])), epochs=2, verbose=0,
                        callbacks=[SkippedRecordsReport(plan.skipped)])
    assert history.history["skipped_records"] == [10, 10]
    assert f"skipped 10 corrupt record(s) in {m.path(m.shards[0])}" in caplog.text


def test_feature_of_another_type_names_the_records(tmp_path):
    m = write_arrays({"id": np.arange(10, dtype=np.int64)}, tmp_path / "ds", min_shards=1)
    rewrite_manifest(tmp_path / "ds", id={"dtype": "string", "shape": [], "encoding": "bytes"})
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"records from 0 on could not be read or parsed \(0 of 10 read\)"):
        read_all(tmp_path / "ds")
    assert "feature 'id'" in explain_record(str(tmp_path / "ds"), m.path(m.shards[0]), 3)
    got, plan = read_all(tmp_path / "ds", skip_corrupt=True)
    assert got == {} and plan.skipped.report() == {m.path(m.shards[0]): 10}


def test_skip_corrupt_drops_only_the_bad_records(tmp_path):
    from tfdist.pipelines import manifest as manifest_lib
    from tfdist.pipelines.writer import infer_spec, serialize

    good = {"id": np.int64(0), "x": np.zeros(3, np.float32)}
    specs = infer_spec(good)
    path = tmp_path / "ds" / "mixed.tfrecord"
    path.parent.mkdir()
    with tf.io.TFRecordWriter(str(path)) as w:
        for i in range(70):  # records 3 and 66 lack "x": one in each parse block
            example = {"id": np.int64(i), "x": np.full(3, i, np.float32)}
            if i in (3, 66):
                example = {"id": np.int64(i)}
                w.write(serialize(example, {"id": specs["id"]}))
            else:
                w.write(serialize(example, specs))
    shard = manifest_lib.Shard("mixed.tfrecord", 70, os.path.getsize(path), "")
    manifest_lib.Manifest(str(tmp_path / "ds"), specs, (shard,)).save()
    got, plan = read_all(tmp_path / "ds", skip_corrupt=True)
    assert sorted(got["id"].tolist()) == [i for i in range(70) if i not in (3, 66)]
    np.testing.assert_array_equal(got["x"][:, 0], got["id"].astype(np.float32))
    assert plan.skipped.report() == {str(path): 2}
    with pytest.raises(tf.errors.InvalidArgumentError, match=r'record 3: feature .*"x.* is missing'):
        read_all(tmp_path / "ds")


def write_with_bad_records(directory, n=60, bad=range(3, 60, 6)):
    """One shard of `n` records, ids 0..n-1; those in `bad` lack feature "x" (unparsable)."""
    from tfdist.pipelines import manifest as manifest_lib
    from tfdist.pipelines.writer import infer_spec, serialize

    specs = infer_spec({"id": np.int64(0), "x": np.zeros(3, np.float32)})
    path = directory / "mixed.tfrecord"
    directory.mkdir()
    with tf.io.TFRecordWriter(str(path)) as w:
        for i in range(n):
            if i in bad:
                w.write(serialize({"id": np.int64(i)}, {"id": specs["id"]}))
            else:
                w.write(serialize({"id": np.int64(i), "x": np.full(3, i, np.float32)}, specs))
    shard = manifest_lib.Shard("mixed.tfrecord", n, os.path.getsize(path), "")
    manifest_lib.Manifest(str(directory), specs, (shard,)).save()
    return str(path)


def training_epochs(source, batch_size, pipelines, epochs=2):
    """Per epoch: the ids each of `pipelines` training pipelines reads in `steps_per_epoch` steps,
    and what their `plan.skipped` report after it (reset between epochs, as the callback does)."""
    plans, iterators = [], []
    for p in range(pipelines):
        context = tf.distribute.InputContext(pipelines, p, pipelines) if pipelines > 1 else None
        ds, plan = read_dataset(source, batch_size, input_context=context, training=True,
                                skip_corrupt=True, seed=3, shuffle_buffer=16)
        plans.append(plan)
        iterators.append(iter(ds))
    assert len({plan.steps_per_epoch for plan in plans}) == 1  # every step is a collective
    out = []
    for _ in range(epochs):
        ids = [np.concatenate([next(it)["id"].numpy() for _ in range(plans[0].steps_per_epoch)]).tolist()
               for it in iterators]
        out.append((ids, [plan.skipped.report() for plan in plans]))
        for plan in plans:
            plan.skipped.reset()
    return plans, out


@pytest.mark.parametrize("pipelines", [1, 2])
def test_skip_corrupt_training_epochs_hold_every_good_record_once(tmp_path, pipelines):
    path = write_with_bad_records(tmp_path / "ds")  # 60 records, 10 of them bad: 3, 9, ..., 57
    good = [i for i in range(60) if i not in range(3, 60, 6)]
    plans, epochs = training_epochs(tmp_path / "ds", 5, pipelines)
    # steps from the 50 good records (25 per pipeline with 2: records 0-29 and 30-59, 5 bad each)
    assert plans[0].steps_per_epoch == 50 // 5 // pipelines
    assert [plan.good_records for plan in plans] == [50 // pipelines] * pipelines
    assert {plan.mode for plan in plans} == {"file" if pipelines == 1 else "range"}
    for ids, reports in epochs:
        assert sorted(sum(ids, [])) == good  # each good record once, nothing from the next epoch
        assert sum(sum(r.values()) for r in reports) == 10  # this epoch's drops, not cumulative
        assert all(set(r) == {path} for r in reports)
    assert epochs[0][0] != epochs[1][0]  # reshuffled


@pytest.mark.parametrize("pipelines", [1, 2])
def test_skip_corrupt_training_with_corrupt_tails(tmp_path, pipelines):
    m = write_arrays({"id": np.arange(120, dtype=np.int64)}, tmp_path / "ds", shard_bytes=1 << 30, min_shards=2)
    for shard in m.shards:  # a corrupt record 50 makes records 50-59 of each shard unreadable
        corrupt_byte(m.path(shard), 50, shard.records)
    good, _ = read_all(tmp_path / "ds", skip_corrupt=True)
    assert len(good["id"]) == 100
    plans, epochs = training_epochs(tmp_path / "ds", 5, pipelines)
    assert plans[0].steps_per_epoch == 100 // 5 // pipelines
    for ids, reports in epochs:
        assert sorted(sum(ids, [])) == sorted(good["id"].tolist())
        assert [sum(r.values()) for r in reports] == [20 // pipelines] * pipelines


def test_skip_corrupt_training_takes_the_smallest_share_and_never_repeats(tmp_path):
    m = write_arrays({"id": np.arange(60, dtype=np.int64)}, tmp_path / "ds", shard_bytes=1 << 30, min_shards=2)
    corrupt_byte(m.path(m.shards[1]), 12, m.shards[1].records)  # shard 1: 12 of its 30 readable
    plans, epochs = training_epochs(tmp_path / "ds", 4, 2)
    assert [plan.good_records for plan in plans] == [30, 12] and plans[0].steps_per_epoch == 3
    for ids, reports in epochs:
        assert len(ids[0]) == len(set(ids[0])) == 12  # 12 of pipeline 0's 30, a new draw each epoch
        assert sorted(ids[1]) == list(range(1, 24, 2))  # all 12 readable records of shard 1
        assert reports == [{}, {m.path(m.shards[1]): 18}]


def test_skip_corrupt_training_report_and_keras_logs_per_epoch(tmp_path, caplog):
    import keras

    from tfdist.callbacks import SkippedRecordsReport

    path = write_with_bad_records(tmp_path / "ds")
    ds, plan = read_dataset(tmp_path / "ds", 5, training=True, skip_corrupt=True)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    history = model.fit(ds.map(lambda e: (e["x"], e["x"][:, :1])), epochs=3, steps_per_epoch=plan.steps_per_epoch,
                        verbose=0, callbacks=[SkippedRecordsReport(plan.skipped)])
    assert plan.steps_per_epoch == 10 and history.history["skipped_records"] == [10, 10, 10]
    assert caplog.text.count(f"skipped 10 corrupt record(s) in {path}") == 3


def test_skip_corrupt_training_fails_if_a_file_changes_after_counting(tmp_path):
    m = write_arrays({"id": np.arange(40, dtype=np.int64)}, tmp_path / "ds", min_shards=1)
    ds, plan = read_dataset(tmp_path / "ds", 4, training=True, skip_corrupt=True)
    assert plan.steps_per_epoch == 10 and plan.skipped.report() == {}
    corrupt_byte(m.path(m.shards[0]), 30, 40)  # same size: only the next pass can tell
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"records 0 to 39 held 0 bad record\(s\) when counted before training but 10 on this pass"):
        for _ in ds.take(plan.steps_per_epoch):
            pass
