"""Keras 3 gradient clipping sees the summed gradient: 2 and 4 ranks equal one process (1e-5).

One launch per rank count of tests/multirank/clipping_checks.py (`clipnorm`, `global_clipnorm`,
`clipvalue`, with a LossScaleOptimizer and with Keras' gradient accumulation), compared with the
same fits in one plain process. Before, each rank clipped its own part of the gradient: after 2
epochs the weights differed from one process by 0.17 on 2 ranks and 0.25 on 4. The same launches
check Horovod's bfloat16 allreduce and its reduce-scatter (patch 0011's ring) on Gloo against numpy
(the suite's 4-rank Gloo launch). The 4-rank launch cuts the bfloat16 allreduce into 2 KiB pieces
(patch 0012's HOROVOD_BFLOAT16_PIECE_BYTES), so its largest tensor's segments travel in five pieces,
more than the four in flight; the 2-rank launch keeps the 1 MiB default (one piece per segment).
"""

import numpy as np
import pytest

import bf16_reference
import reducescatter_reference
from conftest import ROOT, flavor_env, run_job

WORKER = ROOT / "tests" / "multirank" / "clipping_checks.py"
_jobs = {}


def ranks_job(ranks, tmp_path_factory):
    """The `ranks`-rank launch, once."""
    if ranks not in _jobs:
        pieces = {"HOROVOD_BFLOAT16_PIECE_BYTES": "2048"} if ranks == 4 else {}
        _jobs[ranks] = run_job([WORKER], tmp_path_factory.mktemp(f"clip-{ranks}"), np=ranks,
                               env={**flavor_env("keras3"), **pieces}, timeout=600)
    return _jobs[ranks]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("clip-reference")
    return run_job([WORKER, "--reference"], out, np=None, env=flavor_env("keras3"))[0]


@pytest.mark.parametrize("ranks", [2, 4])
def test_clipped_training_on_ranks_equals_one_process(reference, tmp_path_factory, ranks):
    results = ranks_job(ranks, tmp_path_factory)
    worst = {}
    for case in (key for key in results[0] if key not in ("bf16_exchange", "reducescatter")):
        expected = reference[case]
        # the clip changes the training (else equality below would prove nothing)
        assert _largest_difference(expected, reference[f"{case} unclipped"]) > 1e-2, case
        for rank in range(ranks):
            for mine, want in zip(results[rank][case], expected):
                np.testing.assert_allclose(mine, want, atol=1e-5, err_msg=f"{case}, rank {rank} of {ranks}")
        worst[case] = _largest_difference(results[0][case], expected)
    print(f"\n{ranks} ranks, largest difference from one process per case: "
          + ", ".join(f"{case} {value:.1e}" for case, value in worst.items()))


@pytest.mark.parametrize("ranks", [2, 4])
def test_bf16_allreduce_on_gloo_is_numpys_float32_sum_rounded_once(tmp_path_factory, ranks):
    results = ranks_job(ranks, tmp_path_factory)
    exchange = {r: results[r]["bf16_exchange"] for r in range(ranks)}
    assert exchange[0]["controller"] == "gloo"
    bf16_reference.check_exchange(exchange)
    if ranks == 4:  # one rounding of the float32 sum, where rounding each partial sum loses it
        assert bf16_reference.once_beats_pairwise(exchange) == (1.0 + 2.0 ** -7, 1.0)


@pytest.mark.parametrize("ranks", [2, 4])
def test_reducescatter_allgather_and_alltoall_on_gloo_give_each_rank_numpys_result(tmp_path_factory, ranks):
    results = ranks_job(ranks, tmp_path_factory)
    scattered = {r: results[r]["reducescatter"] for r in range(ranks)}
    assert scattered[0]["controller"] == "gloo"
    reducescatter_reference.check(scattered)
    reducescatter_reference.check_gathers(scattered)


@pytest.mark.parametrize("ranks", [2, 4])
def test_small_allreduces_on_gloo_are_one_exchange_reduced_in_rank_order(tmp_path_factory, ranks):
    """Patch 0018: below its limit every rank gets exactly x0 + x1 + ... (a ring sums in another order)."""
    results = ranks_job(ranks, tmp_path_factory)
    assert results[0]["reducescatter"]["controller"] == "gloo"
    reducescatter_reference.check_small_allreduces({r: results[r]["reducescatter"]["small_allreduce"]
                                                    for r in range(ranks)})


def _largest_difference(a, b):
    return max(float(np.max(np.abs(np.array(x) - np.array(y)))) for x, y in zip(a, b))
