"""The cached GPU (NCCL) Horovod wheel, where one has been built (docs/GPU.md); skips otherwise.

No GPU is needed: the checks read the wheel's TensorFlow library (ELF dynamic section and imports),
so they run in the CPU test venv too. A GPU venv, if given as TFDIST_GPU_VENV, is asked as well."""

import glob
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from tfdist.horovod_build import toolchain

PY = f"cp{sys.version_info[0]}{sys.version_info[1]}"
WHEEL_GLOB = os.path.join(toolchain.default_cache(), "wheels", f"horovod-{toolchain.HOROVOD_VERSION}-tf2.21.*-{PY}*-nccl",
                          f"horovod-{toolchain.HOROVOD_VERSION}-*.whl")


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    wheels = sorted(glob.glob(WHEEL_GLOB))
    if not wheels:
        pytest.skip(f"no GPU Horovod wheel cached ({WHEEL_GLOB}); build one with "
                    "`tfdist-install-horovod` in a tensorflow[and-cuda] environment (docs/GPU.md)")
    if not (shutil.which("readelf") and shutil.which("nm")):
        pytest.skip("readelf/nm (binutils) not installed")
    out = tmp_path_factory.mktemp("gpu-wheel")
    with zipfile.ZipFile(wheels[-1]) as whl:
        (name,) = [n for n in whl.namelist() if n.startswith("horovod/tensorflow/mpi_lib") and n.endswith(".so")]
        return whl.extract(name, out)


def test_cached_gpu_wheel_is_built_with_nccl(library):
    dynamic = subprocess.run(["readelf", "-d", library], capture_output=True, text=True, check=True).stdout
    assert "[libnccl.so.2]" in dynamic  # linked to the nvidia-nccl-cu12 wheel's library ...
    assert toolchain.NCCL_RUNPATH in dynamic  # ... found where that wheel installs it, in any environment
    assert "cuda-toolkit" not in dynamic  # no build folder left in the RUNPATH
    imports = subprocess.run(["nm", "-D", "--undefined-only", library], capture_output=True, text=True,
                             check=True).stdout.split()
    for symbol in ("ncclAllReduce", "ncclAllGather", "ncclBroadcast", "ncclCommInitRank", "cudaMemcpyAsync"):
        assert symbol in imports, symbol
    exports = subprocess.run(["nm", "-D", "--defined-only", library], capture_output=True, text=True,
                             check=True).stdout
    assert "horovod_nccl_built" in exports


def test_gpu_venv_reports_nccl():
    venv = os.environ.get("TFDIST_GPU_VENV")
    if not venv:
        pytest.skip("TFDIST_GPU_VENV (a tensorflow[and-cuda] venv with the NCCL Horovod) not set")
    code = "import horovod.tensorflow as hvd; print(bool(hvd.nccl_built()), hvd.cuda_built())"
    out = subprocess.run([os.path.join(venv, "bin", "python"), "-c", code], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert out.stdout.split() == ["True", "True"], out.stderr[-2000:]
