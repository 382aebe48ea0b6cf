"""tfdist-install-horovod's plan (cache names, MPI, GPU stack, patch set) and bootstrap's package choice.

Fast: nothing here builds or installs. The install into a fresh environment, from the cached wheel,
is tests/test_packaging.py::test_fresh_environment_installs_horovod_and_trains.
"""

import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT
from tfdist.horovod_build import toolchain
from tfdist.horovod_build import install as ih

MODULE = ROOT / "tfdist" / "horovod_build" / "install.py"
BOOTSTRAP = ROOT / "scripts" / "bootstrap.sh"
PY = f"cp{sys.version_info[0]}{sys.version_info[1]}"

# Started before the module runs: imports of TensorFlow, Keras, Horovod or tfdist fail (and are recorded).
HIDE = """
import importlib.abc, importlib.machinery, sys
tried = []
class Hidden(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            return importlib.machinery.ModuleSpec(name, self)
    def create_module(self, spec):
        tried.append(spec.name)
        raise ImportError(f"No module named {spec.name!r} (hidden by the test)")
    def exec_module(self, module):
        pass
sys.meta_path.insert(0, Hidden())
"""


def plan(**kwargs):
    kwargs = {"cache_root": "/c", "tf": ("tensorflow-cpu", "2.21.0"), "mpicxx": "", "gpu_stack": False, **kwargs}
    return ih.make_plan(**kwargs)


CPU_PATCHES = toolchain.patches_digest(toolchain.source_patches(nccl=False))


def test_cache_directories_are_bootstraps():
    with_mpi = plan(mpicxx="/usr/bin/mpicxx")
    assert with_mpi.wheel_dir == f"/c/wheels/horovod-0.28.1-tf2.21.0-{PY}-p{CPU_PATCHES}-mpi"
    assert with_mpi.features() == ["TensorFlow", "Gloo", "MPI"]
    env = with_mpi.build_env(jobs=3)
    assert env["HOROVOD_WITH_MPI"] == "1" and "HOROVOD_WITHOUT_MPI" not in env
    assert env["CMAKE_POLICY_VERSION_MINIMUM"] == "3.5" and env["MAKEFLAGS"] == "-j3"
    assert env["HOROVOD_WITH_TENSORFLOW"] == env["HOROVOD_WITH_GLOO"] == "1"
    assert env["HOROVOD_WITHOUT_PYTORCH"] == env["HOROVOD_WITHOUT_MXNET"] == "1"

    gloo_only = plan()
    assert gloo_only.wheel_dir == f"/c/wheels/horovod-0.28.1-tf2.21.0-{PY}-p{CPU_PATCHES}"
    assert gloo_only.features() == ["TensorFlow", "Gloo"]
    assert gloo_only.build_env(jobs=1)["HOROVOD_WITHOUT_MPI"] == "1"
    assert any("Gloo only" in note for note in gloo_only.notes)
    assert not plan(mpicxx="/usr/bin/mpicxx", mpi="no").mpi


def test_mpi_yes_without_mpicxx_names_the_fix():
    with pytest.raises(toolchain.InstallError, match="--mpi yes: no `mpicxx`.*libopenmpi-dev.*--with-mpi"):
        plan(mpi="yes")


def test_gpu_stack_builds_nccl_cached_apart():
    gpu = plan(gpu_stack=True, tf=("tensorflow", "2.21.0"), mpicxx="/usr/bin/mpicxx")
    assert gpu.nccl and gpu.features() == ["TensorFlow", "Gloo", "MPI", "NCCL"]
    gpu_patches = toolchain.patches_digest(toolchain.source_patches(nccl=True))  # 0002 too
    assert gpu.wheel_dir == f"/c/wheels/horovod-0.28.1-tf2.21.0-{PY}-p{gpu_patches}-mpi-nccl" and gpu_patches != CPU_PATCHES
    env = gpu.build_env(2)
    assert env["HOROVOD_GPU_OPERATIONS"] == "NCCL" and env["HOROVOD_NCCL_LINK"] == "SHARED"
    assert env["HOROVOD_CUDA_HOME"] == gpu.toolkit_dir and env["HOROVOD_NCCL_HOME"] == gpu.toolkit_dir + "/nccl"
    assert env["HOROVOD_WITH_MPI"] == "1" and env["HOROVOD_BUILD_CUDA_CC_LIST"] == "75,80,90"
    cpu = plan()
    assert not cpu.nccl and "HOROVOD_GPU_OPERATIONS" not in cpu.build_env(1) and not cpu.wheel_dir.endswith("-nccl")
    off = plan(gpu_stack=True, gpu="no")
    assert not off.nccl and any("--gpu no" in note for note in off.notes)
    with pytest.raises(toolchain.InstallError, match="--gpu yes: nvidia-nccl-cu12 is not installed.*and-cuda"):
        plan(gpu="yes")


def test_cuda_toolkit_is_assembled_from_the_wheels(tmp_path):
    cu13, nccl = tmp_path / "cu13", tmp_path / "nccl"
    for path in ("bin/nvcc", "bin/nvcc.profile", "bin/crt/link.stub", "lib/libcudart.so.13",
                 "lib/libcudart_static.a", "include/cuda_runtime.h", "nvvm/bin/cicc"):
        (cu13 / path).parent.mkdir(parents=True, exist_ok=True)
        (cu13 / path).write_text(path)
    for path in ("include/nccl.h", "lib/libnccl.so.2"):
        (nccl / path).parent.mkdir(parents=True, exist_ok=True)
        (nccl / path).write_text(path)
    dest = tmp_path / "toolkit"
    toolchain.assemble_cuda_toolkit(str(dest), str(cu13), str(nccl))
    assert (dest / "bin").is_dir() and not (dest / "bin").is_symlink()  # nvcc resolves bin/.. to dest
    assert (dest / "bin" / "nvcc").read_text() == "bin/nvcc" and (dest / "nvvm" / "bin" / "cicc").exists()
    assert (dest / "lib64" / "libcudart_static.a").exists() and os.readlink(dest / "lib64" / "libcudart.so") == "libcudart.so.13"
    assert (dest / "include" / "cuda_runtime.h").exists() and (dest / "nccl" / "include" / "nccl.h").exists()
    assert os.path.realpath(dest / "nccl" / "lib" / "libnccl.so") == str(nccl / "lib" / "libnccl.so.2")
    toolchain.assemble_cuda_toolkit(str(dest), str(cu13), str(nccl))  # again: replaced, not nested
    (nccl / "lib" / "libnccl.so.2").unlink()
    with pytest.raises(toolchain.InstallError, match="libnccl.so.2 is missing"):
        toolchain.assemble_cuda_toolkit(str(dest), str(cu13), str(nccl))


def test_bootstrap_chooses_the_stack():
    for value, stack in (("1", "GPU (tensorflow[and-cuda], Horovod with NCCL): TFDIST_GPU=1"),
                         ("0", "CPU (tensorflow-cpu): TFDIST_GPU=0")):
        out = bootstrap("--dry-run", TFDIST_GPU=value)
        assert out.returncode == 0 and f"TensorFlow stack: {stack}" in out.stderr, out.stderr
    out = bootstrap("--dry-run", TFDIST_GPU="yes")
    assert out.returncode == 2 and "TFDIST_GPU=yes: expected 1" in out.stderr


def test_missing_tensorflow_names_the_extra(monkeypatch):
    monkeypatch.setattr(toolchain, "installed_version", lambda name: None)
    with pytest.raises(toolchain.InstallError, match=r"TensorFlow is not installed.*\[cpu\]"):
        ih.make_plan(cache_root="/c", mpicxx="")


def run_module(args, hidden=("tensorflow", "keras", "horovod", "tfdist"), env=None):
    """The module run by path (as before tfdist is installed), with `hidden` packages unimportable."""
    code = (f"HIDDEN = {tuple(hidden)!r}\n{HIDE}\nimport runpy\nsys.argv = [{str(MODULE)!r}, *{list(args)!r}]\n"
            f"try:\n    runpy.run_path({str(MODULE)!r}, run_name='__main__')\n"
            "except SystemExit as e:\n    print('EXIT', e.code, 'TRIED', tried)\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=120,
                          env={**os.environ, **(env or {})})


def test_runs_by_path_without_tensorflow_or_tfdist(tmp_path):
    out = run_module(["--help"])
    assert "EXIT 0 TRIED []" in out.stdout and "--cache-only" in out.stdout, out.stderr[-2000:]
    out = run_module(["--dry-run"], env={"TFDIST_CACHE": str(tmp_path)})
    assert "EXIT 0 TRIED []" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "TensorFlow 2.21.0" in out.stdout and f"would build a wheel into {tmp_path}/wheels/horovod-" in out.stdout
    assert "CMAKE_POLICY_VERSION_MINIMUM=3.5" in out.stdout
    assert "patches: 0001-cmake-drop-xla-mpi-ops.patch, 0003-keras3-variables.patch" in out.stdout


def test_cache_only_without_a_cached_wheel_fails_naming_the_folder(tmp_path):
    out = run_module(["--cache-only"], env={"TFDIST_CACHE": str(tmp_path)})
    assert "EXIT 1 TRIED []" in out.stdout, out.stdout + out.stderr[-2000:]
    assert f"tfdist-install-horovod: error: --cache-only: no cached wheel in {tmp_path}/wheels/" in out.stderr


def test_errors_name_the_install_command():
    from tfdist import collectives
    from tfdist.launch import runner as run

    assert "tfdist-install-horovod" in collectives.INSTALL_HINT and "bash scripts/bootstrap.sh" in collectives.INSTALL_HINT
    assert "run `tfdist-install-horovod`" in run.not_found("/nowhere/horovodrun")


def bootstrap(*args, **env):
    return subprocess.run(["bash", str(BOOTSTRAP), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TFDIST_SYSTEM_PACKAGES": "", **env})


def test_bootstrap_installs_system_packages_only_when_asked():
    out = bootstrap("--dry-run")
    assert out.returncode == 0 and "asked by" not in out.stderr, out.stderr
    out = bootstrap("--dry-run", "--with-mpi", TFDIST_SYSTEM_PACKAGES="slurm")
    assert out.returncode == 0, out.stderr
    for group, why in (("mpi", "--with-mpi"), ("slurm", "TFDIST_SYSTEM_PACKAGES")):
        assert f"{group}: already installed (asked by {why})" in out.stderr or \
            f"system packages for {group} (" in out.stderr and f"asked by {why}" in out.stderr, out.stderr
    assert not [line for line in out.stderr.splitlines() if "browser" in line and "asked by" in line]
    out = bootstrap("--dry-run", "--for-tests")
    assert all(f"{g}" in out.stderr for g in ("mpi", "slurm", "browser", "net")), out.stderr
    out = bootstrap("--dry-run", TFDIST_SYSTEM_PACKAGES="mpi,gpus")
    assert out.returncode == 2 and "unknown system package group 'gpus'" in out.stderr
    assert "--for-tests" in (ROOT / "scripts" / "run_tests.sh").read_text()


def test_the_declared_range_is_setup_cfgs_and_the_install_notes_versions_outside_it():
    import configparser

    from tfdist.horovod_build import versions

    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    extras = config["options.extras_require"]
    oldest, after = versions.TF_OLDEST, (versions.TF_NEWEST[0], versions.TF_NEWEST[1] + 1)
    bounds = f">={oldest[0]}.{oldest[1]},<{after[0]}.{after[1]}"
    for extra, name in (("cpu", "tensorflow-cpu"), ("gpu", "tensorflow[and-cuda]"), ("legacy", "tf-keras")):
        assert extras[extra].strip() == f"{name}{bounds}", (extra, extras[extra])
    assert f'TF_VERSION={versions.PINNED_TF}' in BOOTSTRAP.read_text()  # the checkout's one pinned default
    assert versions.tf_in_range(versions.PINNED_TF) and versions.tf_in_range("2.16.2") and versions.tf_in_range("2.18.1")
    assert not versions.tf_in_range("2.15.1") and not versions.tf_in_range("2.22.0") and not versions.tf_in_range("x")
    # HorovodStrategy() refuses Keras 2 and Keras 3 before 3.5 before Horovod starts (seen: docs/INSTALL.md)
    assert versions.keras_refusal("2.16.2", "3.15.1") is None and versions.keras_refusal("2.16.2", "3.5.0") is None
    refusal = versions.keras_refusal("2.15.1", "2.15.0")
    assert "TensorFlow 2.15.1 with keras 2.15.0" in refusal and "TensorFlow 2.16 to 2.21" in refusal, refusal
    refusal = versions.keras_refusal("2.16.2", "3.3.3")
    assert "TensorFlow 2.16.2 with keras 3.3.3" in refusal and "pip install 'keras>=3.5'" in refusal, refusal
    assert "    keras>=3.5\n" in (ROOT / "setup.cfg").read_text()  # pip never pairs tfdist with an older one
    assert not [note for note in plan(tf=("tensorflow-cpu", "2.16.2")).notes if "range" in note]
    (note,) = [note for note in plan(tf=("tensorflow-cpu", "2.15.1")).notes if "range" in note]
    assert note.startswith("TensorFlow 2.15.1 is outside tfdist's tested range, TensorFlow 2.16 to 2.21"), note


def test_wheelhouse_install_takes_its_wheel_and_never_builds(tmp_path):
    """`--wheelhouse DIR`: the wheel in DIR/wheels/<cache folder>/, the MPI or Gloo-only build that is
    there; without one, an error naming the folder and what the wheelhouse holds."""
    out = run_module(["--wheelhouse", str(tmp_path), "--dry-run"])
    assert "EXIT 1 TRIED []" in out.stdout, out.stdout + out.stderr[-2000:]
    assert f"--wheelhouse: no Horovod wheel for this environment in {tmp_path}/wheels/horovod-0.28.1-tf" in out.stderr
    assert "the wheelhouse holds none" in out.stderr
    # a wheelhouse with the other MPI variant than this machine's detection: --mpi auto takes it
    other = plan(cache_root=str(tmp_path), mpicxx="" if shutil.which("mpicxx") else "/usr/bin/mpicxx")
    os.makedirs(other.wheel_dir)
    open(os.path.join(other.wheel_dir, f"horovod-0.28.1-{PY}-{PY}-linux_x86_64.whl"), "w").close()
    out = run_module(["--wheelhouse", str(tmp_path), "--dry-run"])
    assert "EXIT 0 TRIED []" in out.stdout, out.stdout + out.stderr[-2000:]
    assert f"would reuse the cached wheel {other.wheel_dir}/horovod-0.28.1-" in out.stdout
    assert f"the wheelhouse holds the {'MPI' if other.mpi else 'Gloo-only'} build: using it" in out.stdout
    out = run_module(["--wheelhouse", str(tmp_path), "--rebuild"])
    assert "EXIT 2" in out.stdout and "--rebuild and --wheelhouse contradict each other" in out.stderr
