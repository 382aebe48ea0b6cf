"""The patches tfdist-install-horovod applies to Horovod's sdist (tfdist/horovod_build/patches/, docs/INSTALL.md).

The applier is pure Python: hunks match exactly, shifted if need be, or the install fails naming the
patch, the source file and the hunk, and writes nothing. Against the real sdist (cached by the build
in $TFDIST_CACHE/sdist; skipped where no build ran) every patch applies, in order, exactly once.
"""

import glob
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from tfdist.horovod_build import toolchain
from tfdist.horovod_build import install as ih

PATCH_DIR = ROOT / "tfdist" / "horovod_build" / "patches"
SDIST = os.path.join(toolchain.default_cache(), "sdist", f"horovod-{toolchain.HOROVOD_VERSION}.tar.gz")

PATCH = """Subject: a test patch
Build: all

Why: the test says so.

diff --git a/pkg/mod.py b/pkg/mod.py
--- a/pkg/mod.py
+++ b/pkg/mod.py
@@ -2,3 +2,3 @@ def f():
     a = 1
-    b = 2
+    b = 3
     return a + b
@@ -6,2 +6,3 @@
 def g():
     return 0
+# end
"""
SOURCE = "def f():\n    a = 1\n    b = 2\n    return a + b\n\ndef g():\n    return 0\n"


def write(folder, files):
    for name, text in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_hunks_apply_exactly_also_shifted(tmp_path):
    write(tmp_path, {"src/pkg/mod.py": "# a header\n# of two lines\n" + SOURCE, "t.patch": PATCH})
    toolchain.apply_patch(str(tmp_path / "t.patch"), str(tmp_path / "src"))
    assert (tmp_path / "src/pkg/mod.py").read_text() == (
        "# a header\n# of two lines\n" + SOURCE.replace("b = 2", "b = 3") + "# end\n")
    fields, files = toolchain.parse_patch(str(tmp_path / "t.patch"))
    assert fields == {"Subject": "a test patch", "Build": "all", "Why": "the test says so."}
    assert [(path, len(hunks)) for path, hunks in files] == [("pkg/mod.py", 2)]


def test_a_patch_that_does_not_apply_names_itself_the_file_and_the_hunk_and_writes_nothing(tmp_path):
    other = "x = 1\n"
    write(tmp_path, {"src/pkg/mod.py": SOURCE.replace("return 0", "return 1"), "src/pkg/other.py": other,
                     "t.patch": PATCH.replace("diff --git a/pkg/mod.py", "--- a/pkg/other.py\n+++ b/pkg/other.py\n"
                                              "@@ -1 +1 @@\n-x = 1\n+x = 2\ndiff --git a/pkg/mod.py")})
    before = (tmp_path / "src/pkg/mod.py").read_text()
    with pytest.raises(toolchain.InstallError) as error:
        toolchain.apply_patch(str(tmp_path / "t.patch"), str(tmp_path / "src"))
    message = str(error.value)
    assert "patch t.patch does not apply to pkg/mod.py: hunk 2 (@@ -6,2 +6,3 @@)" in message
    assert "        return 0" in message and str(tmp_path / "t.patch") in message
    assert (tmp_path / "src/pkg/mod.py").read_text() == before  # hunk 1 matched, but nothing was written
    assert (tmp_path / "src/pkg/other.py").read_text() == other
    (tmp_path / "src/pkg/mod.py").unlink()
    with pytest.raises(toolchain.InstallError, match="patch t.patch does not apply: pkg/mod.py is not in the sdist"):
        toolchain.apply_patch(str(tmp_path / "t.patch"), str(tmp_path / "src"))


def test_lines_without_a_final_newline_and_with_form_feeds(tmp_path):
    patch = ("Build: all\n--- a/m.c\n+++ b/m.c\n@@ -1,2 +1,2 @@\n int a;\x0c /* page */\n-int b;\n"
             "\\ No newline at end of file\n+int c;\n\\ No newline at end of file\n")
    write(tmp_path, {"src/m.c": "int a;\x0c /* page */\nint b;", "t.patch": patch})
    toolchain.apply_patch(str(tmp_path / "t.patch"), str(tmp_path / "src"))
    assert (tmp_path / "src/m.c").read_text() == "int a;\x0c /* page */\nint c;"


def test_the_patch_set_picks_gpu_patches_for_nccl_builds_and_names_the_cache(tmp_path):
    write(tmp_path, {"0001-a.patch": PATCH, "0002-b.patch": PATCH.replace("Build: all", "Build: nccl")})
    cpu, gpu = toolchain.source_patches(False, str(tmp_path)), toolchain.source_patches(True, str(tmp_path))
    assert [os.path.basename(p) for p in cpu] == ["0001-a.patch"] and len(gpu) == 2
    digest = toolchain.patches_digest(cpu)
    assert len(digest) == 8 and digest != toolchain.patches_digest(gpu)
    plan = ih.make_plan(cache_root="/c", tf=("tensorflow-cpu", "2.21.0"), mpicxx="", gpu_stack=False,
                        patch_dir=str(tmp_path))
    assert plan.wheel_dir.endswith(f"-p{digest}")
    (tmp_path / "0001-a.patch").write_text(PATCH.replace("b = 3", "b = 4"))  # a changed patch: another folder
    assert ih.make_plan(cache_root="/c", tf=("tensorflow-cpu", "2.21.0"), mpicxx="", gpu_stack=False,
                        patch_dir=str(tmp_path)).wheel_dir != plan.wheel_dir
    (tmp_path / "0003-c.patch").write_text(PATCH.replace("Build: all", "Build: sometimes"))
    with pytest.raises(toolchain.InstallError, match="0003-c.patch: its header needs `Build: all` or `Build: nccl`"):
        toolchain.source_patches(False, str(tmp_path))


def test_every_shipped_patch_says_why_and_what_it_changes():
    paths = sorted(PATCH_DIR.glob("*.patch"))
    assert [p.name[:4] for p in paths] == [f"{n:04d}" for n in range(1, len(paths) + 1)]
    for path in paths:
        fields, files = toolchain.parse_patch(str(path))
        assert fields["Subject"] and fields["Build"] in ("all", "nccl") and fields["Upstream"], path.name
        why = path.read_text().split("\ndiff --git", 1)[0]
        assert len(why.splitlines()) >= 6, f"{path.name}: the header must say why"
        assert all(target.startswith(("horovod/", "third_party/gloo/")) for target, _ in files), path.name
    assert [p.name for p in paths if toolchain.parse_patch(str(p))[0]["Build"] == "nccl"] == \
        ["0002-gpu-as-gpu-stream-value.patch"]
    setup = (ROOT / "setup.cfg").read_text()
    assert "tfdist.horovod_build = patches/*.patch" in setup  # shipped with the package (package_data)


@pytest.fixture(scope="module")
def patched_sdist(tmp_path_factory):
    if not os.path.isfile(SDIST):
        pytest.skip(f"Horovod's sdist is not cached ({SDIST}); tfdist-install-horovod keeps it when it builds")
    src = toolchain.unpack_sdist(SDIST, str(tmp_path_factory.mktemp("sdist")))
    applied = toolchain.patch_sdist(src, toolchain.source_patches(nccl=True))
    assert len(applied) == len(list(PATCH_DIR.glob("*.patch")))
    return src


def test_every_patch_applies_to_the_real_sdist(patched_sdist):
    cmake = open(os.path.join(patched_sdist, "horovod", "tensorflow", "CMakeLists.txt")).read()
    assert "mpi_ops.cc" in cmake and "xla_mpi_ops.cc" not in cmake
    ops = open(os.path.join(patched_sdist, "horovod", "tensorflow", "mpi_ops.cc")).read()
    assert "stream->platform_specific_handle().stream" in ops
    assert "GpuStreamHandle AsGpuStreamValue(Stream* stream);" not in ops
    for path in glob.glob(os.path.join(patched_sdist, "horovod", "**", "*.py"), recursive=True):
        compile(open(path).read(), path, "exec")  # every patched module parses
    util = open(os.path.join(patched_sdist, "horovod", "tensorflow", "util.py")).read()
    assert "def var_ref(var):" in util


def test_a_patch_applies_once(patched_sdist):
    path = str(PATCH_DIR / "0001-cmake-drop-xla-mpi-ops.patch")
    with pytest.raises(toolchain.InstallError, match=r"patch 0001-cmake-drop-xla-mpi-ops.patch does not apply to "
                                                     r"horovod/tensorflow/CMakeLists.txt: hunk 1"):
        toolchain.apply_patch(path, patched_sdist)


CHECK_BUILD = """
import multiprocessing, sys
from horovod.common import util
if sys.argv[1] == "recorded":  # the answer must come from the file: asking a child process fails
    def no_child(*args, **kwargs):
        raise AssertionError("asked a child process")
    multiprocessing.get_context = no_child
print("RESULT", util.gloo_built(), util.mpi_built())
"""


def _check_build(mode, cache_home):
    return subprocess.run([sys.executable, "-c", CHECK_BUILD, mode], env={**os.environ, "XDG_CACHE_HOME": str(cache_home)},
                          capture_output=True, text=True, timeout=300)


def test_horovodrun_asks_once_what_the_extension_was_built_with(tmp_path):
    """Patch 0010: horovodrun's `gloo_built` check imported TensorFlow in a child before every launch."""
    asked = _check_build("ask", tmp_path)
    assert asked.returncode == 0 and "RESULT True" in asked.stdout, asked.stdout + asked.stderr
    checks = json.loads((tmp_path / "horovod" / "extension-checks.json").read_text())
    assert sorted(key.split("|")[2] for key in checks) == ["built with Gloo", "built with MPI"], checks
    library = next(iter(checks)).split("|")[0]
    assert library.endswith(".so") and "tensorflow" in library and os.path.isfile(library)

    recorded = _check_build("recorded", tmp_path)
    assert recorded.returncode == 0 and recorded.stdout == asked.stdout, recorded.stdout + recorded.stderr

    # another build of the library (other size and mtime) is asked again, not answered from the file
    (tmp_path / "horovod" / "extension-checks.json").write_text(json.dumps(
        {key.rsplit("|", 2)[0] + "|1:1|" + key.rsplit("|", 1)[1]: value for key, value in checks.items()}))
    stale = _check_build("recorded", tmp_path)
    assert stale.returncode != 0 and "asked a child process" in stale.stderr, stale.stdout + stale.stderr

    # an unwritable cache folder leaves the check as it was
    (tmp_path / "file").write_text("")
    unwritable = _check_build("ask", tmp_path / "file")
    assert unwritable.returncode == 0 and unwritable.stdout == asked.stdout, unwritable.stderr
