"""Where a reference suite's tests come from: Keras 3's PyPI sdist, tf-keras' checkout, our selftest.

Keras 3 publishes its tests in its PyPI sdist: the installed version's sdist is downloaded once
into $TFDIST_CACHE/reference (default ~/.cache/tfdist/reference) and its tf.distribute test files
(`picking`) are extracted into a scratch folder; nothing of it is kept in the repository.
tf-keras and TensorFlow publish no tests (their sdists and wheels hold none), so the tf-keras
suite reads a checkout of keras-team/tf-keras at the installed version's tag.
"""

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import picking

HERE = Path(__file__).resolve().parent


def cache_dir():
    return Path(os.environ.get("TFDIST_CACHE") or Path.home() / ".cache" / "tfdist") / "reference"


def installed_version(package):
    from importlib import metadata

    return metadata.version(package)


def keras_sdist(version):
    """The path of keras==`version`'s sdist, downloaded from the package index once."""
    target = cache_dir()
    found = sorted(target.glob(f"keras-{version}.tar.gz"))
    if found:
        return found[0]
    target.mkdir(parents=True, exist_ok=True)
    out = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                          "--dest", str(target), f"keras=={version}"], capture_output=True, text=True)
    found = sorted(target.glob(f"keras-{version}.tar.gz"))
    if out.returncode or not found:
        raise SystemExit(f"reference suite: could not download keras=={version}'s sdist from the package "
                         f"index (pip download exited {out.returncode}):\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return found[0]


def prepare_keras3(scratch, checkout=None):
    """Extract Keras 3's tf.distribute test files into `scratch`; returns (rootdir, pytest args).

    `checkout`: a keras-team/keras checkout at the installed version, for its integration_tests/
    folder, which the sdist leaves out (its tf.distribute files are added).
    """
    version = installed_version("keras")
    root = scratch / "keras_tests"
    prefix = f"keras-{version}/"
    files = []
    with tarfile.open(keras_sdist(version)) as sdist:
        for member in sdist.getmembers():
            name = member.name
            if name == prefix + "pyproject.toml":
                (scratch / "pyproject.toml").write_bytes(sdist.extractfile(member).read())
            if not (member.isfile() and name.startswith(prefix + "keras/src/") and name.endswith("_test.py")):
                continue
            text = sdist.extractfile(member).read().decode()
            if picking.file_may_have_tests(text):
                path = root / name[len(prefix + "keras/src/"):]
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
                files.append(str(path.relative_to(root)))
    if checkout is not None:
        folder = Path(checkout).expanduser().resolve() / "integration_tests"
        if not folder.is_dir():
            raise SystemExit(f"reference suite: {checkout} is not a keras-team/keras checkout (no integration_tests/)")
        for path in sorted(folder.glob("*_test.py")):
            if picking.file_may_have_tests(path.read_text()):
                (root / "integration_tests").mkdir(parents=True, exist_ok=True)
                shutil.copy(path, root / "integration_tests" / path.name)
                files.append(f"integration_tests/{path.name}")
    shutil.copy(HERE / "keras_conftest.py", root / "conftest.py")
    return root, ["-c", str(scratch / "pyproject.toml"), *sorted(files)]


def prepare_selftest(scratch):
    """The runner's own check (selftest/): a hang and a crash it must name and get past."""
    root = scratch / "selftest"
    shutil.copytree(HERE / "selftest", root)
    return root, sorted(p.name for p in root.glob("*_test.py"))


TF_KERAS_FILES = ("distribute/*_test.py", "optimizers/optimizer_test.py")


def prepare_tf_keras(scratch, source):
    """tf-keras' tests of the 2-worker MWMS slot, from a keras-team/tf-keras checkout; returns
    (rootdir, pytest args).

    The repository's tests import `tf_keras.X` where the installed wheel has `tf_keras.src.X`:
    the scratch copy's import lines are converted as tf-keras' own build (pip_build.py) converts
    its sources; nothing else of a test changes (the strategy is swapped by the plugin).
    """
    source = Path(source).expanduser().resolve()
    if not (source / "tf_keras" / "distribute").is_dir():
        raise SystemExit(f"reference suite: {source} is not a keras-team/tf-keras checkout (no tf_keras/distribute/)")
    root = scratch / "tf_keras_tests"
    files = []
    for pattern in TF_KERAS_FILES:
        for path in sorted((source / "tf_keras").glob(pattern)):
            text = path.read_text()
            if not any(slot in text for slot in ("multi_worker_mirrored_2x1_cpu", "multiworker_strategies",
                                                  "multi_worker_mirrored_strategies")):
                continue
            target = root / path.relative_to(source / "tf_keras")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("\n".join(_as_installed(line) for line in text.splitlines()) + "\n")
            files.append(str(target.relative_to(root)))
    return root, sorted(files)


def _as_installed(line):
    """One import line of a tf-keras repository file, as tf-keras' pip_build.py rewrites it."""
    if "tf_keras.protobuf" in line:
        return line
    if line.strip() == "import tf_keras":
        return line.replace("import tf_keras", "import tf_keras.src as tf_keras")
    for old, new in (("import tf_keras.", "import tf_keras.src."), ("from tf_keras.", "from tf_keras.src."),
                     ("from tf_keras import", "from tf_keras.src import"),
                     ("import tf_keras as ", "import tf_keras.src as "),
                     ('globals(), "tf_keras.', 'globals(), "tf_keras.src.')):
        line = line.replace(old, new)
    return line
