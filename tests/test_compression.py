"""Gradient compression (tfdist.exchange.compression, compression="bf16") on 2 real ranks, against numpy.

One horovodrun launch per Keras flavour (tests/multirank/compression_checks.py) runs every check;
the compressors' steps are recomputed here in numpy from both ranks' inputs and initial state, and
every bfloat16 allreduce from both ranks' bfloat16 inputs (tests/bf16_reference.py).
"""

import numpy as np
import pytest

import bf16_reference
from conftest import ROOT, flavor_env, run_job

pytestmark = pytest.mark.multirank
WORKER = ROOT / "tests" / "multirank" / "compression_checks.py"
SHAPES = [(12, 10), (3, 3, 4, 6), (10,)]
_cache = {}


def ranks_of(flavor, tmp_path_factory):
    if flavor not in _cache:
        _cache[flavor] = run_job([WORKER], tmp_path_factory.mktemp(f"compression-{flavor}"), np=2,
                                 env=flavor_env(flavor), timeout=420)
    return _cache[flavor]


def powersgd_reference(initial, inputs, rank, min_rate=2.0):
    """PowerSGD with error feedback and warm start, in numpy: {steps: [outputs], state: [...]}.

    `initial[r]` / `inputs[r][t]` are rank r's starting state and step-t gradients.
    """
    size = len(inputs)
    state = [list(map(np.asarray, s)) for s in initial]  # per rank, flat as the worker lists it
    outputs = []
    for t in range(len(inputs[0])):
        step_out, slot = [], 0
        for j, shape in enumerate(SHAPES):
            grads = [np.asarray(inputs[r][t][j], np.float64) for r in range(size)]
            rows, cols = (int(np.prod(shape[:-1])), shape[-1]) if len(shape) > 1 else (None, None)
            r_eff = min(rank, rows, cols) if rows else None
            if rows is None or rows * cols < min_rate * (rows + cols) * r_eff:
                step_out.append(sum(grads))
                continue
            m = [grads[r].reshape(rows, cols) + state[r][slot] for r in range(size)]
            q = state[0][slot + 1]  # the same on every rank
            p, _ = np.linalg.qr(sum(mi @ q for mi in m))
            q_new = sum(mi.T @ p for mi in m)
            total = p @ q_new.T
            for r in range(size):
                state[r][slot] = m[r] - total / size
                state[r][slot + 1] = q_new
            step_out.append(total.reshape(shape))
            slot += 2
        outputs.append(step_out)
    return outputs, state


def topk_reference(initial, inputs, density, min_entries):
    size = len(inputs)
    state = [list(map(np.asarray, s)) for s in initial]
    outputs = []
    for t in range(len(inputs[0])):
        step_out, slot = [], 0
        for j, shape in enumerate(SHAPES):
            grads = [np.asarray(inputs[r][t][j], np.float64).ravel() for r in range(size)]
            entries = grads[0].size
            if entries < min_entries:
                step_out.append(sum(grads).reshape(shape))
                continue
            k = max(1, int(round(entries * density)))
            total = np.zeros(entries)
            for r in range(size):
                flat = grads[r] + state[r][slot]
                picked = np.argsort(-np.abs(flat), kind="stable")[:k]
                sent = np.zeros(entries)
                sent[picked] = flat[picked]
                total += sent
                state[r][slot] = flat - sent
            step_out.append(total.reshape(shape))
            slot += 1
        outputs.append(step_out)
    return outputs, state


def assert_close(actual, expected, atol=1e-4):
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64), rtol=1e-4, atol=atol)


def test_powersgd_step_matches_numpy_with_error_feedback_and_warm_start(keras_flavor, tmp_path_factory):
    ranks = ranks_of(keras_flavor, tmp_path_factory)
    got = [ranks[r]["powersgd"] for r in (0, 1)]
    outputs, state = powersgd_reference([g["initial"] for g in got], [g["inputs"] for g in got], rank=2)
    assert got[0]["outputs"] == got[1]["outputs"]  # every rank applies the same update, bit for bit
    for t in range(2):
        for j in range(len(SHAPES)):
            assert_close(got[0]["outputs"][t][j], outputs[t][j])
    for r in (0, 1):  # error memories; Q up to the sign of each column (QR's convention)
        errors, qs = state[r][0::2], state[r][1::2]
        for mine, ref in zip(got[r]["state"][0::2], errors):
            assert_close(mine, ref)
        for mine, ref in zip(got[r]["state"][1::2], qs):
            assert_close(np.abs(mine), np.abs(ref), atol=1e-3)
    # error feedback was live: rank 0's memory is not what it started with, nor zero
    assert not np.allclose(got[0]["state"][0], got[0]["initial"][0])


def test_full_rank_powersgd_is_the_exact_sum(keras_flavor, tmp_path_factory):
    ranks = ranks_of(keras_flavor, tmp_path_factory)
    got = [ranks[r]["powersgd_full"] for r in (0, 1)]
    for t in range(2):
        for j in range(len(SHAPES)):
            exact = sum(np.asarray(got[r]["inputs"][t][j]) for r in (0, 1))
            if j < 2 and t == 0:  # the memories start non-zero and are sent with the first step;
                # after it they sum to zero across ranks (each keeps M_r - sum/2)
                exact = exact + sum(np.asarray(got[r]["initial"][2 * j]).reshape(SHAPES[j]) for r in (0, 1))
            assert_close(got[0]["outputs"][t][j], exact, atol=2e-4)


def test_topk_step_matches_numpy_with_error_feedback(keras_flavor, tmp_path_factory):
    ranks = ranks_of(keras_flavor, tmp_path_factory)
    got = [ranks[r]["topk"] for r in (0, 1)]
    outputs, state = topk_reference([g["initial"] for g in got], [g["inputs"] for g in got], 0.1, 16)
    assert got[0]["outputs"] == got[1]["outputs"]
    for t in range(2):
        for j in range(len(SHAPES)):
            assert_close(got[0]["outputs"][t][j], outputs[t][j], atol=1e-5)
    for r in (0, 1):
        for mine, ref in zip(got[r]["state"], state[r]):
            assert_close(mine, ref, atol=1e-5)


FIT_CASES = ["powersgd/ready", "topk/bucketed", "powersgd/accumulation", "powersgd_full/ready",
             "topk/loss_scaling"]


@pytest.mark.parametrize("case", FIT_CASES)
def test_fit_with_compression_keeps_ranks_identical(keras_flavor, case, tmp_path_factory):
    ranks = ranks_of(keras_flavor, tmp_path_factory)
    key = f"fit/{case}"
    r0, r1 = ranks[0][key], ranks[1][key]
    assert r0["final"] == r1["final"]
    assert r0["state"] > 0  # the compressor was in the exchange, with state per compressed tensor
    assert not np.allclose(np.asarray(r0["final"][0]), np.asarray(r0["initial"][0]))
    uncompressed = ranks[0]["fit/none/ready"]["final"]
    distance = max(np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in zip(r0["final"], uncompressed))
    if case == "powersgd_full/ready":  # a rank-full approximation is exact: same training
        assert distance < 1e-4
    elif case != "powersgd/accumulation":  # lossy compression trains differently (and still trains)
        assert distance > 1e-4


def test_custom_loop_with_compression_keeps_ranks_identical(keras_flavor, tmp_path_factory):
    ranks = ranks_of(keras_flavor, tmp_path_factory)
    assert ranks[0]["custom_loop/powersgd"] == ranks[1]["custom_loop/powersgd"]
    assert ranks[0]["custom_loop/powersgd"]["state"] > 0


def test_checkpointer_resumes_error_feedback_exactly(keras_flavor, tmp_path_factory):
    ranks = ranks_of(keras_flavor, tmp_path_factory)
    r0 = ranks[0]
    assert r0["resume/state_variables"] > 0
    assert r0["resume/resumed"] == r0["resume/straight"]  # bit for bit: memories restored per rank
    assert ranks[1]["resume/resumed"] == ranks[1]["resume/straight"]
    # the control: the same resume without the per-rank memories ends elsewhere
    assert r0["resume/without_rank_state"] != r0["resume/straight"]


@pytest.mark.parametrize("compression", ["none", "topk", "powersgd"])
def test_clipping_applies_to_the_exchanged_gradient(keras_flavor, compression, tmp_path_factory):
    """Issue 30: with compression the optimizer clips what it applies, the decompressed sum. Had
    each rank clipped its own part, the applied step would be a sum of two clipped parts: its norm
    up to twice global_clipnorm, entries up to twice clipvalue."""
    ranks = ranks_of(keras_flavor, tmp_path_factory)
    got = {key.rsplit("/", 1)[1]: value for key, value in ranks[0].items() if key.startswith(f"clip/{compression}/")}
    assert all(ranks[0][f"clip/{compression}/{k}"] == ranks[1][f"clip/{compression}/{k}"] for k in got)
    unclipped = got["unclipped"]
    assert unclipped["global_norm"] > 3 * 0.01 and unclipped["largest"] > 3 * 0.002  # both clips engage
    assert got["global_clipnorm"]["global_norm"] == pytest.approx(0.01, rel=1e-4)
    assert got["clipvalue"]["largest"] == pytest.approx(0.002, rel=1e-4)


def test_bf16_allreduce_is_numpys_float32_sum_rounded_once(keras_flavor, tmp_path_factory):
    """Gloo, 2 ranks: sum, average, min, max (fused and alone), Compression.bf16, allgather, broadcast."""
    ranks = ranks_of(keras_flavor, tmp_path_factory)
    exchange = {r: ranks[r]["bf16/exchange"] for r in (0, 1)}
    assert exchange[0]["controller"] == "gloo"
    bf16_reference.check_exchange(exchange)


def test_bf16_gradients_travel_as_bfloat16_and_other_sums_stay_exact(keras_flavor, tmp_path_factory):
    ranks = ranks_of(keras_flavor, tmp_path_factory)
    dtypes = ranks[0]["bf16/allreduce_dtypes"]
    assert dtypes and set(dtypes) == {"bfloat16"}, dtypes  # the traced step's gradient allreduce
    # strategy.reduce is not the optimizer's gradient sum: no cast, so no overflow (float16's
    # 65504) and no rounding (2 + 2**-9 needs 10 significant bits; bfloat16 has 8)
    for name in ("bf16", "fp16"):
        assert ranks[0][f"{name}/strategy_reduce"] == [140000.0, 2.0 + 2.0 ** -9], name


def test_bf16_fit_keeps_ranks_identical(keras_flavor, tmp_path_factory):
    ranks = ranks_of(keras_flavor, tmp_path_factory)
    r0, r1 = ranks[0]["fit/bf16/ready"], ranks[1]["fit/bf16/ready"]
    assert r0["final"] == r1["final"]
    uncompressed = ranks[0]["fit/none/ready"]["final"]
    distance = max(np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in zip(r0["final"], uncompressed))
    assert 0 < distance < 0.05, distance  # bfloat16 was on the wire, and it trains as float32 does


def test_bf16_digits_accuracy_within_half_a_point_of_uncompressed(tmp_path_factory):
    ranks = ranks_of("keras3", tmp_path_factory)  # trained in the Keras 3 launch only
    none, bf16 = ranks[0]["digits/none"], ranks[0]["digits/bf16"]
    assert ranks[1]["digits/bf16"]["final"] == bf16["final"]  # ranks identical
    assert ranks[1]["digits/bf16"]["accuracy"] == bf16["accuracy"]
    assert none["accuracy"] >= 0.9
    assert abs(bf16["accuracy"] - none["accuracy"]) <= 0.005, (none["accuracy"], bf16["accuracy"])
    assert bf16["final"] != none["final"]
    print(f"\ndigits test accuracy, 2 ranks: none {none['accuracy']:.4f}, bf16 {bf16['accuracy']:.4f}")
