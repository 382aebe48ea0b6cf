"""tf.distribute conformance: the same client code under three runners, with equal results.

The client program (tests/multirank/conformance_checks.py) is written as a MirroredStrategy /
MultiWorkerMirroredStrategy user writes it: datasets batched by the global batch (16),
`experimental_distribute_dataset`, `strategy.run`, `strategy.reduce`, Keras `fit` with callbacks.
It runs under

- `horovod`: `tfdist.HorovodStrategy()`, `horovodrun -np 2 --gloo`, on Keras 3 and on tf-keras,
  and `-np 4` on Keras 3 (`horovod-keras3-np4`), where every expectation is written for N workers,
  so that a rank-count assumption (in tfdist or in a test) shows;
- `mwms`: TensorFlow's `MultiWorkerMirroredStrategy`, 2 plain processes on loopback (TF_CONFIG),
  tf-keras only (Keras 3's fit does not run under MWMS, keras-team/keras#20585);
- `single`: one process, default strategy, same global batches: the numeric oracle. Its initial
  weights come from numpy, so its numbers do not depend on the Keras flavour (MWMS on tf-keras
  is checked against it too, which also validates the expectations of this module).

Each runner is launched once (per flavour) and runs every scenario; the tests compare the result
files. MWMS's behaviour is the contract: where HorovodStrategy differs, the test fails. (MWMS runs
2 workers here; the N-worker expectations were checked once against 4 MWMS workers, docs/TESTING.md.)
"""

import json
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from conftest import ROOT, JobFailed, _tail, flavor_env, free_ports, make_job_env, read_results, run_job, wait_or_kill

CHECKS = ROOT / "tests" / "multirank" / "conformance_checks.py"
pytestmark = pytest.mark.multirank

JOBS = ("horovod-keras3", "horovod-tf_keras", "mwms-tf_keras", "horovod-keras3-np4")
HOROVOD_JOBS = ("horovod-keras3", "horovod-tf_keras", "horovod-keras3-np4")
# Launches that run only some scenarios: {key: the scenarios}
PARTIAL_JOBS = {"horovod-tf_keras-np4": ("xla_fit", "xla_custom_loop")}
TIMEOUT = 600  # a 2-rank job runs its scenarios in about a minute; a busy 2-core machine can take several
_cache = {}


# --- launching ---------------------------------------------------------------------------------
def run_mwms(out_dir, env, workers=2, timeout=TIMEOUT):
    """`workers` plain processes under MultiWorkerMirroredStrategy on loopback; {worker: results}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ports = free_ports(workers, "localhost")
    cluster = {"worker": [f"localhost:{port}" for port in ports]}
    procs, logs = [], []
    for index in range(workers):
        tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
        job_env = make_job_env({**env, "TF_CONFIG": tf_config})
        log = open(out_dir / f"worker{index}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, str(CHECKS), "--strategy", "mwms", "--out", str(out_dir)],
            cwd=ROOT, env=job_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def output():
        text = []
        for index, log in enumerate(logs):
            log.seek(0)
            text.append(f"--- worker {index} ---\n{_tail(log.read())}")
        return "\n".join(text)

    try:
        # a worker that failed leaves the others waiting in a collective: stop them all
        killed = wait_or_kill(procs, timeout, fail_fast=True)
        if killed:
            failed = [i for i, p in enumerate(procs) if i not in killed and p.returncode]
            why = f"worker(s) {failed} failed" if failed else f"timed out after {timeout}s"
            raise JobFailed(f"MWMS job {why}\n{output()}")
        if any(p.returncode for p in procs):
            raise JobFailed(f"MWMS job failed: exit codes {[p.returncode for p in procs]}\n{output()}")
        results = read_results(out_dir)
        if sorted(results) != list(range(workers)):
            raise JobFailed(f"expected {workers} result files, got {sorted(results)}\n{output()}")
        return results
    finally:
        for log in logs:
            log.close()


def _launch(key, tmp_path_factory):
    base = tmp_path_factory.mktemp(f"conformance-{key}")
    if key == "single":
        return run_job([CHECKS, "--strategy", "single"], base, np=None, env=flavor_env("keras3"),
                       timeout=TIMEOUT)
    runner, flavor = key.split("-")[:2]
    if runner == "mwms":
        return run_mwms(base, flavor_env(flavor))
    only = ["--only", *PARTIAL_JOBS[key]] if key in PARTIAL_JOBS else []
    return run_job([CHECKS, "--strategy", "horovod", *only], base, np=workers(key), env=flavor_env(flavor),
                   timeout=TIMEOUT)


def workers(job):
    """How many workers (ranks) a launch has: 4 for `...-np4`, else 2."""
    return int(job.rsplit("-np", 1)[1]) if "-np" in job else 2


def flavor_of(job):
    return job.split("-")[1]


def results(key, tmp_path_factory):
    """{worker: results} of one launch ("single", or a JOBS entry), launched once per session."""
    if key not in _cache:
        try:
            _cache[key] = _launch(key, tmp_path_factory)
        except JobFailed as e:  # do not relaunch a failed job for every test that needs it
            _cache[key] = e
    if isinstance(_cache[key], Exception):
        raise _cache[key]
    return _cache[key]


def scenario(key, name, tmp_path_factory):
    """[worker 0's, worker 1's, ...] results of one scenario (one entry for "single"); fails on errors."""
    runs = results(key, tmp_path_factory)
    parts = [runs[w][name] for w in sorted(runs)]
    for w, part in enumerate(parts):
        assert "error" not in part, f"{key} worker {w}: scenario {name} raised {part['error']}\n{part.get('traceback', '')}"
    return parts


def single(name, tmp_path_factory):
    return scenario("single", name, tmp_path_factory)[0]


# --- comparison helpers ------------------------------------------------------------------------
def assert_close(got, expected, atol=1e-5, what=""):
    got, expected = _arrays(got), _arrays(expected)
    assert len(got) == len(expected), what
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=atol, err_msg=what)


def _arrays(value):
    return [np.asarray(v, dtype=np.float64) for v in value]


def max_diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(_arrays(a), _arrays(b)))


def assert_same_on_workers(parts, key, what=""):
    for w, part in enumerate(parts[1:], 1):
        assert part[key] == parts[0][key], f"{what} {key}: differs between worker 0 and worker {w}"


def assert_moved(initial, final):
    assert max_diff(initial, final) > 1e-3, "training did not move the weights: the comparison would be vacuous"


# --- the launches themselves -------------------------------------------------------------------
@pytest.mark.parametrize("job", JOBS)
def test_job_runs_the_requested_strategy_and_flavour(job, tmp_path_factory):
    runner, flavor = job.split("-")[:2]
    runs = results(job, tmp_path_factory)
    expected_strategy = {"horovod": "HorovodStrategy", "mwms": "CollectiveAllReduceStrategy"}[runner]
    assert sorted(runs) == list(range(workers(job)))
    for w in runs:
        meta = runs[w]["meta"]
        assert meta["worker"] == w and meta["num_replicas_in_sync"] == workers(job)
        assert meta["strategy"] == expected_strategy
        assert meta["keras"] == ("tf_keras" if flavor == "tf_keras" else "keras")


def test_single_process_oracle_runs(tmp_path_factory):
    runs = results("single", tmp_path_factory)
    meta = runs[0]["meta"]
    assert meta["num_replicas_in_sync"] == 1 and meta["keras"] == "keras"
    failed = {k: v["error"] for k, v in runs[0].items() if isinstance(v, dict) and "error" in v}
    assert not failed


# --- 1. custom training loop ---------------------------------------------------------------------
@pytest.mark.parametrize("job", JOBS)
def test_custom_loop_splits_every_global_batch(job, tmp_path_factory):
    parts = scenario(job, "custom_loop", tmp_path_factory)
    # 96 examples, global batch 16: 6 steps, each of N workers computing on its 16 / N rows
    assert [p["local_rows"] for p in parts] == [[16 // len(parts)] * 6] * len(parts)
    assert single("custom_loop", tmp_path_factory)["local_rows"] == [16] * 6


@pytest.mark.parametrize("job", JOBS)
def test_custom_loop_matches_single_process(job, tmp_path_factory):
    parts = scenario(job, "custom_loop", tmp_path_factory)
    ref = single("custom_loop", tmp_path_factory)
    # variables created from different values on each worker start from the chief's
    for p in parts:
        assert_close(p["initial"], ref["initial"], atol=0, what="initial weights")
    assert_same_on_workers(parts, "final")
    assert_same_on_workers(parts, "optimizer_variables", "momentum slots")
    assert_moved(ref["initial"], ref["final"])
    assert_close(parts[0]["final"], ref["final"], what="final weights vs single process")
    assert_close(parts[0]["optimizer_variables"], ref["optimizer_variables"], what="momentum slots")
    # strategy.reduce(SUM) of compute_average_loss(global_batch_size=16) is the global-batch loss
    np.testing.assert_allclose(parts[0]["losses"], ref["losses"], rtol=1e-5)
    assert_same_on_workers(parts, "losses")


def test_custom_loop_horovod_equals_mwms(tmp_path_factory):
    hvd = scenario("horovod-tf_keras", "custom_loop", tmp_path_factory)[0]
    mwms = scenario("mwms-tf_keras", "custom_loop", tmp_path_factory)[0]
    # same kernels on the same 8-row parts, and a sum of two gradients: bit for bit the same
    assert hvd["final"] == mwms["final"], f"final weights differ from MWMS's by up to {max_diff(hvd['final'], mwms['final'])}"
    assert hvd["losses"] == mwms["losses"]


# --- 2. Keras fit ----------------------------------------------------------------------------------
FIT_SOURCES = ("dataset", "numpy")


@pytest.mark.parametrize("source", FIT_SOURCES)
@pytest.mark.parametrize("job", JOBS)
def test_fit_steps_and_rows_per_worker(job, source, tmp_path_factory):
    parts = [p[source] for p in scenario(job, "keras_fit", tmp_path_factory)]
    ref = single("keras_fit", tmp_path_factory)[source]
    epochs = len(ref["steps_per_epoch"])
    assert ref["steps_per_epoch"] == [6] * epochs and ref["rows_per_step"] == [16] * 6 * epochs
    n = len(parts)
    for w, p in enumerate(parts):
        # 96 examples, global batch 16, N workers: 6 steps of 16 / N rows per worker and epoch
        assert p["steps_per_epoch"] == [6] * epochs, f"worker {w}"
        assert p["rows_per_step"] == [16 // n] * 6 * epochs, f"worker {w}: rows per step"
        assert sum(p["rows_per_step"]) == 96 // n * epochs  # each worker sees 1/N of the examples


@pytest.mark.parametrize("source", FIT_SOURCES)
@pytest.mark.parametrize("job", JOBS)
def test_fit_matches_single_process(job, source, tmp_path_factory):
    parts = [p[source] for p in scenario(job, "keras_fit", tmp_path_factory)]
    ref = single("keras_fit", tmp_path_factory)[source]
    for p in parts:
        assert_close(p["initial"], ref["initial"], atol=0, what="initial weights")
    assert_same_on_workers(parts, "final")
    assert_moved(ref["initial"], ref["final"])
    assert_close(parts[0]["final"], ref["final"], what="final weights vs single process")
    # History: global loss and accuracy, as one process computes them
    for p in parts:
        assert sorted(p["history"]) == sorted(ref["history"])
        for key, values in ref["history"].items():
            np.testing.assert_allclose(p["history"][key], values, rtol=1e-5, err_msg=key)


# --- 3. collectives ----------------------------------------------------------------------------------
def _even(w):
    return np.array([[w + 1.0, 10.0 * (w + 1)], [100.0 * (w + 1), -1.0 - w]])


def _uneven(w):
    rows = 2 + w
    return (np.arange(rows * 2, dtype=np.float64) + 10.0 * (w + 1)).reshape(rows, 2)


def expected_cross_replica(n):
    even, uneven = [_even(w) for w in range(n)], [_uneven(w) for w in range(n)]
    all_rows, plain_sum = np.concatenate(uneven), n * (n + 1) / 2  # worker w contributes w + 1
    return {
        "reduce_sum_none": sum(even),
        "reduce_mean_none": sum(even) / n,
        "reduce_sum_axis0": all_rows.sum(axis=0),
        "reduce_mean_axis0": all_rows.mean(axis=0),  # over all rows, not the mean of N means
        "gather_axis0": all_rows,
        "gather_axis1": np.concatenate(even, axis=1),
        "reduce_sum_plain_tensor": plain_sum,  # a plain tensor is reduced across workers too
        "reduce_mean_plain_tensor": plain_sum / n,
    }


def expected_replica(n):
    even, plain_sum = [_even(w) for w in range(n)], n * (n + 1) / 2
    return {
        "all_reduce_sum": sum(even),
        "all_reduce_mean": sum(even) / n,
        "all_gather_axis0": np.concatenate(even, axis=0),
        "all_gather_axis1": np.concatenate(even, axis=1),
        "grad_all_reduce_sum": plain_sum,  # d/dx of all_reduce(SUM, x) * c_w is the sum of the c_w = w + 1
        "grad_all_reduce_mean": plain_sum / n,
        "num_replicas_in_sync": n,
    }


MODES = ("eager", "function")


def _check_values(got, expected, what):
    assert isinstance(got, dict) and "error" not in got, f"{what}: {got}"
    for key, value in expected.items():
        local = got[key]
        assert len(local) == 1, f"{what} {key}: one local replica per worker"
        np.testing.assert_allclose(np.asarray(local[0], dtype=np.float64), value, rtol=1e-6,
                                   err_msg=f"{what} {key}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("job", JOBS)
def test_reduce_and_gather_in_cross_replica_context(job, mode, tmp_path_factory):
    parts = scenario(job, "collectives", tmp_path_factory)
    for w, part in enumerate(parts):
        _check_values(part[mode]["cross_replica"], expected_cross_replica(len(parts)), f"worker {w} {mode}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("job", JOBS)
def test_all_reduce_and_all_gather_in_replica_context(job, mode, tmp_path_factory):
    parts = scenario(job, "collectives", tmp_path_factory)
    n = len(parts)
    for w, part in enumerate(parts):
        _check_values(part[mode]["replica"], expected_replica(n), f"worker {w} {mode}")
        # {"a": w + 1, "b": row 0 of _even(w)}, summed
        assert part[mode]["replica"]["all_reduce_nested"] == {"a": [n * (n + 1) / 2],
                                                              "b": [sum(_even(v)[0] for v in range(n)).tolist()]}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("job", JOBS)
def test_all_gather_of_uneven_rows(job, mode, tmp_path_factory):
    parts = scenario(job, "collectives", tmp_path_factory)
    for w, part in enumerate(parts):
        got = part[mode]["replica_uneven_all_gather"]
        assert isinstance(got, list), f"worker {w} {mode}: {got}"
        np.testing.assert_allclose(got[0], expected_cross_replica(len(parts))["gather_axis0"])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("job", JOBS)
def test_replica_id_in_sync_group_is_global(job, mode, tmp_path_factory):
    parts = scenario(job, "collectives", tmp_path_factory)
    ids = [p[mode]["replica"]["replica_id_in_sync_group"] for p in parts]
    assert ids == [[w] for w in range(len(parts))], f"replica_id_in_sync_group on workers 0, 1, ...: {ids}"


@pytest.mark.parametrize("job", JOBS)
def test_local_results_and_num_replicas(job, tmp_path_factory):
    parts = scenario(job, "collectives", tmp_path_factory)
    for w, part in enumerate(parts):
        assert part["num_replicas_in_sync"] == len(parts)
        for mode in MODES:
            # experimental_local_results: this worker's own value, one local replica
            assert len(part[mode]["local_results"]) == 1
            np.testing.assert_allclose(part[mode]["local_results"][0], _uneven(w))


@pytest.mark.parametrize("job", JOBS)
def test_input_context_of_distribute_datasets_from_function(job, tmp_path_factory):
    parts = scenario(job, "collectives", tmp_path_factory)
    n = len(parts)
    for w, part in enumerate(parts):
        assert part["input_context"] == [{"num_input_pipelines": n, "input_pipeline_id": w,
                                          "num_replicas_in_sync": n, "per_replica_batch_size": 16 // n}]
        seen = [v for batch in part["from_function_batches"] for v in batch[0]]
        assert seen == list(range(w, 40, n))  # its own shard of range(40), batched per replica (16 / N)
        assert [len(b[0]) for b in part["from_function_batches"]] == _chunk_sizes(len(seen), 16 // n)


def _chunk_sizes(total, size):
    return [min(size, total - start) for start in range(0, total, size)]


# --- 4. input: auto-shard policies --------------------------------------------------------------
FILE_LINES = (10, 10, 10, 7)
TOTAL = sum(FILE_LINES)
INPUT_CASES = [f"{source}/{policy}" for source in ("files", "slices") for policy in ("AUTO", "FILE", "DATA", "OFF")]


def _split_by_data(total, global_batch=16, workers=2):
    """DATA: every global batch is cut into per-replica parts of ceil(len / workers) rows (a 5-row
    batch: 3 + 2 on 2 workers, 2 + 2 + 1 + 0 on 4, as MWMS does); worker w takes the w-th part."""
    per_worker = [[] for _ in range(workers)]
    for start in range(0, total, global_batch):
        batch = list(range(start, min(start + global_batch, total)))
        part = -(-len(batch) // workers)
        for w in range(workers):
            per_worker[w].append(batch[w * part:(w + 1) * part])
    return per_worker


def _split_by_file(global_batch=16, workers=2):
    """FILE: worker w reads files w, w + workers, ...; its global-size batches are then rebatched."""
    starts = np.cumsum((0,) + FILE_LINES)
    per_worker = []
    for w in range(workers):
        ids = [i for f in range(w, len(FILE_LINES), workers) for i in range(starts[f], starts[f] + FILE_LINES[f])]
        batches = []
        for start in range(0, len(ids), global_batch):
            batch = ids[start:start + global_batch]
            per_replica = global_batch // workers
            batches += [batch[i:i + per_replica] for i in range(0, len(batch), per_replica)]
        per_worker.append(batches)
    # the workers step together: one whose files ran out gets empty batches until all have (as MWMS)
    steps = max(len(batches) for batches in per_worker)
    return [batches + [[]] * (steps - len(batches)) for batches in per_worker]


def _expected_input(case, workers):
    source, policy = case.split("/")
    if policy == "OFF":  # no sharding: every worker reads every global batch, in per-replica pieces
        per_replica = 16 // workers
        return [[b[i:i + per_replica] for b in GLOBAL_BATCHES for i in range(0, len(b), per_replica)]] * workers
    if policy == "FILE" or (policy == "AUTO" and source == "files"):
        return None if source == "slices" else _split_by_file(workers=workers)
    return _split_by_data(TOTAL, workers=workers)


@pytest.mark.parametrize("case", INPUT_CASES)
@pytest.mark.parametrize("job", JOBS)
def test_distributed_dataset_auto_shard(job, case, tmp_path_factory):
    parts = [p[case] for p in scenario(job, "input", tmp_path_factory)]
    n = len(parts)
    expected = _expected_input(case, n)
    if expected is None:
        # FILE sharding of a dataset that reads no files: TensorFlow refuses, on every worker
        for w, p in enumerate(parts):
            assert "error" in p and "unshardable" in p["message"], f"worker {w}: {p}"
    else:
        got = [p.get("batches", p) for p in parts]
        for w in range(n):
            assert sorted(v for b in got[w] for v in b) == sorted(v for b in expected[w] for v in b), (
                f"worker {w}: elements seen")
            assert [len(b) for b in got[w]] == [len(b) for b in expected[w]], f"worker {w}: batch sizes"
        union = Counter(v for w in range(n) for b in got[w] for v in b)
        assert union == Counter(v for w in range(n) for b in expected[w] for v in b)
    if not job.startswith("mwms") and n == 2:
        mwms = [p[case] for p in scenario("mwms-tf_keras", "input", tmp_path_factory)]
        if "error" in mwms[0]:
            assert [p.get("error") for p in parts] == [m["error"] for m in mwms]
        else:
            assert [p["batches"] for p in parts] == [m["batches"] for m in mwms], "batches differ from MWMS's"


@pytest.mark.parametrize("job", JOBS)
def test_cpu_ranks_read_batches_without_a_multi_device_iterator(job, tmp_path_factory):
    # TF's MultiDeviceIterator copies each batch to the replica's device; on a CPU rank that is a
    # generator call and a thread hop a step for nothing (the batches above are the same either way)
    for w, part in enumerate(scenario(job, "input", tmp_path_factory)):
        for kind, specs in part["iterator_kinds"].items():
            if job.startswith("mwms"):  # the probe sees TF's own way
                assert "MultiDeviceIteratorSpec" in specs, f"worker {w} {kind}: {specs}"
            else:
                assert "MultiDeviceIteratorSpec" not in specs and "IteratorSpec" in specs, f"worker {w} {kind}: {specs}"


@pytest.mark.parametrize("job", JOBS)
def test_partial_batch_check_only_where_ranks_can_end_apart(job, tmp_path_factory):
    # TF's partial-batch check is an allreduce before every step. Sharded by DATA (asked for, or
    # AUTO on data that reads no files) every rank takes a part of each global batch and all end
    # together, so tfdist leaves it out; FILE, OFF and AUTO on files keep it, as MWMS keeps it always
    parts = scenario(job, "input", tmp_path_factory)
    for case in INPUT_CASES:
        source, policy = case.split("/")
        for w, part in enumerate(parts):
            if "error" in part[case]:
                continue  # FILE on tensors: refused, as asserted above
            found = part[case]["step_collectives"]
            if job.startswith("mwms") or policy in ("FILE", "OFF") or (policy == "AUTO" and source == "files"):
                assert found, f"worker {w} {case}: no partial-batch check in the step's input"
            else:
                assert not found, f"worker {w} {case}: a collective in the step's input: {found}"


GLOBAL_BATCHES = [list(range(s, min(s + 16, TOTAL))) for s in range(0, TOTAL, 16)]
BATCH_OPS = ("gather_axis0", "reduce_mean_axis0", "reduce_sum_axis0", "reduce_sum_none", "reduce_sum_rows")


def expected_batch_values(op, n):
    """strategy.<op> of the distributed batches of a dataset batched by 16, taken from the iterator."""
    per_replica = 16 // n
    return {
        "reduce_sum_axis0": [sum(b) for b in GLOBAL_BATCHES],
        "reduce_mean_axis0": [sum(b) / len(b) for b in GLOBAL_BATCHES],
        "gather_axis0": GLOBAL_BATCHES,  # each global batch, in order
        "reduce_sum_rows": [len(b) for b in GLOBAL_BATCHES],
        # 32 elements, 2 global batches: the workers' parts (rows w*16/N ... of each), elementwise
        "reduce_sum_none": [[sum(start + w * per_replica + i for w in range(n)) for i in range(per_replica)]
                            for start in (0, 16)],
    }[op]


@pytest.mark.parametrize("op", BATCH_OPS)
@pytest.mark.parametrize("job", JOBS)
def test_reduce_and_gather_of_distributed_batches(job, op, tmp_path_factory):
    parts = scenario(job, "input", tmp_path_factory)
    for w, part in enumerate(parts):
        got = part[f"batch_values/{op}/function"]
        assert got == expected_batch_values(op, len(parts)), f"worker {w}: strategy.{op} of iterator batches"


# --- 5. evaluate and predict on uneven data -----------------------------------------------------
@pytest.mark.parametrize("job", JOBS)
def test_evaluate_on_uneven_data_is_exact(job, tmp_path_factory):
    parts = scenario(job, "evaluate_predict", tmp_path_factory)
    ref = single("evaluate_predict", tmp_path_factory)
    for w, p in enumerate(parts):
        assert_close(p["weights"], ref["weights"], atol=0, what="evaluated weights")
        for kind in ("evaluate_numpy", "evaluate_dataset"):
            assert p[kind]["loss"] == pytest.approx(ref[kind]["loss"], rel=1e-6), f"worker {w} {kind}"
            assert p[kind]["accuracy"] == pytest.approx(ref[kind]["accuracy"], rel=1e-6), f"worker {w} {kind}"
    acc = ref["evaluate_numpy"]["accuracy"]
    assert acc * 53 == pytest.approx(round(acc * 53), abs=1e-3) and 0 < acc < 1


@pytest.mark.parametrize("kind", ("predict_numpy", "predict_dataset"))
@pytest.mark.parametrize("job", JOBS)
def test_predict_returns_every_row_in_order(job, kind, tmp_path_factory):
    parts = scenario(job, "evaluate_predict", tmp_path_factory)
    ref = single("evaluate_predict", tmp_path_factory)
    assert len(ref[kind]) == 53
    for w, p in enumerate(parts):
        assert len(p[kind]) == 53, f"worker {w}: {len(p[kind])} rows"
        np.testing.assert_allclose(p[kind], ref[kind], rtol=1e-6, atol=1e-6, err_msg=f"worker {w}")


# --- 6. callbacks ------------------------------------------------------------------------------
def _non_chief_files(parts, listing, subdir):
    """Files in `listing` (under files/<subdir>) that a non-chief worker wrote itself."""
    written = {path for part in parts[1:] for path in part["writes"]}
    return sorted(f for f in listing or [] if f"{subdir}/{f}" in written)


@pytest.mark.parametrize("job", JOBS)
def test_callbacks_complete_on_every_worker(job, tmp_path_factory):
    parts = scenario(job, "callbacks", tmp_path_factory)
    for w, p in enumerate(parts):
        for fit in ("checkpoint_tensorboard_earlystop", "backup_and_restore"):
            assert "error" not in p[fit], f"worker {w} {fit}: {p[fit]['error']}\n{p[fit].get('traceback', '')}"
            assert p[fit]["completed"]


@pytest.mark.parametrize("job", JOBS)
def test_early_stopping_stops_every_worker_at_the_same_epoch(job, tmp_path_factory):
    parts = [p["checkpoint_tensorboard_earlystop"] for p in scenario(job, "callbacks", tmp_path_factory)]
    ref = single("callbacks", tmp_path_factory)["checkpoint_tensorboard_earlystop"]
    assert ref["stopped_epoch"] == 2 and ref["epochs_run"] == 3  # it did stop early (of 8 epochs)
    for w, p in enumerate(parts):
        assert "error" not in p, f"worker {w}: {p['error']}"
        assert (p["stopped_epoch"], p["epochs_run"]) == (ref["stopped_epoch"], ref["epochs_run"]), f"worker {w}"
        np.testing.assert_allclose(p["loss"], ref["loss"], rtol=1e-5)


@pytest.mark.parametrize("job", JOBS)
def test_model_checkpoint_is_written_by_the_chief_only(job, tmp_path_factory):
    parts = scenario(job, "callbacks", tmp_path_factory)
    ref = single("callbacks", tmp_path_factory)
    assert ref["ckpt_listing"] == ["model-01.keras", "model-02.keras", "model-03.keras"]
    # the requested directory holds exactly the checkpoints one process writes (no temp leftovers)
    assert parts[0]["ckpt_listing"] == ref["ckpt_listing"]
    # ... all written by the chief: the non-chief's own writes went elsewhere
    assert _non_chief_files(parts, parts[0]["ckpt_listing"], "ckpt") == []
    # (the chief writes each file as a temp sibling renamed into place: none is left, see above)
    chief_writes = [f for f in parts[0]["writes"] if f.startswith("ckpt/") and ".tfdist-tmp-" not in f]
    assert sorted(chief_writes) == [f"ckpt/{f}" for f in ref["ckpt_listing"]]


@pytest.mark.parametrize("job", JOBS)
def test_tensorboard_logs_are_written_by_the_chief_only(job, tmp_path_factory):
    parts = scenario(job, "callbacks", tmp_path_factory)
    listing = parts[0]["tb_listing"]
    events = [f for f in listing or [] if ".tfevents." in f]
    assert events, f"no TensorBoard event files in the requested log dir: {listing}"
    # event file names carry the writer's pid: <time>.<host>.<pid>.<n>.v2
    writers = sorted({int(f.split(".tfevents.")[1].split(".")[-3]) for f in events})
    pids = [p["pid"] for p in parts]
    assert writers == [pids[0]], f"event files written by pids {writers}; chief {pids[0]}, non-chiefs {pids[1:]}"
    assert all(f.startswith("train/") for f in listing), f"unexpected entries: {listing}"


@pytest.mark.parametrize("job", JOBS)
def test_csv_logger_writes_one_process_log(job, tmp_path_factory):
    # CSVLogger(append=True) in the shared folder: one header and one line per epoch, as one process
    # writes. MWMS lets every worker append (so 2 workers write every line twice): not its oracle.
    if job.startswith("mwms"):
        pytest.skip("MWMS appends on every worker: each line twice (tf-keras' CSVLogger knows no strategy)")
    parts = scenario(job, "callbacks", tmp_path_factory)
    ref = single("callbacks", tmp_path_factory)["csv"]
    assert ref and len(ref) == 1 + 3 and ref[0].startswith("epoch"), ref
    for w, p in enumerate(parts):
        assert p["csv"] is not None and len(p["csv"]) == len(ref), f"worker {w}: {p['csv']}"
        for got, want in zip(_csv_rows(p["csv"]), _csv_rows(ref)):
            assert got.keys() == want.keys(), f"worker {w}: {p['csv'][0]} != {ref[0]}"
            assert [v == "NA" for v in got.values()] == [want[k] == "NA" for k in got], f"worker {w}: {got} != {want}"
            np.testing.assert_allclose([float(v) for v in got.values() if v != "NA"],
                                       [float(want[k]) for k, v in got.items() if v != "NA"], rtol=1e-5, equal_nan=True)


def _csv_rows(lines):
    """A CSVLogger file's rows as {column: text}; tf-keras' `lr` is Keras 3's `learning_rate` (the
    one-process oracle runs Keras 3). "NA" marks a key that epoch's logs lack, as in one process."""
    names = [{"lr": "learning_rate", "val_lr": "val_learning_rate"}.get(n, n) for n in lines[0].split(",")]
    return [dict(zip(names, line.split(","))) for line in lines[1:]]


@pytest.mark.parametrize("job", JOBS)
def test_backup_and_restore_is_written_by_the_chief_only(job, tmp_path_factory):
    parts = scenario(job, "callbacks", tmp_path_factory)
    per_epoch = parts[0]["backup_listing_per_epoch"]
    assert "error" not in parts[0]["backup_and_restore"], parts[0]["backup_and_restore"]["error"]
    assert len(per_epoch) == 2 and all(per_epoch), f"no backup in the requested directory: {per_epoch}"
    # the layout of one process (Keras 3) or of MWMS (tf-keras): no per-worker leftovers
    reference = (single("callbacks", tmp_path_factory) if flavor_of(job) == "keras3"
                 else scenario("mwms-tf_keras", "callbacks", tmp_path_factory)[0])
    assert per_epoch == reference["backup_listing_per_epoch"]
    for listing in per_epoch:
        assert _non_chief_files(parts, listing, "backup") == []
    assert not parts[0]["backup_listing_after"]  # removed when training completed


# --- 7. variables created inside strategy.run ------------------------------------------------
@pytest.mark.parametrize("job", JOBS)
def test_lazily_created_variables_are_identical_on_workers(job, tmp_path_factory):
    parts = scenario(job, "lazy_variables", tmp_path_factory)
    ref = single("lazy_variables", tmp_path_factory)
    steps = [p["steps"] for p in parts]
    assert [len(s) for s in steps] == [2] * len(parts) and len(ref["steps"]) == 2
    for step in range(2):
        for w in range(1, len(parts)):
            for key in ("fixed", "drawn", "optimizer", "loss"):
                assert steps[w][step][key] == steps[0][step][key], f"step {step + 1}: {key} differs on worker {w}"
        # values created on worker 0 (the chief) are the single process's
        assert_close(steps[0][step]["fixed"], ref["steps"][step]["fixed"], what=f"step {step + 1}")
    assert_moved(ref["initial_fixed"], steps[0][0]["fixed"])
    assert_moved(steps[0][0]["drawn"], steps[0][1]["drawn"])


@pytest.mark.parametrize("job", JOBS)
def test_variable_initial_value_and_aggregation(job, tmp_path_factory):
    parts = scenario(job, "variables", tmp_path_factory)
    total = len(parts) * (len(parts) + 1) / 2  # worker w adds w + 1
    for w, p in enumerate(parts):
        assert p["initial"] == 10.0, f"worker {w}: tf.Variable created in scope starts from the chief's value"
        # assign_add(worker + 1) in replica context, by the variable's aggregation
        assert p["assign_add/SUM"] == [total], f"worker {w}"
        assert p["assign_add/MEAN"] == [total / len(parts)], f"worker {w}"


@pytest.mark.parametrize("job", JOBS)
def test_sync_on_read_variable_reads_the_aggregate(job, tmp_path_factory):
    parts = scenario(job, "variables", tmp_path_factory)
    for w, p in enumerate(parts):
        # ON_READ + SUM (what metrics use): each replica adds locally, a cross-replica read sums
        assert p["on_read/local"] == [w + 1.0], f"worker {w}: local value"
        assert p["on_read/read_value"] == len(parts) * (len(parts) + 1) / 2, (
            f"worker {w}: cross-replica read of a SUM on-read variable")
