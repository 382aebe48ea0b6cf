"""The built wheel installs one `tfdist` namespace with its console scripts, and nothing top-level else."""

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from conftest import ROOT


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
    for module in ("tfdist/pipelines/reader.py", "tfdist/callbacks/checkpoint.py", "tfdist/benchmark/run.py"):
        assert module in names


def test_installed_package_imports_as_one_namespace(installed):
    _, target = installed
    out = run_installed(target, (
        "import importlib.util, tfdist, tfdist.pipelines, tfdist.callbacks\n"
        "print(tfdist.__file__)\n"
        "print(tfdist.pipelines.read_dataset.__module__, tfdist.callbacks.Checkpointer.__module__)\n"
        "print(tfdist.precision.__name__, tfdist.tuning.__name__)\n"
        "print(importlib.util.find_spec('pipelines'), importlib.util.find_spec('callbacks'))\n"))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith(str(target))  # the installed copy, not the checkout
    assert lines[1:] == ["tfdist.pipelines.reader tfdist.callbacks.checkpoint",
                         "tfdist.precision tfdist.tuning", "None None"]


def test_console_scripts_run_from_the_install(installed):
    _, target = installed
    for script, expect in (("tfdist-benchmark", "--variable_update"), ("tfdist-scaling", "--repeats"),
                           ("tfdist-data", "convert"), ("tfdist-run", "--launcher"),
                           ("tfdist-tune", "--candidates"), ("tfdist-profile", "--view"),
                           ("tfdist-predict", "--bandwidth_gbit")):
        path = target / "bin" / script
        assert path.is_file(), script
        out = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, cwd="/",
                             env={**os.environ, "PYTHONPATH": str(target)}, timeout=300)
        assert out.returncode == 0 and expect in out.stdout, (script, out.stderr[-2000:])


def test_every_tfdist_error_derives_from_tfdist_error():
    import tfdist
    from tfdist import launch, run
    from tfdist.callbacks import CheckpointError
    from tfdist.pipelines import ManifestError, StagingError

    errors = [CheckpointError, ManifestError, StagingError, launch.LaunchError, run.UsageError,
              *(getattr(tfdist, name) for name in tfdist.__all__ if name.endswith("Error"))]
    assert all(issubclass(e, tfdist.TfdistError) for e in errors), errors
    assert issubclass(ManifestError, ValueError)  # still caught where a ValueError was
    # one class per name: the launch layout and the tuning topology are different things
    from tfdist import tuning

    assert launch.TaskPlacement is not tuning.Topology and not hasattr(launch, "Topology")
