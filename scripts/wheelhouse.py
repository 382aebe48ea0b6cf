"""Make a wheelhouse: every wheel a compute node without network needs to install tfdist and train.

On a machine with internet (a login node; no GPU needed, also for the GPU stack), from a checkout:

    python3 scripts/wheelhouse.py --out ~/wheelhouse                    # CPU stack, Python 3.11, TF 2.21.0
    python3 scripts/wheelhouse.py --out DIR --python 3.12 --tensorflow 2.18 --legacy
    python3 scripts/wheelhouse.py --out DIR --stack gpu                 # tensorflow[and-cuda], NCCL Horovod

Then on the compute node (same CPU architecture and Linux; its Python of the same version):

    python3.11 -m venv ~/tfdist-env && . ~/tfdist-env/bin/activate
    pip install --no-index --find-links DIR 'tfdist[cpu]'
    tfdist-install-horovod --wheelhouse DIR

DIR gets tfdist's wheel (built from this checkout), TensorFlow's (and its CUDA wheels for the GPU
stack), tf-keras's with --legacy, every dependency (`pip download` with the target Python), and
Horovod built for that TensorFlow and Python by `tfdist-install-horovod` in a venv of the target
(the same build and cache, ~/.cache/tfdist/wheels, as every install: a cached build is reused)
in DIR/wheels/<the cache folder's name>/. Before it ends it installs both ways from DIR alone with
pip's index disabled, in that venv, so a wheelhouse it reports as made is complete. It writes
DIR/INSTALL.txt with the commands above for its target.

Why a script here rather than a tfdist command: it builds tfdist's own wheel from the checkout
(an installed tfdist has none to copy) and runs once per cluster and target, on the login node.
"""

import argparse
import glob
import os
import shutil
import sys
import time

import target_env
from target_env import TargetError

VERSIONS = target_env.tfdist_module("versions")
RUNTIME_REQUIREMENTS = target_env.tfdist_module("install").RUNTIME_REQUIREMENTS  # Horovod's, for its install


def requirements(wheel, args):
    """What the compute node installs: tfdist with the stack's extra, TensorFlow held to the target."""
    extras = args.stack + (",legacy" if args.legacy else "")
    tf_name = "tensorflow-cpu" if args.stack == "cpu" else "tensorflow[and-cuda]"
    pin = f"=={args.tensorflow}.*" if args.tensorflow.count(".") == 1 else f"=={args.tensorflow}"
    wanted = [f"{wheel}[{extras}]", f"{tf_name}{pin}"]
    if args.legacy:
        wanted.append(f"tf-keras=={'.'.join(args.tensorflow.split('.')[:2])}.*")
    return wanted


def make(args):
    began = time.monotonic()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    log = os.path.join(out, "wheelhouse.log")
    say = lambda message: print(f"wheelhouse: {message}", flush=True)  # noqa: E731
    python = target_env.find_python(args.python)
    version = target_env.python_version(python)
    say(f"target: {args.stack.upper()} stack, Python {version} ({python}), TensorFlow {args.tensorflow}"
        f"{', tf-keras' if args.legacy else ''}; into {out} (log: {log})")
    dist = os.path.join(args.work, f"dist-{args.stack}-py{args.python}")  # apart: wheelhouses made side by side
    wheel = target_env.build_tfdist_wheel(target_env.ROOT, dist, log)
    venv = target_env.make_venv(python, os.path.join(args.work, f"venv-{args.stack}-py{args.python}"), log)
    wanted = requirements(wheel, args)
    step = time.monotonic()
    target_env.checked([venv, "-m", "pip", "download", "-q", "-d", out, *wanted, *RUNTIME_REQUIREMENTS],
                       "pip download", log)
    say(f"downloaded tfdist[{wanted[0].split('[')[1]} and its dependencies in {time.monotonic() - step:.0f} s")
    local = [os.path.join(out, os.path.basename(wheel)) + "[" + wanted[0].split("[", 1)[1], *wanted[1:]]
    step = time.monotonic()
    target_env.checked([venv, "-m", "pip", "install", "-q", "--no-index", "--find-links", out, *local],
                       "installing from the wheelhouse alone (pip --no-index)", log)
    say(f"installed tfdist and TensorFlow from {out} alone (pip --no-index) in {time.monotonic() - step:.0f} s")
    gpu = "yes" if args.stack == "gpu" else "no"
    step = time.monotonic()
    horovod, built = target_env.horovod_wheel(venv, "--mpi", args.mpi, "--gpu", gpu, "-j", str(args.jobs), log=log)
    say(f"Horovod: {'built in %d s' % built if built else 'the cached build'} ({horovod}), "
        f"{time.monotonic() - step:.0f} s")
    folder = os.path.join(out, "wheels", os.path.basename(os.path.dirname(horovod)))
    shutil.rmtree(os.path.join(out, "wheels"), ignore_errors=True)  # one Horovod per wheelhouse: its target's
    os.makedirs(folder)
    shutil.copy2(horovod, folder)
    target_env.checked([os.path.join(os.path.dirname(venv), "tfdist-install-horovod"), "--wheelhouse", out,
                        "--mpi", args.mpi, "--gpu", gpu], "tfdist-install-horovod --wheelhouse", log,
                       env=target_env.clean_env(venv, PIP_NO_INDEX="1"))
    say("installed Horovod from the wheelhouse alone (tfdist-install-horovod --wheelhouse; `horovodrun -cb` checked)")
    write_instructions(out, args, version, os.path.relpath(folder, out))
    files = glob.glob(os.path.join(out, "**", "*.whl"), recursive=True)
    size = sum(os.path.getsize(f) for f in files) / 2**30
    say(f"made {out}: {len(files)} wheels, {size:.2f} GiB, in {time.monotonic() - began:.0f} s "
        f"({target_env.machine()['cpu']}, {target_env.machine()['date']}); see {out}/INSTALL.txt")
    return 0


def write_instructions(out, args, version, horovod_folder):
    extras = args.stack + (",legacy" if args.legacy else "")
    minor = ".".join(version.split(".")[:2])
    text = f"""A tfdist wheelhouse made by scripts/wheelhouse.py on {target_env.machine()['date']}.
Target: {args.stack.upper()} stack, Python {minor}, TensorFlow {args.tensorflow}; Horovod in {horovod_folder}/.
Install on a machine without network (same CPU architecture and Linux, Python {minor}):

    python{minor} -m venv ~/tfdist-env && . ~/tfdist-env/bin/activate
    pip install --no-index --find-links {out} 'tfdist[{extras}]'
    tfdist-install-horovod --wheelhouse {out}
    tfdist-run -np 2 python train.py

(The folder may move: use its new path in both commands.)
"""
    with open(os.path.join(out, "INSTALL.txt"), "w") as f:
        f.write(text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--out", required=True, help="the wheelhouse folder (created; its wheels are kept)")
    parser.add_argument("--stack", choices=("cpu", "gpu"), default="cpu",
                        help="cpu: tensorflow-cpu; gpu: tensorflow[and-cuda] and Horovod with NCCL (default: cpu)")
    parser.add_argument("--python", default="3.11", help="the target's Python, X.Y or a path (default: %(default)s)")
    parser.add_argument("--tensorflow", default=VERSIONS.PINNED_TF,
                        help="TensorFlow X.Y (newest X.Y.*) or X.Y.Z within tfdist's range (default: %(default)s)")
    parser.add_argument("--legacy", action="store_true", help="also tf-keras (TF_USE_LEGACY_KERAS=1)")
    parser.add_argument("--mpi", choices=("auto", "yes", "no"), default="auto",
                        help="Horovod with MPI: auto (where mpicxx is on this machine's PATH), yes, no; "
                             "an MPI build needs the same MPI library on the compute node (default: auto)")
    parser.add_argument("--work", default=os.path.join(os.environ.get("TFDIST_CACHE") or
                                                       os.path.expanduser("~/.cache/tfdist"), "wheelhouse-work"),
                        help="the build venv and tfdist's wheel (default: %(default)s)")
    cpus = len(os.sched_getaffinity(0))
    parser.add_argument("-j", "--jobs", type=int, default=cpus, help="compile jobs (default: %(default)s)")
    args = parser.parse_args(argv)
    if not VERSIONS.tf_in_range(args.tensorflow):
        parser.error(f"--tensorflow {args.tensorflow}: outside tfdist's range, {VERSIONS.RANGE_TEXT}")
    try:
        return make(args)
    except TargetError as e:
        print(f"wheelhouse: error: {e} (log: {os.path.join(os.path.abspath(args.out), 'wheelhouse.log')})",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
