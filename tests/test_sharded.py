"""`HorovodStrategy(shard_optimizer_state=True)`: 2 and 4 ranks equal one process, with 1/N of the state.

Keras 3, three launches of tests/multirank/sharded_checks.py: 4 ranks (a few optimizers, then
every kind of save), 2 ranks (every case, then each 4-rank save resumed on 2 ranks), and one plain
process (every case, and the 4-rank `model.keras` loaded by `keras.models.load_model`). tf-keras,
two: 2 ranks (every case, every save) and one plain process (every case, the 2-rank saves loaded
and resumed there). Every rank's
weights must equal one process's within 1e-5, every optimizer with state must hold it in slices
(its slots are sharded, and Adam's state bytes are at most 1/N of one process's + 10%), and the
clips must matter (the unclipped reference differs by more than 0.01). The sparse cases' embedding
(50 rows: cut between rows on 2 ranks, flat on 4) travels as its changed rows under plain SGD,
Adagrad and an Adam that asks for them (one rows allgather each in the step's graph), and every
rank must still equal one process.
"""

import shutil

import numpy as np
import pytest

from conftest import ROOT, flavor_env, run_job

WORKER = ROOT / "tests" / "multirank" / "sharded_checks.py"
ENV = flavor_env("keras3")
ROW_LOCAL = ("sparse_sgd", "sparse_adagrad", "sparse_adam_changed_rows")  # their tables send changed rows


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded-4")
    return out, run_job([WORKER, "--part", "train", "--part", "save"], out, np=4, env=ENV, timeout=900)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, four_ranks):
    saved = tmp_path_factory.mktemp("sharded-saved")
    shutil.copytree(four_ranks[0], saved, dirs_exist_ok=True)  # resuming writes there too
    out = tmp_path_factory.mktemp("sharded-2")
    return run_job([WORKER, "--part", "train", "--part", "resume", "--saved", saved], out, np=2, env=ENV, timeout=900)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, four_ranks):
    out = tmp_path_factory.mktemp("sharded-reference")
    return run_job([WORKER, "--reference", "--saved", four_ranks[0]], out, np=None, env=ENV, timeout=900)[0]


@pytest.fixture(scope="module")
def tf_keras_two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded-tf-keras-2")
    return out, run_job([WORKER, "--part", "train", "--part", "save"], out, np=2, env=flavor_env("tf_keras"),
                        timeout=900)


@pytest.fixture(scope="module")
def tf_keras_reference(tmp_path_factory, tf_keras_two_ranks):
    saved = tmp_path_factory.mktemp("sharded-tf-keras-saved")
    shutil.copytree(tf_keras_two_ranks[0], saved, dirs_exist_ok=True)
    out = tmp_path_factory.mktemp("sharded-tf-keras-reference")
    return run_job([WORKER, "--reference", "--saved", saved, "--part", "resume"], out, np=None,
                   env=flavor_env("tf_keras"), timeout=900)[0]


def _largest_difference(a, b):
    return max(float(np.max(np.abs(np.array(x) - np.array(y)))) for x, y in zip(a, b))


@pytest.mark.parametrize("flavor,ranks", [("keras3", 2), ("keras3", 4), ("tf_keras", 2)])
def test_every_case_equals_one_process_with_sharded_state(flavor, ranks, request):
    if flavor == "tf_keras":
        results, reference = request.getfixturevalue("tf_keras_two_ranks")[1], request.getfixturevalue("tf_keras_reference")
    else:
        results = request.getfixturevalue("two_ranks") if ranks == 2 else request.getfixturevalue("four_ranks")[1]
        reference = request.getfixturevalue("reference")
    worst = {}
    for case, first in results[0]["cases"].items():
        want = reference["cases"][case]
        for rank in range(ranks):
            got = results[rank]["cases"][case]
            for mine, expected in zip(got["weights"], want["weights"]):
                np.testing.assert_allclose(mine, expected, atol=1e-5, err_msg=f"{case}, rank {rank} of {ranks}")
            if want["bytes"] > 12:  # the optimizer has per-variable state: it is held in slices
                assert got["sharded_slots"] > 0, f"{case}: no sharded slot on rank {rank}"
            if not got["whole_slots"] and want["bytes"] > 12:  # (accumulators and EMA averages stay whole)
                assert got["bytes"] <= want["bytes"] / ranks * 1.1, (case, rank, got["bytes"], want["bytes"])
        worst[case] = _largest_difference(first["weights"], want["weights"])
        row_local = sum(name in ROW_LOCAL for name in results[0]["cases"])  # cases sharing the sparse step
        assert first.get("rows_gathers_in_step", 0) == (row_local if case.startswith("sparse_") else 0), (
            f"{case}: each row-local optimizer's embedding must send its changed rows (one allgather each)")
    assert "adam" in worst and "sparse_adam" in worst and "sparse_sgd" in worst and (
        ranks == 4 or "lars" in worst and "sparse_lars" in worst)
    assert flavor != "tf_keras" or "sparse_adam_own_deduplication" in worst  # a subclass's own summing followed
    print(f"\n{flavor}, {ranks} ranks, largest difference from one process: "
          + ", ".join(f"{case} {value:.1e}" for case, value in worst.items()))


def test_the_clips_matter(reference, tf_keras_reference):
    for results in (reference, tf_keras_reference):
        for case, unclipped in results["unclipped"].items():
            assert _largest_difference(results["cases"][case]["weights"], unclipped["weights"]) > 1e-2, case


def test_sparse_gradients_matter(reference, tf_keras_reference):
    """Keras 3's Adam on the embedding's tf.IndexedSlices (repeated ids' squares apart) is not
    Adam on its densified gradient, in one process: the sharded cases must follow the sparse one.
    tf-keras sums repeated ids first, so there both are one update (and the sharded step must sum
    every rank's rows)."""
    densified = reference["densified"]["sparse_adam"]["weights"]
    assert _largest_difference(reference["cases"]["sparse_adam"]["weights"], densified) > 1e-2
    densified = tf_keras_reference["densified"]["sparse_adam"]["weights"]
    assert _largest_difference(tf_keras_reference["cases"]["sparse_adam"]["weights"], densified) < 1e-6


@pytest.mark.parametrize("flavor", ["keras3", "tf_keras"])
def test_an_overflow_in_one_ranks_slice_skips_the_step_on_every_rank(flavor, request):
    if flavor == "tf_keras":
        results, reference = request.getfixturevalue("tf_keras_two_ranks")[1], request.getfixturevalue("tf_keras_reference")
    else:
        results, reference = request.getfixturevalue("two_ranks"), request.getfixturevalue("reference")
    want = reference["loss_scale_skip"]
    assert want["scale"] < 32768  # the step was skipped (the scale halved) in one process
    for rank, result in results.items():
        got = result["loss_scale_skip"]
        assert got["scale"] == want["scale"], rank
        for mine, expected in zip(got["weights"], want["weights"]):
            np.testing.assert_allclose(mine, expected, atol=1e-5, err_msg=f"rank {rank}")


def test_an_optimizer_it_cannot_shard_is_refused_by_name(two_ranks, four_ranks, tf_keras_two_ranks):
    for results in (two_ranks, four_ranks[1], tf_keras_two_ranks[1]):
        for result in results.values():
            message = result["refusals"]["adafactor"]
            assert "Adafactor" in message and "shard_optimizer_state" in message, message
    for result in tf_keras_two_ranks[1].values():
        assert "use_ema=True" in result["refusals"]["tf_keras_ema"], result["refusals"]


def test_a_job_saved_sharded_on_4_ranks_resumes_on_2_and_loads_in_one_process(two_ranks, four_ranks, reference):
    saves = reference["saves"]
    assert saves["shapes_equal"] and saves["state_changed"] > 1e-3
    assert saves["loaded_state_difference"] < 1e-5  # one process reads the whole state the 4 ranks saved
    for rank in range(4):
        assert four_ranks[1][rank]["save"]["bytes"] <= saves["bytes"] / 4 * 1.1
    for rank, result in two_ranks.items():
        for how, weights in result["resume"]["weights"].items():
            assert result["resume"]["batches"][how] == 4, (how, result["resume"]["batches"])  # one epoch: resumed
            for mine, expected in zip(weights, saves["weights"]):
                np.testing.assert_allclose(mine, expected, atol=1e-5, err_msg=f"{how}, rank {rank}")


def test_tf_keras_saved_sharded_on_2_ranks_loads_and_resumes_in_one_process(tf_keras_two_ranks, tf_keras_reference):
    saves = tf_keras_reference["saves"]
    assert saves["shapes_equal"] and saves["state_changed"] > 1e-3
    assert saves["loaded_state_difference"] < 1e-5
    for rank in range(2):
        assert tf_keras_two_ranks[1][rank]["save"]["bytes"] <= saves["bytes"] / 2 * 1.1
    resumed = saves["resumed"]
    for how, weights in resumed["weights"].items():
        assert resumed["batches"][how] == 4, (how, resumed["batches"])
        for mine, expected in zip(weights, saves["weights"]):
            np.testing.assert_allclose(mine, expected, atol=1e-5, err_msg=how)


def test_combinations_it_cannot_make_exact_are_refused_before_start():
    from tfdist.strategy_options import StrategyOptions

    for kwargs in ({"op": "adasum"}, {"compression": "powersgd:2"}, {"compression": "topk:0.01"}):
        with pytest.raises(ValueError, match="shard_optimizer_state=True"):
            StrategyOptions.from_arguments(shard_optimizer_state=True, **kwargs)
    assert StrategyOptions.from_arguments(shard_optimizer_state=True, compression="fp16").shard_optimizer_state
    with pytest.raises(TypeError, match="shard_optimizer_state"):
        StrategyOptions.from_arguments(shard_optimizer_state="yes")


def test_the_partition_covers_every_element_once():
    from tfdist.exchange import shard_plan

    for elements in (1, 7, 10, 64, 1001):
        for ranks in (1, 2, 3, 4, 8):
            ranges = [shard_plan.owned_range(elements, ranks, r) for r in range(ranks)]
            owned = [i for start, stop in ranges for i in range(start, stop)]
            assert owned == list(range(elements)), (elements, ranks)
            assert shard_plan.padded_length(elements, ranks) >= elements
            assert shard_plan.padded_length(elements, ranks) - elements < ranks


def test_a_variable_of_many_rows_is_cut_between_rows_and_keeps_its_row_shape():
    from tfdist.exchange import shard_plan

    for shape in ([200_000, 64], [1001, 3], [50, 4], [64, 2, 5], [3, 3, 64, 128], [1000]):
        for ranks in (1, 2, 3, 4, 8):
            elements, row = int(np.prod(shape)), shard_plan.row_elements(shape, ranks)
            many_rows = len(shape) > 1 and shape[0] >= shard_plan.ROWS_PER_RANK * ranks
            assert row == (int(np.prod(shape[1:])) if many_rows else 1), (shape, ranks)
            ranges = [shard_plan.owned_range(elements, ranks, r, row) for r in range(ranks)]
            assert ranges[0][0] == 0 and ranges[-1][1] == elements, (shape, ranks)
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), (shape, ranks)  # no gap, no overlap
            assert all(start % row == 0 for start, _ in ranges), (shape, ranks)  # each slice starts on a row
            padding = shard_plan.padded_length(elements, ranks, row) - elements
            assert 0 <= padding < ranks * row and padding <= elements / shard_plan.ROWS_PER_RANK + ranks
            want = [shard_plan.slice_length(elements, ranks, row)] if row == 1 else [
                shard_plan.slice_length(elements, ranks, row) // row, *shape[1:]]
            assert shard_plan.slice_shape(shape, ranks) == want, (shape, ranks)
