"""HorovodStrategy in one process (size 1, no launcher) and the collectives' edge cases."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist import collectives
from tfdist.input_contract import check_global_batch, is_per_rank, is_sharded
from tfdist.strategy_extended import _describe_signature, _signature

from multirank.common import iterator_kinds


@pytest.fixture(scope="module")
def strategy():
    return tfdist.HorovodStrategy()


def test_single_process_without_launcher(strategy):
    assert (strategy.rank, strategy.size, strategy.is_chief) == (0, 1, True)
    assert strategy.num_replicas_in_sync == 1
    assert strategy.chief_path("/tmp/x/model.keras") == "/tmp/x/model.keras"


def test_fit_evaluate_predict_in_one_process(strategy):
    import keras

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5]], "float32")).astype("float32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    history = model.fit(x, y, batch_size=16, epochs=20, verbose=0)
    assert history.history["loss"][-1] < 0.05 * history.history["loss"][0]
    assert model.evaluate(x, y, verbose=0) < 0.05
    assert model.predict(x, verbose=0).shape == (64, 1)


def test_a_gather_of_a_variable_made_in_scope_reads_only_its_rows(strategy):
    """tf.gather on a variable made under the strategy (a MirroredVariable, as MWMS makes) is a
    ResourceGather of the rank's own component, as on a plain variable: tf-keras' sparse
    optimizers gather their slots' rows through it, and a whole read there copies the variable
    once a sparse update has touched it."""
    with strategy.scope():
        table = tf.Variable(tf.reshape(tf.range(12.0), [4, 3]))
    assert type(table).__name__ == "RankMirroredVariable"
    rows = tf.function(lambda ids: tf.gather(table, ids))
    np.testing.assert_array_equal(rows(tf.constant([2, 0])), [[6, 7, 8], [0, 1, 2]])
    ops = {op.type for op in rows.get_concrete_function(tf.constant([2, 0])).graph.get_operations()}
    assert "ResourceGather" in ops and "ReadVariableOp" not in ops, sorted(ops)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.gather(table, [1, 1, 3]))
    gradient = tape.gradient(loss, table)
    assert isinstance(gradient, tf.IndexedSlices) and gradient.indices.numpy().tolist() == [1, 1, 3]


def test_allreduce_groups_by_dtype_and_keeps_integer_dtype(strategy):
    out = collectives.allreduce(
        [tf.constant([1.5, 2.5]), tf.constant([7], tf.int64), tf.constant([3.0])], op="average"
    )
    assert out[0].dtype == tf.float32 and out[1].dtype == tf.int64
    np.testing.assert_allclose(out[0].numpy(), [1.5, 2.5])
    assert out[1].numpy().tolist() == [7]
    with pytest.raises(ValueError, match="unknown reduction 'median'"):
        collectives.allreduce([tf.constant([1.0])], op="median")


def test_one_process_collectives_are_the_identity(strategy):
    assert collectives.process_rank() == 0 and collectives.process_size() == 1
    assert collectives.broadcast_object({"a": [1, 2]}) == {"a": [1, 2]}
    assert collectives.allgather_object("x" * 5000) == ["x" * 5000]


def test_signature_round_trip():
    row = _signature([2, tf.float32.as_datatype_enum, 3, 5])
    assert _describe_signature(row[0]) == "shape (3, 5) dtype float32"


def test_shard_detection():
    assert is_sharded(tf.data.Dataset.range(8).shard(2, 0).batch(2))
    assert not is_sharded(tf.data.Dataset.range(8).batch(2))
    assert is_sharded(tf.data.Dataset.range(8).batch(2), graph=None)  # an unreadable graph: the cautious answer


def test_global_batch_that_cannot_be_split_is_named_and_uneven_one_warned():
    ds = tf.data.Dataset.range(30)
    with pytest.raises(ValueError, match="no batch dimension.*num_replicas_in_sync"):
        check_global_batch(ds, 2)
    # can be split (parts differ by one), but training weights examples unequally: a warning text
    assert "global batch of 15 does not divide evenly across 2 ranks" in check_global_batch(ds.batch(15), 2)
    assert check_global_batch(ds.batch(16), 2) is None  # a partial last batch (14) is fine: 7 + 7
    assert check_global_batch(ds.batch(15), 3) is None


def test_uneven_batch_known_only_at_run_time_is_warned_once_and_stays_checkpointable(strategy, caplog, tmp_path):
    from tfdist.input_contract import warn_uneven_global_batch

    noted = set()
    static = tf.data.Dataset.range(30).batch(15)
    assert warn_uneven_global_batch(static, 2, noted) is static  # known statically: warned now
    warn_uneven_global_batch(static, 2, noted)
    assert caplog.text.count("rank 0: a global batch of 15 does not divide evenly across 2 ranks") == 1
    # batches made inside a flat_map, as Keras' array datasets make them: size unknown until run
    dynamic = tf.data.Dataset.range(39).batch(13).flat_map(tf.data.Dataset.from_tensors)
    watched = warn_uneven_global_batch(dynamic, 2, noted)
    assert "global batch of 13" not in caplog.text
    iterator = iter(watched)
    assert next(iterator).numpy().tolist() == list(range(13))
    assert caplog.text.count("rank 0: a global batch of 13 does not divide evenly across 2 ranks") == 1
    checkpoint = tf.train.Checkpoint(iterator=iterator)  # no stateful op in the watch
    saved = checkpoint.save(str(tmp_path / "it"))
    assert next(iterator).numpy()[0] == 13
    checkpoint.restore(saved)
    assert next(iterator).numpy()[0] == 13
    assert [b.numpy().tolist() for b in watched] == [b.numpy().tolist() for b in dynamic]  # data unchanged
    assert caplog.text.count("global batch of 13") == 1  # once, however often it is iterated
    even = tf.data.Dataset.range(40).batch(16).flat_map(tf.data.Dataset.from_tensors)  # 16, 16, 8
    list(warn_uneven_global_batch(even, 2, noted))
    assert "global batch of 16" not in caplog.text and "global batch of 8" not in caplog.text


def test_reader_marks_per_rank_datasets_only(tmp_path):
    from tfdist.pipelines import read_dataset, write_arrays

    write_arrays({"id": np.arange(20, dtype=np.int64)}, tmp_path / "ds", min_shards=2)
    ctx = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=2)
    per_rank, _ = read_dataset(tmp_path / "ds", 4, input_context=ctx, training=False)
    whole, _ = read_dataset(tmp_path / "ds", 4, training=False)
    assert is_per_rank(per_rank.map(lambda e: e["id"]))  # found up the input chain
    assert not is_per_rank(whole)
    # the whole dataset is split by data, so strategies divide each global batch exactly
    assert whole.options().experimental_distribute.auto_shard_policy == tf.data.experimental.AutoShardPolicy.DATA


def test_this_horovod_build_has_no_xla_ops():
    # The bootstrap builds without xla_mpi_ops.cc; tfdist must know (and say so under jit_compile).
    assert collectives.xla_ops_available() is False


def test_arguments_are_checked_before_anything_starts():
    # A misspelt option fails at once on every rank, naming itself: before Horovod starts, the
    # tuning plan is applied or a collective runs (where another rank might wait forever).
    code = (
        "import json, os, tfdist\n"
        "bad = [dict(batch_convention='global_batch'), dict(bucket_mb=-1), dict(bucket_mb='25'), dict(op='max'),\n"
        "       dict(compression='zip'), dict(precision='fp8'), dict(tuning={'threads': 2}), dict(tuning='fast'),\n"
        "       dict(horovod={'fusion': 1}), dict(watchdog=-5), dict(fingerprint=3), dict(device=0),\n"
        "       dict(op='adasum', compression='powersgd:2')]\n"
        "errors = []\n"
        "for kwargs in bad:\n"
        "    try:\n"
        "        tfdist.HorovodStrategy(**kwargs)\n"
        "        errors.append([list(kwargs), 'accepted'])\n"
        "    except (ValueError, TypeError) as e:\n"
        "        errors.append([list(kwargs), str(e)])\n"
        "import horovod.tensorflow as hvd\n"
        "print(json.dumps({'errors': errors, 'initialized': hvd.is_initialized(),\n"
        "                  'knobs': sorted(k for k in os.environ if k.startswith('HOROVOD_'))}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["initialized"] is False and result["knobs"] == [], result
    for names, message in result["errors"]:
        assert message != "accepted", names
        assert f"{names[-1]}=" in message or f"{names[0]}=" in message, (names, message)


def test_missing_horovod_gives_install_command():
    code = (
        "import sys; sys.modules['horovod'] = None; sys.modules['horovod.tensorflow'] = None\n"
        "import tfdist\n"
        "try:\n    tfdist.HorovodStrategy()\n"
        "except tfdist.HorovodNotAvailableError as e:\n    print('ERROR:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "ERROR: tfdist needs Horovod" in out.stdout, out.stderr[-2000:]
    assert "bash scripts/bootstrap.sh" in out.stdout


def test_bad_strategy_options_are_refused_with_reasons(strategy):
    with pytest.raises(ValueError, match="op='max': HorovodStrategy supports op='average' or op='adasum'"):
        tfdist.HorovodStrategy(op="max")
    if not tfdist.collectives.horovod().mpi_built():
        with pytest.raises(ValueError, match="op='adasum'.*Gloo only"):
            tfdist.HorovodStrategy(op="adasum")
    with pytest.raises(ValueError, match="compression='zip'"):
        tfdist.HorovodStrategy(compression="zip")


def test_first_dataset_check_describes_elements_of_unknown_shape(tmp_path):
    # tf.io.parse_tensor leaves the element shape of unknown rank; the check listed its
    # dimensions and raised "Cannot iterate over a shape with unknown rank" (issue 35).
    from tfdist.faults.consistency import dataset_items

    path = str(tmp_path / "t.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        writer.write(tf.io.serialize_tensor(tf.zeros([3])).numpy())
    parsed = tf.data.TFRecordDataset(path).map(lambda r: tf.io.parse_tensor(r, tf.float32)).batch(2)
    labelled = tf.data.Dataset.zip((parsed, tf.data.Dataset.range(2).batch(2, drop_remainder=True)))
    items = dict((name, text) for name, _, text in dataset_items(labelled))
    assert items["dataset batch size"] == "2, unknown rank"
    assert "float32[unknown rank]" in items["dataset element structure (shapes without the batch dimension, dtypes)"]


def test_cpu_rank_reads_through_a_plain_iterator_with_the_same_batches(strategy, monkeypatch):
    from tfdist.input_contract import iterator_options

    per_replica = tf.distribute.InputReplicationMode.PER_REPLICA
    assert iterator_options(None, "/cpu:0").experimental_replication_mode == per_replica
    assert not iterator_options(None, "/job:localhost/replica:0/task:0/device:CPU:0").experimental_fetch_to_device
    assert iterator_options(None, "/gpu:0") is None  # a GPU rank keeps TF's copy to its device
    asked = tf.distribute.InputOptions(experimental_per_replica_buffer_size=3)
    assert iterator_options(asked, "/cpu:0").experimental_per_replica_buffer_size == 3

    dataset = tf.data.Dataset.range(10).batch(4)
    reference = tf.distribute.OneDeviceStrategy("/cpu:0").experimental_distribute_dataset(dataset)
    assert "MultiDeviceIteratorSpec" in iterator_kinds(reference)  # the probe sees TF's way
    distributed = (strategy.experimental_distribute_dataset(dataset),
                   strategy.distribute_datasets_from_function(lambda ctx: dataset))
    for each in distributed:
        assert "MultiDeviceIteratorSpec" not in iterator_kinds(each)
        assert "IteratorSpec" in iterator_kinds(each)
        assert each.element_spec == reference.element_spec
        assert [b.numpy().tolist() for b in each] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    monkeypatch.setenv("TFDIST_MULTI_DEVICE_ITERATOR", "1")  # TF's way back, for A/B comparisons
    assert "MultiDeviceIteratorSpec" in iterator_kinds(strategy.experimental_distribute_dataset(dataset))
    with pytest.raises(NotImplementedError, match="PER_REPLICA"):  # as OneDeviceStrategy: datasets_from_function only
        strategy.experimental_distribute_dataset(dataset, tf.distribute.InputOptions(experimental_replication_mode=per_replica))


def test_ranks_end_together_only_where_data_sharding_is_sure(tmp_path):
    from tfdist.input_contract import ranks_end_together

    policy = tf.data.experimental.AutoShardPolicy

    def sharded_by(dataset, shard_policy):
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = shard_policy
        return dataset.with_options(options)

    (tmp_path / "lines.txt").write_text("1\n2\n3\n")
    tensors = tf.data.Dataset.range(40).batch(16)
    lines = tf.data.TextLineDataset(str(tmp_path / "lines.txt")).batch(2)
    interleaved = tf.data.Dataset.from_tensor_slices([str(tmp_path / "lines.txt")]).interleave(
        tf.data.TextLineDataset).batch(2)  # the reader inside a function of the graph
    assert ranks_end_together(tensors)  # AUTO without files: DATA
    assert ranks_end_together(sharded_by(tensors, policy.DATA))
    assert ranks_end_together(sharded_by(lines, policy.DATA))
    assert not ranks_end_together(lines)  # AUTO on files: FILE, whose shards may differ in length
    assert not ranks_end_together(interleaved)
    assert not ranks_end_together(sharded_by(tensors, policy.FILE))
    assert not ranks_end_together(sharded_by(tensors, policy.OFF))
    assert not ranks_end_together(tf.data.Dataset.range(40).shard(2, 0).batch(16))  # per-rank data
    assert not ranks_end_together(tensors, graph=None)  # an unreadable graph keeps TF's check
