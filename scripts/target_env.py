"""Fresh environments for one target (a Python version and a TensorFlow), as a pip user makes them.

Shared by scripts/version_matrix.py (a venv per cell) and scripts/wheelhouse.py (the venv that
builds Horovod for a wheelhouse). Standard library only; it runs with any Python 3.10+.

```python
import target_env
python = target_env.find_python("3.12")          # python3.12 on the PATH, else pyenv's
wheel = target_env.build_tfdist_wheel(src, out)  # tfdist's wheel from a checkout
venv = target_env.make_venv(python, "/tmp/v")    # a new venv with pip, setuptools<81, wheel
```
"""

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Notes this machine's extra local pip indexes print for every package: not worth showing.
PIP_NOISE = "is ignored: it is neither a file nor a directory"


class TargetError(Exception):
    """A step of making the environment failed; the message says which and why."""


def tfdist_module(name):
    """A standard-library-only module of the checkout's tfdist/horovod_build/ (versions, install), loaded
    by path as tfdist-install-horovod runs before tfdist is installed: no `import tfdist`, whose
    start-up tunes this process's threads."""
    folder = os.path.join(ROOT, "tfdist", "horovod_build")
    if folder not in sys.path:
        sys.path.insert(0, folder)  # install imports its siblings so when run by path
    spec = importlib.util.spec_from_file_location(name, os.path.join(folder, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def find_python(version):
    """The interpreter for `version` ("3.12"): python3.12 on the PATH, else pyenv's newest 3.12.x.

    A path to an interpreter is taken as it is."""
    if os.sep in version:
        if not os.access(version, os.X_OK):
            raise TargetError(f"--python {version}: not an executable")
        return version
    if not re.fullmatch(r"3\.\d+", version):
        raise TargetError(f"Python version {version!r}: expected MAJOR.MINOR (3.12) or a path to an interpreter")
    pyenv = os.path.join(os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv")), "versions")
    candidates = sorted(glob.glob(os.path.join(pyenv, f"{version}.*", "bin", f"python{version}")),
                        key=lambda p: [int(x) for x in re.findall(r"\d+", p.split(os.sep)[-3])])
    # the PATH's first, where it runs (a pyenv shim of a version not selected exits 127)
    for found in filter(None, [shutil.which(f"python{version}"), *reversed(candidates)]):
        if subprocess.run([found, "-c", ""], capture_output=True).returncode == 0:
            return found
    raise TargetError(f"no Python {version}: neither python{version} on the PATH nor {pyenv}/{version}.*; "
                      f"install it (pyenv install {version}, or your distribution's python{version}-venv)")


def python_version(python):
    """"3.12.1" of an interpreter."""
    out = subprocess.run([python, "-c", "import platform; print(platform.python_version())"],
                         capture_output=True, text=True)
    if out.returncode:
        raise TargetError(f"{python} does not run (exit {out.returncode}): {out.stderr.strip()[-300:]}")
    return out.stdout.strip()


def run(command, log=None, env=None, cwd=None, timeout=None):
    """Run `command`, its output appended to the file `log`; returns (exit code, output tail).

    No time limit unless asked: on a shared 2-core machine a Horovod build took over an hour."""
    began = time.monotonic()
    try:
        proc = subprocess.run([str(c) for c in command], capture_output=True, text=True, env=env, cwd=cwd,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise TargetError(f"`{' '.join(map(str, command[:3]))} ...` did not end within {timeout} s") from None
    output = "\n".join(line for line in (proc.stdout + proc.stderr).splitlines() if PIP_NOISE not in line)
    if log:
        with open(log, "a") as f:
            f.write(f"$ {' '.join(map(str, command))}\n{output}\n[exit {proc.returncode} after "
                    f"{time.monotonic() - began:.0f}s]\n")
    return proc.returncode, output[-4000:]


def checked(command, what, log=None, **kwargs):
    """run(), raising TargetError naming `what` and the error's last lines when it fails."""
    code, tail = run(command, log, **kwargs)
    if code:
        lines = [line for line in tail.splitlines() if line.strip()]
        reason = next((line for line in reversed(lines) if line.startswith("ERROR")), lines[-1] if lines else "")
        raise TargetError(f"{what} failed (exit {code}): {reason.strip()}")
    return tail


def snapshot(dest):
    """Copy the checkout's files (tracked and untracked, not ignored) to `dest`: later edits to the
    checkout do not reach a run that takes minutes per step. Returns the commit it started from."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\0")
    shutil.rmtree(dest, ignore_errors=True)
    for name in filter(None, files):
        source = os.path.join(ROOT, name)
        if os.path.isfile(source):
            os.makedirs(os.path.dirname(os.path.join(dest, name)), exist_ok=True)
            shutil.copy2(source, os.path.join(dest, name))
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
    return head.strip() + ("+changes" if dirty.strip() else "")


def build_tfdist_wheel(src, out, log=None):
    """tfdist's wheel, built from the checkout `src` into `out`; returns its path."""
    os.makedirs(out, exist_ok=True)
    for old in glob.glob(os.path.join(out, "tfdist-*.whl")):
        os.remove(old)
    shutil.rmtree(os.path.join(src, "build"), ignore_errors=True)  # setuptools would reuse stale build/lib files
    checked([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out, src],
            "building tfdist's wheel", log)
    shutil.rmtree(os.path.join(src, "build"), ignore_errors=True)
    (wheel,) = glob.glob(os.path.join(out, "tfdist-*.whl"))
    return wheel


def make_venv(python, path, log=None):
    """A new venv at `path` (an old one there is removed) with pip, setuptools<81 (Horovod's
    setup.py needs pkg_resources' neighbours) and wheel; returns its python."""
    shutil.rmtree(path, ignore_errors=True)
    checked([python, "-m", "venv", path], f"creating a venv with {python}", log)
    venv_python = os.path.join(path, "bin", "python")
    checked([venv_python, "-m", "pip", "install", "-q", "--upgrade", "pip", "setuptools<81", "wheel"],
            "upgrading pip in the new venv", log)
    return venv_python


def clean_env(venv_python, **extra):
    """os.environ for commands in the venv of `venv_python`: its bin/ first, no other venv's or
    tfdist's or Horovod's variables, TensorFlow's C++ log quiet."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "VIRTUAL_ENV", "TFDIST_STARTUP", "HOROVOD_", "OMPI_"))}
    bin_dir = os.path.dirname(venv_python)
    env.update(PATH=f"{bin_dir}:{env.get('PATH', '')}", VIRTUAL_ENV=os.path.dirname(bin_dir),
               TF_CPP_MIN_LOG_LEVEL="2", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_ROOT_USER_ACTION="ignore")
    env.update(extra)
    return env


def installed(venv_python, *names):
    """{distribution: version or None} in the venv of `venv_python`."""
    code = ("import sys\nfrom importlib import metadata\nfor n in sys.argv[1:]:\n"
            "    try: print(n, metadata.version(n))\n    except metadata.PackageNotFoundError: print(n, '-')\n")
    out = subprocess.run([venv_python, "-c", code, *names], capture_output=True, text=True, check=True).stdout
    return {name: (None if version == "-" else version) for name, version in (line.split() for line in out.splitlines())}


def horovod_wheel(venv_python, *args, log=None):
    """Run tfdist-install-horovod in the venv (its build or cached wheel, with `args`); returns
    (the cached wheel's path, seconds it built for, or None when it reused a cached wheel)."""
    tail = checked([os.path.join(os.path.dirname(venv_python), "tfdist-install-horovod"), *args],
                   "tfdist-install-horovod", log, env=clean_env(venv_python))
    built = re.search(r"built (\S+\.whl) in (\d+)s", tail)
    if built:
        return built.group(1), int(built.group(2))
    reused = re.search(r"reusing the cached wheel (\S+\.whl)", tail)
    if not reused:
        raise TargetError(f"tfdist-install-horovod said neither `built` nor `reusing`:\n{tail[-1500:]}")
    return reused.group(1), None


def machine():
    """lscpu's model name, cores and the date: recorded with every measured result."""
    model = "unknown CPU"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = re.search(r"Model name:\s*(.+)", out).group(1).strip()
    except (OSError, AttributeError):
        pass
    return {"cpu": model, "cores": len(os.sched_getaffinity(0)), "date": time.strftime("%Y-%m-%d")}
