"""`tfdist-install-horovod`: build Horovod 0.28.1 against this environment's TensorFlow and install it.

```bash
pip install '/path/to/tfdist[cpu]'        # tfdist and TensorFlow 2.16 to 2.21 (CPU)
tfdist-install-horovod                    # Horovod into the same environment (no root)
tfdist-install-horovod --dry-run          # what it would do
python -m tfdist.horovod_build.install          # the same command
python tfdist/horovod_build/install.py          # the same, before tfdist itself is installed
```

`pip install horovod==0.28.1` cannot build against TensorFlow 2.21. This command installs into
the environment of the Python running it (`sys.executable`):

1. It finds the installed TensorFlow (from `tfdist[cpu]` or `tfdist[gpu]`), builds with MPI as
   well as Gloo where an MPI compiler (`mpicxx`) is on the PATH, and notes the GPU stack.
2. It reuses the wheel cached in `$TFDIST_CACHE/wheels/horovod-0.28.1-tf<TF>-cp<py>-p<patches>[-mpi]/`
   (default `~/.cache/tfdist`; scripts/bootstrap.sh uses the same cache; `<patches>` is a digest
   of the patch set, so a wheel built with other patches is not reused), or builds one from the
   PyPI sdist (once, about 10 minutes), with `--no-build-isolation`,
   `CMAKE_POLICY_VERSION_MINIMUM=3.5` (CMake 4 rejects the vendored Gloo otherwise) and the
   patches in tfdist/horovod_build/patches/ applied to the sdist (docs/INSTALL.md lists them: without
   `xla_mpi_ops.cc`, which does not compile against TF 2.21's XLA headers, and Keras 3 support).
   With the GPU stack (`tensorflow[and-cuda]`, or `--gpu yes`) it builds Horovod's NCCL operations
   too, cached apart (`...-nccl`): see `cuda_toolkit()` and docs/GPU.md.
3. It installs the wheel and Horovod's runtime dependencies with this Python's pip, then checks
   that `horovodrun -cb` lists TensorFlow and Gloo (and MPI when built with it).

Without network (a compute node): `--wheelhouse DIR` installs the wheel that scripts/wheelhouse.py
put in DIR/wheels/ (the cache's layout) and its runtime dependencies from DIR (`pip --no-index`);
it never builds or downloads.

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
import tempfile
import time

# Run by path (`python tfdist/horovod_build/install.py`) the toolchain is a sibling file, not a tfdist module.
if __package__:
    from tfdist.horovod_build import toolchain
    from tfdist.horovod_build import versions
else:  # run as a file (tests/test_install_horovod.py runs it so): its folder holds the toolchain
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import toolchain
    import versions

TF_DISTRIBUTIONS = ("tensorflow-cpu", "tensorflow")  # tfdist[cpu], tfdist[gpu]
RUNTIME_REQUIREMENTS = ("cffi>=1.4.0", "cloudpickle", "psutil", "pyyaml", "packaging")
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
    patches: list = dataclasses.field(default_factory=list)  # the patch files this build applies
    patch_digest: str = ""  # of their names and contents when planned (toolchain.patches_digest)
    mpi_choice: str = "auto"  # --mpi as asked: auto, yes or no

    @property
    def toolkit_dir(self):
        """The CUDA toolkit folder assembled for NCCL builds (links into the wheels; see toolchain.cuda_toolkit())."""
        return os.path.join(self.cache_root, "cuda-toolkit-13.0-nccl")

    @property
    def wheel_dir(self):
        features = ("-mpi" if self.mpi else "") + ("-nccl" if self.nccl else "")
        patches = f"-p{self.patch_digest}" if self.patch_digest else ""
        return os.path.join(self.cache_root, "wheels", f"horovod-{toolchain.HOROVOD_VERSION}-tf{self.tf_version}-"
                                                       f"{self.python_tag}{patches}{features}")

    def features(self):
        """What `horovodrun -cb` must list for this build."""
        return ["TensorFlow", "Gloo"] + (["MPI"] if self.mpi else []) + (["NCCL"] if self.nccl else [])

    def build_env(self, jobs):
        """The variables Horovod's setup.py and CMake read for this build."""
        env = {"CMAKE_POLICY_VERSION_MINIMUM": "3.5", "MAKEFLAGS": f"-j{jobs}",
               "HOROVOD_WITH_TENSORFLOW": "1", "HOROVOD_WITH_GLOO": "1",
               "HOROVOD_WITHOUT_PYTORCH": "1", "HOROVOD_WITHOUT_MXNET": "1",
               ("HOROVOD_WITH_MPI" if self.mpi else "HOROVOD_WITHOUT_MPI"): "1"}
        env.update(toolchain.nccl_build_env(self))
        return env


def make_plan(cache_root=None, mpi="auto", tf=None, mpicxx=None, gpu_stack=None, gpu="auto", patch_dir=None):
    """Detect TensorFlow, MPI and the GPU stack in this environment (each overridable for tests).

    gpu: auto (NCCL where the GPU stack is installed), yes (NCCL, required), no (never NCCL);
    patch_dir: where the patch files are (default tfdist/horovod_build/patches)."""
    notes = []
    if tf is None:
        found = [(name, toolchain.installed_version(name)) for name in TF_DISTRIBUTIONS]
        found = [(name, version) for name, version in found if version]
        if not found:
            raise toolchain.InstallError(
                f"TensorFlow is not installed for {sys.executable}. Install tfdist with its "
                f"TensorFlow first: `pip install '<tfdist checkout or wheel>[cpu]'` ([gpu] for "
                f"tensorflow[and-cuda]), then run `{toolchain.PROG}` again.")
        tf = found[0]
    if not versions.tf_in_range(tf[1]):
        notes.append(f"TensorFlow {tf[1]} is outside tfdist's tested range, {versions.RANGE_TEXT} "
                     "(docs/INSTALL.md, Versions): building against it anyway")
    mpicxx = shutil.which("mpicxx") if mpicxx is None else mpicxx
    if mpi == "yes" and not mpicxx:
        raise toolchain.InstallError(
            "--mpi yes: no `mpicxx` on the PATH. Install an MPI with its compiler wrappers (Debian: "
            "`apt-get install openmpi-bin libopenmpi-dev`; in a checkout `bash scripts/bootstrap.sh "
            "--with-mpi`), or use --mpi auto to build with Gloo only.")
    with_mpi = mpi == "yes" or (mpi == "auto" and bool(mpicxx))
    if mpi == "auto" and not mpicxx:
        notes.append("no `mpicxx` on the PATH: building with Gloo only (tfdist-run's default launcher "
                     "needs no MPI; install Open MPI and run this again for mpirun jobs and Adasum)")
    gpu_stack = toolchain.installed_version(toolchain.GPU_STACK_MARKER) is not None if gpu_stack is None else gpu_stack
    if gpu == "yes" and not gpu_stack:
        raise toolchain.InstallError(f"--gpu yes: {toolchain.GPU_STACK_MARKER} is not installed; install the GPU stack first "
                           "(`pip install 'tensorflow[and-cuda]==2.21.0'`, tfdist[gpu]), or use --gpu auto")
    nccl = gpu == "yes" or (gpu == "auto" and gpu_stack)
    if gpu_stack and not nccl:
        notes.append("--gpu no: Horovod without NCCL; GPU tensors are reduced by Gloo/MPI through host memory")
    python_tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    patches = toolchain.source_patches(nccl, patch_dir)
    return Plan(tf[0], tf[1], python_tag, with_mpi, mpicxx or "", gpu_stack, nccl,
                cache_root or toolchain.default_cache(), notes, patches, toolchain.patches_digest(patches), mpi)


def cached_wheel(plan):
    wheels = sorted(glob.glob(os.path.join(plan.wheel_dir, f"horovod-{toolchain.HOROVOD_VERSION}-*.whl")))
    return wheels[-1] if wheels else None


def build(plan, jobs):
    """Build the patched wheel into plan.wheel_dir; returns its path."""
    toolchain.check_build_tools(plan)
    toolchain.ensure_build_requirements()
    sdist = toolchain.download_sdist(plan.cache_root)
    os.makedirs(os.path.dirname(plan.wheel_dir), exist_ok=True)
    work = tempfile.mkdtemp(prefix="tfdist-horovod-")
    out = tempfile.mkdtemp(prefix=os.path.basename(plan.wheel_dir) + ".tmp-", dir=os.path.dirname(plan.wheel_dir))
    try:
        src = toolchain.unpack_sdist(sdist, work)
        applied = toolchain.patch_sdist(src, plan.patches)
        toolchain.say(f"applied {len(applied)} patches to the sdist: {', '.join(applied)}")
        if plan.nccl:
            toolchain.cuda_toolkit(plan)
        env = {**os.environ, **plan.build_env(jobs)}
        toolchain.pip(["wheel", "-q", "--no-build-isolation", "--no-deps", "-w", out, "."], cwd=src, env=env)
        (wheel,) = glob.glob(os.path.join(out, "horovod-*.whl"))
        if plan.nccl:
            wheel = toolchain.set_nccl_runpath(wheel, work, plan.toolkit_dir)
        os.makedirs(plan.wheel_dir, exist_ok=True)
        target = os.path.join(plan.wheel_dir, os.path.basename(wheel))
        os.replace(wheel, target)
        return target
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)


def install(wheel, wheelhouse=None):
    """pip-install the wheel and Horovod's runtime dependencies (from `wheelhouse` only, if given)."""
    source = ["--no-index", "--find-links", wheelhouse] if wheelhouse else []
    toolchain.pip(["install", "-q", *source, "--no-deps", "--force-reinstall", wheel])
    toolchain.pip(["install", "-q", *source, *RUNTIME_REQUIREMENTS])


def wheelhouse_plan(plan):
    """The plan whose wheel the wheelhouse holds: with --mpi auto, the MPI build where this node has
    no mpicxx, or the Gloo-only one where it has, if that is the only one there (a compute node
    often loads its MPI module only in jobs). Raises InstallError naming the folder otherwise."""
    if cached_wheel(plan):
        return plan
    other = dataclasses.replace(plan, mpi=not plan.mpi)
    if plan.mpi_choice == "auto" and cached_wheel(other):
        other.notes.append(f"the wheelhouse holds the {'MPI' if other.mpi else 'Gloo-only'} build: using it")
        return other
    there = sorted(os.path.basename(d) for d in glob.glob(os.path.join(plan.cache_root, "wheels", "horovod-*")))
    raise toolchain.InstallError(
        f"--wheelhouse: no Horovod wheel for this environment in {plan.wheel_dir}/; the wheelhouse holds "
        f"{', '.join(there) or 'none'}. Make one for TensorFlow {plan.tf_version} and Python {plan.python_tag} "
        "(scripts/wheelhouse.py --python X.Y --tensorflow ...) and install that TensorFlow from it.")


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
        raise toolchain.InstallError(f"horovodrun is not in {sysconfig.get_path('scripts')} after the install")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run([horovodrun, "-cb"], capture_output=True, text=True, env=env, timeout=900)
    listed = re.findall(r"\[X\]\s+(\w+)", out.stdout)
    missing = [feature for feature in plan.features() if feature not in listed]
    if out.returncode or missing:
        raise toolchain.InstallError(
            f"`{horovodrun} -cb` (exit {out.returncode}) does not list {', '.join(missing) or 'anything'}:\n"
            f"{out.stdout}{out.stderr[-2000:]}\nRebuild with `{toolchain.PROG} --rebuild`.")
    return list(dict.fromkeys(listed))


def describe(plan):
    mpi = f"yes ({plan.mpicxx or 'the wheelhouse build; no mpicxx here'})" if plan.mpi else "no"
    gpu = ("tensorflow[and-cuda]" + (", NCCL" if plan.nccl else ", without NCCL")) if plan.gpu_stack else "no"
    return (f"TensorFlow {plan.tf_version} ({plan.tf_distribution}), Python {plan.python_tag}, "
            f"MPI: {mpi}, GPU stack: {gpu}; target environment: {sys.prefix} ({sys.executable})")


def run(args):
    start = time.monotonic()
    plan = make_plan(args.wheelhouse or args.cache, args.mpi, gpu=args.gpu)
    if args.wheelhouse:
        plan = wheelhouse_plan(plan)
    toolchain.say(describe(plan))
    for note in plan.notes:
        toolchain.say(f"note: {note}")
    wheel = None if args.rebuild else cached_wheel(plan)
    if args.dry_run:
        action = f"reuse the cached wheel {wheel}" if wheel else f"build a wheel into {plan.wheel_dir}/"
        toolchain.say(f"would {action}, install it, and check that horovodrun -cb lists {', '.join(plan.features())}")
        if not wheel:
            toolchain.say("build settings: " + " ".join(f"{k}={v}" for k, v in plan.build_env(args.jobs).items()))
            toolchain.say("patches: " + ", ".join(os.path.basename(path) for path in plan.patches))
        return 0
    if wheel:
        toolchain.say(f"reusing the cached wheel {wheel} (no rebuild)")
        source = "the cached wheel"
    elif args.cache_only or args.wheelhouse:
        raise toolchain.InstallError(f"--cache-only: no cached wheel in {plan.wheel_dir}/; run `{toolchain.PROG}` without "
                           "--cache-only to build one (about 10 minutes, once)")
    else:
        toolchain.say(f"no cached wheel in {plan.wheel_dir}/: building Horovod {toolchain.HOROVOD_VERSION} from its sdist "
            "(once; about 10 minutes on 2 cores)")
        began = time.monotonic()
        wheel = build(plan, args.jobs)
        toolchain.say(f"built {wheel} in {time.monotonic() - began:.0f}s")
        source = "a new build"
    began = time.monotonic()
    install(wheel, args.wheelhouse)
    toolchain.say(f"installed {os.path.basename(wheel)} into {sys.prefix} in {time.monotonic() - began:.1f}s")
    checked = ""
    if not args.no_verify:
        verify(plan)
        checked = f"; `horovodrun -cb` confirms {', '.join(plan.features())}"
    toolchain.say(f"done in {time.monotonic() - start:.0f}s: Horovod {toolchain.HOROVOD_VERSION} with {', '.join(plan.features())} "
        f"from {source}{checked}. Try: tfdist-run -np 2 python train.py")
    return 0


def main(argv=None):
    startup = sys.modules.get("tfdist.tuning.startup")  # `python -m tfdist.horovod_build.install` imported tfdist
    if startup is not None:
        startup.undo()  # no per-rank tuning or core pinning for the compiler and pip
    parser = argparse.ArgumentParser(allow_abbrev=False,
        prog=toolchain.PROG, description=__doc__.splitlines()[0].split(": ", 1)[1],
        epilog="The wheel cache is shared with scripts/bootstrap.sh; see README.md, "
               "'Install into your own environment'.")
    parser.add_argument("--cache", metavar="DIR", default=None,
                        help="cache folder (default: $TFDIST_CACHE or ~/.cache/tfdist); wheels go in DIR/wheels")
    parser.add_argument("--mpi", choices=("auto", "yes", "no"), default="auto",
                        help="build with MPI too: auto (where mpicxx is on the PATH), yes (required), no")
    parser.add_argument("--gpu", choices=("auto", "yes", "no"), default="auto",
                        help="build Horovod's NCCL operations: auto (where tensorflow[and-cuda] is installed), "
                             "yes (required), no; the NCCL wheel is cached apart (-nccl)")
    parser.add_argument("--wheelhouse", metavar="DIR", default=None,
                        help="without network: install the Horovod wheel of the wheelhouse DIR (made by "
                             "scripts/wheelhouse.py) and its dependencies from DIR only; never builds")
    parser.add_argument("--rebuild", action="store_true", help="build even if a cached wheel exists")
    parser.add_argument("--cache-only", action="store_true",
                        help="never build: fail unless a cached wheel exists")
    parser.add_argument("--no-verify", action="store_true", help="skip the `horovodrun -cb` check")
    parser.add_argument("--dry-run", action="store_true", help="say what would be done, do nothing")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    parser.add_argument("-j", "--jobs", type=int, default=cpus, help="parallel compile jobs (default: %(default)s)")
    args = parser.parse_args(argv)
    args.wheelhouse = args.wheelhouse and os.path.abspath(args.wheelhouse)
    if args.rebuild and (args.cache_only or args.wheelhouse):
        parser.error(f"--rebuild and {'--cache-only' if args.cache_only else '--wheelhouse'} contradict each other")
    if args.wheelhouse and args.cache:
        parser.error("--wheelhouse DIR is the cache folder: leave out --cache")
    try:
        return run(args)
    except toolchain.InstallError as e:
        print(f"{toolchain.PROG}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
