"""XLA across ranks: `jit_compile=True` on 2 and 4 ranks equals one process that compiles the whole step.

The scenarios live in tests/multirank/xla_flows.py and run inside the conformance launches
(tests/test_conformance.py): `xla_fit` (`model.compile(jit_compile=True)`) and `xla_custom_loop`
(the custom-loop tutorial's step under `tf.function(jit_compile=True)`), under HorovodStrategy on 2
ranks (Keras 3, tf-keras) and 4 ranks (Keras 3 in the full launch, tf-keras in a launch of these
two alone), and in one process, the oracle. Each run reports the HLO modules XLA compiled in that
process (`--xla_dump_to`): a run that quietly left XLA out cannot pass. MWMS is not run: XLA
cannot compile its collectives on a CPU either.
"""

import numpy as np
import pytest

from test_conformance import HOROVOD_JOBS, PARTIAL_JOBS, assert_close, assert_same_on_workers, scenario, single

pytestmark = pytest.mark.multirank

XLA_JOBS = HOROVOD_JOBS + tuple(job for job, only in PARTIAL_JOBS.items() if "xla_fit" in only)


def assert_compiled_by_xla(part, what):
    xla = part["xla"]
    # the Dense layers' matmuls were compiled by XLA; the allreduce stayed out (it cannot be in)
    assert xla["modules"] >= 1 and xla["matmul"], f"{what}: XLA compiled nothing: {xla}"
    assert not xla["horovod"], f"{what}: a Horovod op inside an XLA module: {xla}"


@pytest.mark.parametrize("job", XLA_JOBS)
def test_xla_fit_matches_single_process(job, tmp_path_factory):
    parts = scenario(job, "xla_fit", tmp_path_factory)
    ref = single("xla_fit", tmp_path_factory)
    assert_compiled_by_xla(ref, "one process")
    for w, part in enumerate(parts):
        assert_compiled_by_xla(part, f"{job} worker {w}")
    assert_same_on_workers(parts, "final")
    assert_close(parts[0]["final"], ref["final"], what="weights after an XLA fit vs one process")
    for w, part in enumerate(parts):
        for key in ("loss", "accuracy"):
            np.testing.assert_allclose(part["history"][key], ref["history"][key], rtol=1e-5,
                                       err_msg=f"{job} worker {w} {key}")


@pytest.mark.parametrize("job", XLA_JOBS)
def test_xla_custom_loop_matches_single_process(job, tmp_path_factory):
    parts = scenario(job, "xla_custom_loop", tmp_path_factory)
    ref = single("xla_custom_loop", tmp_path_factory)
    assert_compiled_by_xla(ref, "one process")
    assert len(ref["losses"]) == 6  # 96 examples, global batch 16
    for w, part in enumerate(parts):
        assert_compiled_by_xla(part, f"{job} worker {w}")
    assert_same_on_workers(parts, "final")
    assert_same_on_workers(parts, "losses")
    assert_close(parts[0]["final"], ref["final"], what="custom-loop weights vs one process")
    np.testing.assert_allclose(parts[0]["losses"], ref["losses"], rtol=1e-5)
