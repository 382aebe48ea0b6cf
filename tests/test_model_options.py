"""Today's models under every exchange option, 2 ranks against one process as the user wrote it
(no strategy): KerasHub's BERT classifier and GPT-2 causal LM (Keras 3; small configs built
offline) and a two-tower recommender with two Embedding(50_000, 16) tables, whose gradients are
tf.IndexedSlices beside dense ones (both flavours). One launch per flavour of
tests/multirank/model_option_checks.py trains every (model, option) pair: the default exchange,
shard_optimizer_state=True, bucket_mb=0 (one grouped allreduce), bucket_mb=1 (1 MB buckets, so
sparse and dense gradients share some), compression="bf16", and the default exchange compiled with
steps_per_execution=2 (two steps a call of the step function, against one process's one).
TensorFlow Recommenders' retrieval model (tf-keras) takes the default exchange, the sharded state and
steps_per_execution=2 against MirroredStrategy's 2 replicas in one process: its in-batch negatives
are each replica's batch under every strategy (MWMS's too), not one process's global batch; with
the candidates of every replica gathered in compute_loss (LIMITS.md's recipe) it is one process.
op="adasum" with a sparse gradient beside dense ones needs mpirun: tests/test_mpi.py."""

import importlib.util

import numpy as np
import pytest

from conftest import ROOT, flavor_env, read_results, run_job

WORKER = ROOT / "tests" / "multirank" / "model_option_checks.py"
EXACT = ("default", "sharded", "one_group", "buckets", "two_per_call")


@pytest.fixture(scope="module", params=["keras3", "tf_keras"])
def launch(request, tmp_path_factory):
    """(reference folder, 2-rank folder, {rank: facts}, reference facts) for one flavour."""
    if request.param == "keras3":
        pytest.importorskip("keras_hub", reason="KerasHub is not installed (bash scripts/bootstrap.sh installs it)")
    env = flavor_env(request.param)
    reference = tmp_path_factory.mktemp(f"options_ref_{request.param}")
    ref = run_job([WORKER, "--reference"], reference, np=None, env=env, timeout=600)[0]
    two = tmp_path_factory.mktemp(f"options_two_{request.param}")
    return reference, two, run_job([WORKER], two, np=2, env=env, timeout=900), ref, request.param


def weights(folder, name, option, rank=0):
    with np.load(folder / f"{name}.{option}.rank{rank}.npz") as saved:
        return [saved[k] for k in saved.files]


def distance(a, b):
    return float(np.sqrt(sum(np.sum((x.astype("float64") - y) ** 2) for x, y in zip(a, b, strict=True))))


@pytest.mark.multirank
def test_every_model_and_option_trains_as_one_process(launch):
    reference, two, ranks, ref, flavour = launch
    cases = {case: facts for case, facts in ranks[0].items() if "." in case}
    models = {case.split(".")[0] for case in cases}
    tfrs = {"tfrs", "tfrs_global"} if importlib.util.find_spec("tensorflow_recommenders") else set()  # bootstrap.sh installs it
    assert models == ({"bert", "gpt2", "two_tower"} if flavour == "keras3" else {"two_tower", *tfrs})
    report = []
    for case, facts in cases.items():
        name, option = case.split(".")
        want = ref[f"{name}.reference"]
        assert facts["steps"] == ranks[1][case]["steps"] == want["steps"] > 0, case
        assert facts["calls"] == want["calls"] // (2 if option == "two_per_call" else 1) > 0, case  # in effect
        mine, other, expected = weights(two, name, option), weights(two, name, option, 1), weights(reference, name, "reference")
        assert all(np.array_equal(a, b) for a, b in zip(mine, other, strict=True)), f"{case}: ranks differ"
        trained = distance(expected, weights(reference, name, "initial"))
        off = distance(mine, expected)
        report.append(f"{case} {off / trained:.1e}")
        if option in EXACT:
            for a, b in zip(mine, expected):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=case)
        else:  # bf16 gradients: rounded, so close to one process, far closer than the training moved
            assert off < 0.05 * trained, (case, off, trained)
        if option == "sharded":  # Adam's state: half on each of 2 ranks (+10%)
            assert facts["state_bytes"] <= want["state_bytes"] / 2 * 1.1, (case, facts["state_bytes"])
    print(f"\n{flavour}, distance from one process / distance trained: " + ", ".join(report))


@pytest.mark.multirank
def test_sparse_gradients_send_repeated_rows_merged_only_where_the_optimizer_merges_them(launch):
    # Rank r sends rows 1, 1, 2, 2, 2, 3 + r of value r + 1. tf-keras' optimizers sum repeated rows
    # before updating, so tf-keras' gradient sum sends them merged (3 rows a rank, padded to 4, the
    # power of two the merged count keeps its shape at); Keras 3's square each looked-up row apart
    # (Adam, Adagrad), so every entry travels. The dense sum is the same.
    _, _, ranks, _, flavour = launch
    sent = ranks[0]["repeated_rows"]
    assert sent == ranks[1]["repeated_rows"]
    assert sent["entries"] == (8 if flavour == "tf_keras" else 12), sent
    assert sent["dense"] == [[0, 0], [6, 6], [9, 9], [1, 1], [2, 2]], sent


def test_merged_rows_keep_one_shape_per_power_of_two_and_their_sum():
    """Horovod's response cache renegotiates a tensor whose shape changed; merged rows vary per
    batch, so they travel padded (zero rows at an index already there) to the next power of two,
    never beyond the unmerged count: the dense value and the set of rows touched stay."""
    import tensorflow as tf

    from tfdist.exchange.gradients import merge_repeated_rows

    def merged(ids):
        ids = tf.constant(ids, tf.int32)
        rows = tf.cast(tf.stack([ids, 10 * ids], 1), tf.float32) + 1
        value = tf.IndexedSlices(rows, ids, tf.constant([16, 2]))
        out = merge_repeated_rows(value)
        assert np.array_equal(tf.convert_to_tensor(out).numpy(), tf.convert_to_tensor(value).numpy())
        assert set(out.indices.numpy()) == set(ids.numpy())
        return out.values.shape[0]

    # 5, 6 and 7 distinct rows of 9 lookups all travel as 8; 3 distinct as 4; 9 distinct (all) as 9
    assert [merged([1, 2, 3, 4, 5, 1, 2, 3, 4]), merged([1, 2, 3, 4, 5, 6, 1, 2, 3]),
            merged([1, 2, 3, 4, 5, 6, 7, 1, 2])] == [8, 8, 8]
    assert merged([1, 1, 2, 2, 3, 3, 1, 2, 3]) == 4 and merged(list(range(9))) == 9
    assert merged([]) == 0 and merged([7, 7, 7]) == 1
    traced = tf.function(merge_repeated_rows)(tf.IndexedSlices(tf.ones([6, 2]), tf.constant([3, 3, 5, 1, 1, 7]),
                                                                tf.constant([10, 2])))
    assert traced.values.shape[0] == 4 and sorted(traced.indices.numpy()) == [1, 3, 5, 7]


def test_sparse_rows_and_ids_travel_packed_and_come_back_bit_for_bit():
    """tfdist gathers a tf.IndexedSlices' rows and ids in one allgather: each id's bits ride as
    the last columns of its row, in the rows' dtype; every dtype pair comes back exact, also ids
    whose bits read as NaN in float32 and an average's division."""
    import tensorflow as tf

    from tfdist.exchange.sparse_rows import gathered, pack, unpack

    for rows_dtype, ids_dtype, width in ((tf.float32, tf.int32, 7), (tf.float32, tf.int64, 8), (tf.bfloat16, tf.int32, 8),
                                         (tf.float16, tf.int64, 10), (tf.float64, tf.int32, 7)):
        ids = tf.constant([0, 5, 2_139_095_041, 2**31 - 1, 3], ids_dtype)  # 2_139_095_041: a float32 NaN's bits
        values = tf.cast(tf.reshape(tf.range(30, dtype=tf.float32), [5, 2, 3]) - 7.5, rows_dtype)
        value = tf.IndexedSlices(values, ids, tf.constant([2**31, 2, 3], tf.int64))
        packed = pack(value)
        assert packed.dtype == rows_dtype and packed.shape == (5, width), (rows_dtype, ids_dtype, packed.shape)
        two_ranks = tf.function(lambda rows: unpack(rows, value, divisor=2))(tf.concat([packed, packed], 0))
        assert two_ranks.indices.dtype == ids_dtype and two_ranks.indices.numpy().tolist() == ids.numpy().tolist() * 2
        halves = tf.cast(tf.concat([values, values], 0), tf.float32) / 2
        assert np.array_equal(tf.cast(two_ranks.values, tf.float32).numpy(), halves.numpy()), (rows_dtype, ids_dtype)
    one_rank = gathered([value], lambda tensors: tensors)[0]  # a gather of one rank gives the value back
    assert np.array_equal(one_rank.indices.numpy(), ids.numpy()) and np.array_equal(one_rank.values.numpy(), values.numpy())
    empty = tf.IndexedSlices(tf.zeros([0, 4]), tf.zeros([0], tf.int32), tf.constant([9, 4]))
    assert unpack(pack(empty), empty).values.shape == (0, 4)
