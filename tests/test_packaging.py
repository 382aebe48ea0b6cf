"""The built wheel installs one `tfdist` namespace with its console scripts, and nothing top-level else."""

import configparser
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT
from test_install_horovod import HIDE


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The project's wheel, built and installed (without dependencies) into a directory of its own."""
    base = tmp_path_factory.mktemp("packaging")
    shutil.rmtree(ROOT / "build", ignore_errors=True)  # setuptools would reuse stale build/lib files
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(base / "wheel"), str(ROOT)], check=True, capture_output=True, timeout=300)
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    (wheel,) = (base / "wheel").glob("tfdist-*.whl")
    target = base / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    return wheel, target


def run_installed(target, code):
    """Python with the installed copy first on the path, started outside the checkout."""
    env = {**os.environ, "PYTHONPATH": str(target), "TF_CPP_MIN_LOG_LEVEL": "2"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", env=env,
                          timeout=300)


def test_wheel_holds_only_the_tfdist_namespace(installed):
    wheel, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert "tfdist" in tops and all(top.endswith(".dist-info") for top in tops - {"tfdist"}), tops
    for module in ("tfdist/pipelines/reader.py", "tfdist/callbacks/checkpoint.py", "tfdist/benchmark/train_benchmark.py", "tfdist/launch/runner.py"):
        assert module in names
    # tfdist-install-horovod applies these to Horovod's sdist: an installed tfdist must carry them all
    patches = sorted(p.name for p in (ROOT / "tfdist" / "horovod_build" / "patches").glob("*.patch"))
    assert patches and sorted(n.rsplit("/", 1)[1] for n in names if n.startswith("tfdist/horovod_build/patches/")) == patches


def test_installed_package_imports_as_one_namespace(installed):
    _, target = installed
    out = run_installed(target, (
        "import importlib.util, tfdist, tfdist.pipelines, tfdist.callbacks\n"
        "print(tfdist.__file__)\n"
        "print(tfdist.pipelines.read_dataset.__module__, tfdist.callbacks.Checkpointer.__module__)\n"
        "print(tfdist.precision.__name__, tfdist.tuning.plan.__name__)\n"
        "print(importlib.util.find_spec('pipelines'), importlib.util.find_spec('callbacks'))\n"))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith(str(target))  # the installed copy, not the checkout
    assert lines[1:] == ["tfdist.pipelines.reader tfdist.callbacks.checkpoint",
                         "tfdist.precision tfdist.tuning.plan", "None None"]


def test_console_scripts_run_from_the_install(installed):
    _, target = installed
    for script, expect in (("tfdist-benchmark", "--variable_update"), ("tfdist-scaling", "--repeats"),
                           ("tfdist-data", "convert"), ("tfdist-run", "--launcher"),
                           ("tfdist-tune", "--candidates"), ("tfdist-profile", "--view"),
                           ("tfdist-predict", "--bandwidth_gbit"), ("tfdist-install-horovod", "--cache-only")):
        path = target / "bin" / script
        assert path.is_file(), script
        out = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, cwd="/",
                             env={**os.environ, "PYTHONPATH": str(target)}, timeout=300)
        assert out.returncode == 0 and expect in out.stdout, (script, out.stderr[-2000:])


def test_every_tfdist_error_derives_from_tfdist_error():
    import tfdist
    from tfdist.launch import slurm as launch
    from tfdist.launch import runner as run
    from tfdist.callbacks import CheckpointError
    from tfdist.pipelines import ManifestError, StagingError

    errors = [CheckpointError, ManifestError, StagingError, launch.LaunchError, run.UsageError,
              *(getattr(tfdist, name) for name in tfdist.__all__ if name.endswith("Error"))]
    assert all(issubclass(e, tfdist.TfdistError) for e in errors), errors
    assert issubclass(ManifestError, ValueError)  # still caught where a ValueError was
    # one class per name: the launch layout and the tuning topology are different things
    from tfdist.tuning import plan as tuning

    assert launch.TaskPlacement is not tuning.Topology and not hasattr(launch, "Topology")


def console_scripts():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = config["options.entry_points"]["console_scripts"].strip().splitlines()
    return [line.split("=")[0].strip() for line in lines]


def test_every_console_script_helps_without_tensorflow(installed):
    _, target = installed
    scripts = console_scripts()
    assert "tfdist-install-horovod" in scripts and "tfdist-data" in scripts
    for script in scripts:
        path = target / "bin" / script
        code = (f"HIDDEN = ('tensorflow', 'keras', 'tf_keras', 'horovod')\n{HIDE}\nimport runpy\n"
                f"sys.argv = [{str(path)!r}, '--help']\n"
                f"try:\n    runpy.run_path({str(path)!r}, run_name='__main__')\n"
                "except SystemExit as e:\n    print('EXIT', e.code, 'TRIED', tried)\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=120,
                             env={**os.environ, "PYTHONPATH": str(target)})
        assert "usage:" in out.stdout and "EXIT 0 TRIED []" in out.stdout, (script, out.stdout[-500:],
                                                                            out.stderr[-2000:])


def link_distributions(names, dest):
    """Link the installed distributions `names` and all they require, recursively, into `dest`.

    `names` may carry extras ("fsspec[gcs]"): their requirements are followed too. Packages are
    symlinks; each .dist-info folder is a copy without its RECORD, so a pip in the new environment
    can see these distributions but never uninstall one (through the links, that would delete the
    project environment's files): it stops with an error instead.
    """
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    dest.mkdir()
    todo, seen = [Requirement(name) for name in names], set()
    while todo:
        wanted = todo.pop()
        name = canonicalize_name(wanted.name)
        if (name, frozenset(wanted.extras)) in seen:
            continue
        seen.add((name, frozenset(wanted.extras)))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional requirement, not installed
        todo += [r for r in map(Requirement, dist.requires or [])
                 if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in ("", *wanted.extras))]
        site = Path(dist.locate_file(""))
        for top in {f.parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            if not (site / top).exists() or (dest / top).exists():
                continue
            if top.endswith(".dist-info"):
                shutil.copytree(site / top, dest / top, ignore=shutil.ignore_patterns("RECORD"))
            else:
                (dest / top).symlink_to(site / top)
    return {name for name, _ in seen}


def declared_requirements(wheel, extra):
    """The requirements the wheel's metadata declares for `pip install 'tfdist[EXTRA]'`."""
    from email.parser import Parser

    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        fields = Parser().parsestr(z.read(name).decode())
    requirements = map(Requirement, fields.get_all("Requires-Dist") or [])
    return [str(r).split(";")[0] for r in requirements if r.marker is None or r.marker.evaluate({"extra": extra})]


TRAIN = """
import os
import numpy as np
import tfdist
import keras

strategy = tfdist.HorovodStrategy()
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 8)).astype("float32")
y = (x[:, 0] + x[:, 1] > 0).astype("int32")
with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(2, activation="softmax")])
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
# Keras' own TensorBoard callback, profiling steps 2 to 4: needs tensorboard (TF 2.21 dropped it)
tensorboard = keras.callbacks.TensorBoard(log_dir="tb", profile_batch=(2, 4))
logs = model.fit(x, y, batch_size=64, epochs=5, verbose=0, callbacks=[tensorboard]).history
import horovod
print(f"RESULT rank={strategy.rank} size={strategy.size} loss={logs['loss'][-1]:.4f} "
      f"accuracy={logs['accuracy'][-1]:.3f} horovod={horovod.__file__} tfdist={tfdist.__file__}", flush=True)
if strategy.rank == 0:  # what TensorBoard will show: the scalars, and the profile through the installed plugin
    import glob
    from importlib.metadata import entry_points
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from xprof.convert import raw_to_tool_data

    events = EventAccumulator("tb/train")
    events.Reload()
    traces = glob.glob("tb/train/plugins/profile/*/*.xplane.pb")
    loaders = [e.load() for e in entry_points(group="tensorboard_plugins") if e.name == "profile"]
    plugins = [f"{loader.__module__}.{loader.__name__}" for loader in loaders]
    tools = raw_to_tool_data.xspace_to_tool_names(traces) if traces else []
    print(f"PROFILE scalars={','.join(sorted(events.Tags()['tensors']))} traces={len(traces)} "
          f"plugins={','.join(plugins)} tools={','.join(sorted(tools))}", flush=True)
"""


@pytest.mark.fresh_env
@pytest.mark.multirank
def test_fresh_environment_installs_horovod_and_trains(installed, tmp_path_factory):
    """A pip user's path: `pip install 'tfdist[cpu]'` into a new venv, `tfdist-install-horovod`, a
    2-rank `tfdist-run` whose Keras TensorBoard callback writes scalars and a profile.

    The venv is created outside the checkout. TensorFlow is not downloaded into it: tensorflow-cpu
    is about 600 MB, whose install alone would take this test's whole budget on 2 cores. Instead a
    .pth file adds a folder linking, from the project's environment, exactly what the built
    wheel's metadata declares for `tfdist[cpu]` and what that requires (its dependency closure):
    TensorFlow, tensorboard, the profile plugin; not tfdist, Horovod, pytest or anything else
    there. Then `pip install --no-index '<wheel>[cpu]'` must find every declared requirement
    installed (a requirement the linked closure lacks fails it), and `tfdist-install-horovod`
    installs Horovod and its runtime dependencies from the wheel scripts/bootstrap.sh cached
    (`--cache-only`: the test fails, rather than spending ten minutes, if it would build).
    Rank 0 reads the TensorBoard files back: the epoch scalars, and the profile of steps 2 to 4
    through the profile plugin installed with tfdist. About a minute and a half on 2 cores.
    """
    from importlib import metadata

    from tfdist.horovod_build import install as install_horovod

    wheel, _ = installed
    try:
        metadata.version("tensorflow-cpu")
        tf_dist, extra = "tensorflow-cpu", "cpu"
    except metadata.PackageNotFoundError:
        tf_dist, extra = "tensorflow", "gpu"
    # On the GPU stack the venv gets TensorFlow without its CUDA wheels: Horovod's CPU wheel.
    gpu = "no" if install_horovod.make_plan().gpu_stack else "auto"
    plan = install_horovod.make_plan(gpu=gpu)
    if install_horovod.cached_wheel(plan) is None:
        pytest.skip(f"no cached Horovod wheel in {plan.wheel_dir}: run scripts/bootstrap.sh first")
    base = tmp_path_factory.mktemp("fresh_env")
    assert ROOT not in base.parents
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=180)
    python, bin_dir = venv / "bin" / "python", venv / "bin"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "VIRTUAL_ENV", "TFDIST_STARTUP", "HOROVOD_", "OMPI_"))}
    env.update(PATH=f"{bin_dir}:{env.get('PATH', '')}", VIRTUAL_ENV=str(venv), TF_CPP_MIN_LOG_LEVEL="2")

    def run(*argv, timeout=300):
        return subprocess.run([str(a) for a in argv], capture_output=True, text=True, cwd=base, env=env,
                              timeout=timeout)

    site = run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip()
    declared = declared_requirements(wheel, extra)
    linked = link_distributions(declared, base / "declared")
    assert {tf_dist, "keras", "numpy", "tensorboard", "xprof"} <= linked and not {"tfdist", "horovod"} & linked
    (Path(site) / "declared.pth").write_text(f"{base / 'declared'}\n")
    out = run(python, "-m", "pip", "install", "-q", "--no-index", f"{wheel}[{extra}]")
    assert out.returncode == 0, out.stderr[-3000:]

    began = time.monotonic()
    out = run(bin_dir / "tfdist-install-horovod", "--cache-only", "--gpu", gpu)
    took = time.monotonic() - began
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"reusing the cached wheel {plan.wheel_dir}/" in out.stdout and "(no rebuild)" in out.stdout
    installing = float(re.search(r"into \S+ in ([\d.]+)s", out.stdout).group(1))
    assert installing < 90 and took < 180, out.stdout  # seconds: no build
    assert "`horovodrun -cb` confirms TensorFlow, Gloo" in out.stdout and (bin_dir / "horovodrun").is_file()

    (base / "train.py").write_text(TRAIN)
    out = run(bin_dir / "tfdist-run", "-np", "2", "python", "train.py")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = dict(re.findall(r"RESULT rank=(\d) size=2 (.*)", out.stdout))
    assert sorted(results) == ["0", "1"], out.stdout[-3000:]
    for line in results.values():
        fields = dict(item.split("=", 1) for item in line.split())
        assert float(fields["accuracy"]) > 0.8 and float(fields["loss"]) < 0.5, line
        assert fields["horovod"].startswith(str(venv)) and fields["tfdist"].startswith(str(venv)), line
    profile = dict(item.split("=", 1) for item in re.search(r"PROFILE (.*)", out.stdout).group(1).split())
    assert {"epoch_loss", "epoch_accuracy"} <= set(profile["scalars"].split(",")), profile
    assert profile["traces"] == "1" and profile["plugins"].startswith("xprof"), profile
    assert "trace_viewer" in profile["tools"] or "trace_viewer@" in profile["tools"], profile
    assert len(list((base / "tb" / "train").glob("events.out.tfevents.*"))) == 1  # rank 1 wrote elsewhere
