"""Real 2-rank Horovod jobs (horovodrun -np 2 --gloo); each launch runs many checks."""

import shutil

import numpy as np
import pytest

from conftest import ROOT, flavor_env, run_job

WORKERS = ROOT / "tests" / "multirank"
pytestmark = pytest.mark.multirank

_cache = {}


def train_results(flavor, tmp_path_factory):
    """The 2-rank job and its 1-process reference, run once per Keras flavour."""
    if flavor not in _cache:
        base = tmp_path_factory.mktemp(f"train-{flavor}")
        env = flavor_env(flavor)
        ranks = run_job([WORKERS / "train_checks.py"], base / "ranks", np=2, env=env)
        reference = run_job([WORKERS / "train_checks.py", "--reference"], base / "ref", np=None, env=env)
        _cache[flavor] = (ranks, reference[0])
    return _cache[flavor]


OPTIMIZERS = ("sgd_momentum", "adam", "adamw", "lars", "larc_sgd", "sgd_warmup")
CASES = [f"{m}/{o}" for m in ("dense", "embedding") for o in OPTIMIZERS]


def assert_weights_close(a, b, atol=1e-5):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.array(x), np.array(y), rtol=1e-5, atol=atol)


def test_flavour_is_the_one_requested(keras_flavor, tmp_path_factory):
    ranks, reference = train_results(keras_flavor, tmp_path_factory)
    expected = "tf_keras" if keras_flavor == "tf_keras" else "keras"
    assert ranks[0]["keras"] == ranks[1]["keras"] == reference["keras"] == expected


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_equal_one_process_with_double_batch(keras_flavor, case, tmp_path_factory):
    ranks, reference = train_results(keras_flavor, tmp_path_factory)
    # identical on both ranks, bit for bit: both apply the same allreduced gradients
    assert ranks[0][case]["final"] == ranks[1][case]["final"]
    # and equal (float tolerance) to one process training on batch 2B
    assert_weights_close(ranks[0][case]["final"], reference[case]["final"])
    # training moved the weights, so the comparison above is not trivially true
    assert not np.allclose(np.array(ranks[0][case]["final"][0]), np.array(ranks[0][case]["initial"][0]))


@pytest.mark.parametrize("case", CASES)
def test_ranks_seeded_differently_start_identical(keras_flavor, case, tmp_path_factory):
    ranks, reference = train_results(keras_flavor, tmp_path_factory)
    assert ranks[0][case]["initial"] == ranks[1][case]["initial"]


def test_gradient_accumulation_equals_one_larger_batch(keras_flavor, tmp_path_factory):
    ranks, reference = train_results(keras_flavor, tmp_path_factory)
    assert ranks[0]["accumulation"] == ranks[1]["accumulation"]
    # 2 ranks x batch 8 x 2 accumulated micro-batches == 1 process x batch 32, step for step
    assert_weights_close(ranks[0]["accumulation"], reference["accumulation"])


def test_fp16_compressed_gradients_stay_identical_and_close(keras_flavor, tmp_path_factory):
    ranks, reference = train_results(keras_flavor, tmp_path_factory)
    assert ranks[0]["fp16_compression"] == ranks[1]["fp16_compression"]
    assert_weights_close(ranks[0]["fp16_compression"], reference["fp16_compression"], atol=2e-3)


def test_bucketed_allreduce_trains_like_one_collective_and_issues_one_op_per_bucket(keras_flavor, tmp_path_factory):
    ranks, reference = train_results(keras_flavor, tmp_path_factory)
    assert ranks[0]["bucketed/adam"]["final"] == ranks[1]["bucketed/adam"]["final"]
    assert_weights_close(ranks[0]["bucketed/adam"]["final"], reference["bucketed/adam"]["final"])
    assert_weights_close(ranks[0]["bucketed/adam"]["final"], ranks[0]["dense/adam"]["final"], atol=1e-6)
    assert ranks[0]["bucketed/allreduce_ops"] == ranks[0]["bucketed/variables"] > 1
    # the default (bucket_mb=None): one collective per gradient too, each enqueued when it exists
    assert ranks[0]["ready/allreduce_ops"] == ranks[0]["bucketed/variables"]


def test_synchronized_batchnorm_uses_global_statistics(keras_flavor, tmp_path_factory):
    ranks, reference = train_results(keras_flavor, tmp_path_factory)
    assert ranks[0]["sync_batchnorm"] == ranks[1]["sync_batchnorm"]
    # moving mean and variance of the last global batch of 16, as one process computes them
    assert_weights_close(ranks[0]["sync_batchnorm"], reference["sync_batchnorm"], atol=1e-3)


def test_per_rank_convention_stays_available(keras_flavor, tmp_path_factory):
    ranks, reference = train_results(keras_flavor, tmp_path_factory)
    # batch_convention="per_rank": each rank's slices at batch 8 == 1 process at batch 16
    assert ranks[0]["per_rank_convention"] == ranks[1]["per_rank_convention"]
    assert ranks[0]["per_rank_convention"]["steps"] == reference["per_rank_convention"]["steps"] == 5
    assert_weights_close(ranks[0]["per_rank_convention"]["final"], reference["per_rank_convention"]["final"])


def test_shuffled_fit_sees_every_example_once_per_epoch(keras_flavor, tmp_path_factory):
    ranks, _ = train_results(keras_flavor, tmp_path_factory)
    for epoch in (0, 1):
        ids0, ids1 = ranks[0]["shuffled_ids"][epoch], ranks[1]["shuffled_ids"][epoch]
        assert len(ids0) == len(ids1) == 48  # half of the 96 examples on each rank
        assert sorted(ids0 + ids1) == list(range(96))  # the two halves of one permutation
    assert ranks[0]["shuffled_ids"][0] != sorted(ranks[0]["shuffled_ids"][0])  # it did shuffle
    if keras_flavor == "tf_keras":
        assert ranks[0]["shuffled_ids"][0] != ranks[0]["shuffled_ids"][1]  # anew each epoch
    # Keras 3 repeats a seeded array shuffle every epoch, in one process too (docs/LIMITS.md)


def test_reported_metrics_are_global(keras_flavor, tmp_path_factory):
    ranks, _ = train_results(keras_flavor, tmp_path_factory)
    for rank in (0, 1):
        m = ranks[rank]["metrics"]
        assert m["fit_by_hand"]["count"] == 96
        # 96 examples at global batch 16: 6 steps of 8 on each rank, each example once
        assert m["fit_steps"] == 6
        for key in ("loss", "accuracy"):
            assert m["history"][key] == pytest.approx(m["fit_by_hand"][key], rel=1e-5)
    assert ranks[0]["metrics"]["history"] == ranks[1]["metrics"]["history"]


def test_evaluate_on_uneven_data_is_exact_global(keras_flavor, tmp_path_factory):
    ranks, _ = train_results(keras_flavor, tmp_path_factory)
    for rank in (0, 1):
        m = ranks[rank]["metrics"]
        assert m["evaluate_by_hand"]["count"] == 53
        for key in ("loss", "accuracy"):
            assert m["evaluate"][key] == pytest.approx(m["evaluate_by_hand"][key], rel=1e-5)
        # 5 records at global batch 16: one batch of 5, split 3 + 2, still exact
        assert m["tiny_by_hand"]["count"] == 5
        for key in ("loss", "accuracy"):
            assert m["tiny_evaluate"][key] == pytest.approx(m["tiny_by_hand"][key], rel=1e-5)
    # global accuracy over 53 records: a multiple of 1/53, and not either rank's local value
    acc = ranks[0]["metrics"]["evaluate"]["accuracy"]
    assert acc * 53 == pytest.approx(round(acc * 53), abs=1e-3)
    # predict() returns every rank's rows, in input order, as under MultiWorkerMirroredStrategy
    for rank in (0, 1):
        assert ranks[rank]["metrics"]["predict_rows"] == 53
        assert ranks[rank]["metrics"]["predict_max_error"] < 1e-5


def test_uneven_global_batch_warned_once_by_the_chief(keras_flavor, tmp_path_factory):
    ranks, _ = train_results(keras_flavor, tmp_path_factory)
    # arrays at 15 (fit twice), tensors at 13, tf.data at 11: one warning each, on rank 0 only,
    # naming the batch and the rank count; batch 16 (arrays and tf.data) warns nowhere
    warned = ranks[0]["uneven_warnings"]
    assert [w.split(": a global batch of ")[1].split(" ")[0] for w in warned] == ["15", "13", "11"]
    assert all(w.startswith("tfdist: rank 0: a global batch of ") and "across 2 ranks" in w for w in warned)
    assert ranks[1]["uneven_warnings"] == []


def test_strategy_topology_and_input_contexts(tmp_path_factory):
    from tfdist import collectives

    ranks, _ = train_results("keras3", tmp_path_factory)
    f0, f1 = ranks[0]["facts"], ranks[1]["facts"]
    assert (f0["rank"], f1["rank"]) == (0, 1)
    assert f0["size"] == f1["size"] == f0["num_replicas_in_sync"] == 2
    assert (f0["local_rank"], f1["local_rank"], f0["local_size"]) == (0, 1, 2)
    assert (f0["is_chief"], f1["is_chief"]) == (True, False)
    assert (f0["should_checkpoint"], f1["should_checkpoint"]) == (True, False)
    assert (f0["chief_path_is_own"], f1["chief_path_is_own"]) == (True, False)
    assert f0["input_context"] == [2, 0, 2] and f1["input_context"] == [2, 1, 2]
    assert sorted(f0["records_seen"] + f1["records_seen"]) == list(range(10))
    # tuning: the two ranks on this node are pinned to disjoint cores, with matching threads
    a0, a1 = set(f0["tuning"]["cpu_affinity"]), set(f1["tuning"]["cpu_affinity"])
    assert a0 and a1 and not (a0 & a1)
    for f in (f0, f1):
        # CPU-only: Horovod's cycle was set to 10 ms before hvd.init(), and the plan says why
        assert f["tuning"]["env"]["HOROVOD_CYCLE_TIME"] == "10"
        assert f["tuning"]["env"]["HOROVOD_CYCLE_ON_ENQUEUE"] == "1"
        assert any("Horovod cycle 10 ms" in reason for reason in f["tuning"]["reasons"])
        assert any("starts Horovod's cycle at once" in reason for reason in f["tuning"]["reasons"])
        assert f["affinity_now"] == sorted(f["tuning"]["cpu_affinity"])
        assert f["intra_op_now"] == f["tuning"]["intra_op_threads"] >= 1
        # 2 ranks of a node on Gloo: the tuning line names mpirun's shared memory where it is there
        mpi_here = shutil.which("mpirun") and shutil.which("ompi_info") and collectives.horovod().mpi_built()
        assert f["transport"] == ("collectives Gloo on CPU (2 ranks on this node over loopback TCP; mpirun "
                                  "exchanges through shared memory: tfdist-run --launcher mpirun)"
                                  if mpi_here else "collectives Gloo on CPU")
    for f in (f0, f1):
        assert f["broadcast_object"] == [200_000, 0]
        assert f["allgather_object"] == [[], list(range(3000))]
        assert f["gathered"] == [[0.0, 0.0], [1.0, 1.0]]
        assert f["gathered_axis1"] == [[0.0, 0.0, 1.0, 1.0]]
        assert f["reduced_sum"] == 3.0
        # a tf.function's collectives on captured tensors, after rank 0 alone ran eager ops
        assert f["after_uneven_eager_work"] == {"sum": [3.0, 30.0], "gather": [1.0, 10.0, 2.0, 20.0], "mean": [1.5, 15.0]}


def test_misuse_fails_loudly_on_every_rank(tmp_path):
    ranks = run_job([WORKERS / "fault_checks.py"], tmp_path, np=2, timeout=300)
    for rank in (0, 1):
        jit = ranks[rank]["jit"]
        # AutoGraph re-raises the error as a StagingError that carries it, class name and message
        assert jit["error"] == "StagingError" and "CollectiveInXlaError" in jit["message"]
        assert "jit_compile" in jit["message"] and "xla_mpi_ops.cc" in jit["message"]
        assert "experimental_get_compiler_ir" in jit["message"]
        mismatch = ranks[rank]["mismatch"]
        assert mismatch["error"] == "RankMismatchError"
        assert "(3, 4)" in mismatch["message"] and "(3, 5)" in mismatch["message"]
        assert "kernel" in mismatch["message"] and "rank 1" in mismatch["message"]


@pytest.mark.parametrize("shards,mode", [(4, "file"), (3, "range"), (1, "range")])
def test_two_ranks_read_every_record_exactly_once(tmp_path, shards, mode):
    from tfdist.pipelines import write_arrays

    data_dir = tmp_path / f"ds{shards}"
    write_arrays({"id": np.arange(41, dtype=np.int64)}, data_dir, shard_bytes=1 << 30, min_shards=shards)
    ranks = run_job([WORKERS / "pipeline_checks.py", "--data", data_dir], tmp_path / "out", np=2)
    r0, r1 = ranks[0][data_dir.name], ranks[1][data_dir.name]
    assert r0["eval"]["mode"] == r1["eval"]["mode"] == mode
    # evaluation pass: the union is exactly the dataset, nothing doubled
    assert sorted(r0["eval"]["ids"] + r1["eval"]["ids"]) == list(range(41))
    # training epoch: equal step counts on both ranks, no record seen twice
    assert r0["train"]["steps"] == r1["train"]["steps"] == 20 // 4
    train = r0["train"]["ids"] + r1["train"]["ids"]
    assert len(train) == 2 * 5 * 4 and len(set(train)) == len(train)


def test_two_ranks_skipping_corrupt_records_read_every_good_record_once_per_epoch(tmp_path):
    from test_pipelines import corrupt_byte, write_with_bad_records

    from tfdist.pipelines import write_arrays

    # "range": one shard of 60 with 10 unparsable records (3, 9, ..., 57), 5 in each rank's half
    write_with_bad_records(tmp_path / "range")
    # "file": two shards of 60 (even and odd ids), records 50-59 of each unreadable (corrupt tail)
    m = write_arrays({"id": np.arange(120, dtype=np.int64)}, tmp_path / "file", shard_bytes=1 << 30, min_shards=2)
    for shard in m.shards:
        corrupt_byte(m.path(shard), 50, shard.records)
    good = {"range": [i for i in range(60) if i not in range(3, 60, 6)], "file": list(range(100))}
    ranks = run_job([WORKERS / "pipeline_checks.py", "--corrupt", tmp_path / "range", tmp_path / "file"],
                    tmp_path / "out", np=2)
    for name, per_rank, steps in (("range", 25, 5), ("file", 50, 10)):
        r0, r1 = ranks[0][name], ranks[1][name]
        assert r0["mode"] == r1["mode"] == name
        assert r0["steps"] == r1["steps"] == steps and r0["good"] == r1["good"] == per_rank
        for rank, r in enumerate((r0, r1)):  # agreed through a collective, not by reading all shares
            assert any(t.startswith(f"rank {rank}: {per_rank} of ") for t in r["log"])
            assert not any("counting all" in t for t in r["log"])
        for epoch in (0, 1):  # each epoch: the good records, each once across the ranks
            e0, e1 = r0["epochs"][epoch], r1["epochs"][epoch]
            assert sorted(e0["ids"] + e1["ids"]) == good[name]
            assert sum(e0["skipped"].values()) + sum(e1["skipped"].values()) == (10 if name == "range" else 20)


def test_overflow_on_one_rank_is_skipped_by_all_ranks(keras_flavor, tmp_path):
    # Without the global finite check, rank 0 enters the allreduce that rank 1 skips: a hang,
    # which the job timeout turns into a failure.
    ranks = run_job([WORKERS / "precision_checks.py"], tmp_path, np=2, env=flavor_env(keras_flavor), timeout=240)
    s0, s1 = ranks[0]["steps"], ranks[1]["steps"]
    assert len(s0) == len(s1) == 6
    assert s0 == s1  # same scale and same weights on both ranks after every step
    scales = [s["scale"] for s in s0]
    assert scales[2] == scales[1] / 2  # the overflow step halved the scale ...
    assert s0[2]["weights"] == s0[1]["weights"]  # ... and applied nothing
    assert s0[3]["weights"] != s0[2]["weights"] and scales[3:] == [scales[2]] * 3  # training went on


def test_horovod_cycle_starts_on_enqueue_else_follows_the_measured_train_step(keras_flavor, tmp_path_factory):
    from tfdist.tuning.cycle import cycle_for_step_ms

    ranks, _ = train_results(keras_flavor, tmp_path_factory)
    for rank in (0, 1):
        before, after = ranks[rank]["cycle_before"], ranks[rank]["cycle"]
        # tfdist's CPU default: 10 ms, each enqueued collective starting a cycle (Horovod's word),
        # so no train step was timed to choose another
        assert before == {"choice": None, "horovod_reports_ms": 10.0, "starts_on_enqueue": True}
        # at a 400 ms cycle, every allreduce but the first (which may meet the cycle the new
        # length starts) ends long before a cycle would have begun
        assert max(ranks[rank]["allreduce_ms_at_400_ms_cycle"][1:]) < 100, ranks[rank]
        choice = after["choice"]
        assert choice["cycle_ms"] == cycle_for_step_ms(choice["step_ms"]) < 10, choice   # steps of a few ms
        assert after["horovod_reports_ms"] == choice["in_effect_ms"] == choice["cycle_ms"]   # Horovod's own word
    line = ranks[0]["cycle"]["printed"]
    assert len(line) == 1 and f"{ranks[0]['cycle']['choice']['cycle_ms']:g} ms" in line[0], line
    assert ranks[1]["cycle"]["printed"] == []   # the chief alone says it
