"""compression="bf16" on 4 MPI ranks, and its refusals.

The other bfloat16 allreduce checks run inside launches the suite makes anyway: 2 Gloo ranks in
the compression launches (test_compression.py), 2 and 4 in the clipping ones (test_clipping.py),
2 MPI ranks in test_mpi.py. Here: a 4-rank mpirun of tests/multirank/bf16_checks.py, every
bfloat16 result compared bit for bit with numpy's (tests/bf16_reference.py); a Horovod built
without tfdist's bfloat16 patch (the cached wheel of an older patch set, where one exists) refused
by name; `op="adasum"` with bf16 refused before Horovod starts.
"""

import glob
import os
import subprocess
import sys
import zipfile

import pytest

import bf16_reference
from conftest import BIN, ROOT, flavor_env, run_job
from tfdist.horovod_build import toolchain

WORKER = ROOT / "tests" / "multirank" / "bf16_checks.py"
PY = f"cp{sys.version_info[0]}{sys.version_info[1]}"


@pytest.mark.multirank
def test_bf16_allreduce_on_4_mpi_ranks_is_numpys_float32_sum_rounded_once(tmp_path):
    from test_mpi import _missing_mpi

    if _missing_mpi():
        pytest.skip(_missing_mpi())
    ranks = run_job([WORKER], tmp_path, np=4, env=flavor_env("keras3"), launcher="mpirun", timeout=300)
    exchange = {r: ranks[r]["exchange"] for r in range(4)}
    assert exchange[0]["controller"] == "mpi"
    bf16_reference.check_exchange(exchange)
    # one rounding of the float32 sum, where rounding each partial sum from rank 0 on loses it
    got, pairwise = bf16_reference.once_beats_pairwise(exchange)
    assert (got, pairwise) == (1.0 + 2.0 ** -7, 1.0)


def test_adasum_with_bf16_is_refused_before_horovod_starts():
    from tfdist.strategy_options import StrategyOptions

    with pytest.raises(ValueError, match=r"op='adasum' with compression='bf16': Horovod's Adasum has no bfloat16"):
        StrategyOptions.from_arguments(compression="bf16", op="adasum")
    with pytest.raises(ValueError, match=r"compression='bf17': expected 'none', 'fp16', 'bf16'"):
        StrategyOptions.from_arguments(compression="bf17")


def _unpatched_wheel():
    """A cached Horovod wheel for this TensorFlow and Python built without the bfloat16 patch, or None."""
    pattern = os.path.join(toolchain.default_cache(), "wheels", f"horovod-{toolchain.HOROVOD_VERSION}-tf2.21.*-{PY}-p*",
                           "horovod-*.whl")
    for path in sorted(glob.glob(pattern)):
        if path.endswith("-nccl"):
            continue
        with zipfile.ZipFile(path) as wheel:
            if b"bfloat16_built" not in wheel.read("horovod/common/basics.py"):
                return path
    return None


def test_a_horovod_without_bfloat16_is_refused_naming_the_build_and_the_fix(tmp_path):
    wheel = _unpatched_wheel()
    if wheel is None:
        pytest.skip("no Horovod wheel without the bfloat16 patch in tfdist's wheel cache (one built "
                    "with an earlier patch set); this machine has only patched builds")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(tmp_path)
    code = "import tfdist; tfdist.HorovodStrategy(compression='bf16')"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run([str(BIN / "python"), "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: compression='bf16': this Horovod (0.28.1 at "), proc.stderr[-2000:]
    assert str(tmp_path) in last  # the build it found, by path
    assert "built without bfloat16 collectives (tfdist's patch 0008-bfloat16-cpu-collectives.patch" in last
    assert "Rebuild it with `tfdist-install-horovod`" in last and "compression='fp16'" in last
    assert 'strategy_options.py", line' in proc.stderr  # raised checking the arguments, before Horovod starts
