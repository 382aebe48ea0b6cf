"""The package's shape, checked from its source: docs/ARCHITECTURE.md names every module, the
imports form no circle and never reach up, Horovod is called through one module, modules stay
under 400 lines, and the 0.1 module paths still import (deprecated)."""

import ast
import importlib
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"tfdist": ROOT / "tfdist", "tfdist.pipelines": ROOT / "pipelines", "tfdist.callbacks": ROOT / "callbacks"}
MAX_LINES = 400
# Modules that may import Horovod itself (everything else goes through tfdist.collectives).
HOROVOD_IMPORTERS = {
    "tfdist.collectives": "the one place for collectives",
    "tfdist._compat": "Horovod's private rendezvous classes, like every private access",
    "tfdist.benchmark.train_benchmark": "its --variable_update horovod baseline is Horovod's own loop",
    "tfdist.benchmark.modes": "starts Horovod itself for that baseline",
}


def _modules():
    """{dotted name: path} of every module of tfdist, tfdist.pipelines and tfdist.callbacks."""
    found = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted(folder.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if package == "tfdist" and parts[0] in ("pipelines", "callbacks"):
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _imports(name, path):
    """[(imported module, line)] of `path`, imports inside functions included, resolved to modules."""
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_package else name.split(".")[:-1]
                here = here[: len(here) - (node.level - 1)]
                base = ".".join(here + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        out += [(target, node.lineno) for target in targets]
    return out


def _owner(target):
    """The tfdist module an import target lands in (the longest known prefix), or None."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


GRAPH = {name: {} for name in MODULES}
for _name, _path in MODULES.items():
    for _target, _line in _imports(_name, _path):
        _module = _owner(_target)
        if _module and _module != _name:
            GRAPH[_name].setdefault(_module, _line)


def _cycles():
    """Every import circle (strongly connected components of more than one module), as lists."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in GRAPH[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(GRAPH):
        if node not in index:
            visit(node)
    return circles


def test_the_import_graph_is_parsed():
    # The checks below mean something only if the graph holds the edges everyone knows are there.
    assert "tfdist.collectives" in GRAPH["tfdist.strategy"]
    assert "tfdist.keras.recognise" in GRAPH["tfdist.keras.metrics"]  # an import inside a function
    assert "tfdist.launch.slurm" in GRAPH["tfdist.tuning.environment"]
    assert len(MODULES) > 60


def test_no_import_circles():
    circles = _cycles()
    assert not circles, "import circles (each a set of modules that import each other): " + "; ".join(
        " <-> ".join(c) for c in circles)


def test_no_module_imports_a_package_that_contains_it():
    upward = [f"{name} imports {target} (line {line})" for name, targets in GRAPH.items()
              for target, line in targets.items() if name.startswith(target + ".")]
    assert not upward, upward


def test_the_core_does_not_import_callbacks_or_pipelines():
    allowed = ("tfdist.benchmark", "tfdist.pipelines", "tfdist.callbacks")
    wrong = [f"{name} -> {target} (line {line})" for name, targets in GRAPH.items()
             if name != "tfdist" and not name.startswith(allowed)
             for target, line in targets.items() if target.startswith(("tfdist.pipelines", "tfdist.callbacks"))]
    assert not wrong, wrong


def test_nothing_imports_scripts_or_tests():
    wrong = [f"{name} imports {target} (line {line})" for name, path in MODULES.items()
             for target, line in _imports(name, path)
             if target.split(".")[0] in ("scripts", "tests", "conftest", "multirank", "emulate_hosts", "browser")]
    assert not wrong, wrong


def test_horovod_is_imported_in_the_named_places_only():
    found = {name for name, path in MODULES.items() for target, _ in _imports(name, path)
             if target == "horovod" or target.startswith("horovod.")}
    assert found - set(HOROVOD_IMPORTERS) == set(), f"import Horovod through tfdist.collectives: {found - set(HOROVOD_IMPORTERS)}"
    assert found == set(HOROVOD_IMPORTERS), f"stale exceptions: {set(HOROVOD_IMPORTERS) - found}"


def test_private_tensorflow_and_keras_internals_go_through_compat():
    private = re.compile(r"^(tensorflow\.python|keras\.src|tf_keras\.src)")
    wrong = [f"{name} imports {target} (line {line})" for name, path in MODULES.items() if name != "tfdist._compat"
             for target, line in _imports(name, path) if private.match(target)]
    assert not wrong, wrong


def test_no_module_is_over_400_lines():
    long = {str(path.relative_to(ROOT)): n for path in MODULES.values()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def _documented_paths():
    """Module files named in the tables of docs/ARCHITECTURE.md's "Modules" section."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## Modules", 1)[1].split("\n## ", 1)[0]
    named = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            first_cell = line.split("|")[1]
            named |= set(re.findall(r"`([\w/]+\.py)`", first_cell))
    return named


def test_architecture_page_names_every_module_and_no_other():
    on_disk = {str(path.relative_to(ROOT)) for path in MODULES.values()}
    named = _documented_paths()
    assert on_disk - named == set(), f"docs/ARCHITECTURE.md does not name these modules: {sorted(on_disk - named)}"
    assert named - on_disk == set(), f"docs/ARCHITECTURE.md names modules that do not exist: {sorted(named - on_disk)}"


def test_old_module_paths_import_with_a_deprecation_warning():
    from tfdist import _moved

    for old, new in _moved.MOVED.items():
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(old)
        assert module is importlib.import_module(new), old
        assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught), old


def test_old_public_paths_keep_working():
    import tfdist
    import tfdist.callbacks
    import tfdist.launch
    import tfdist.tuning
    from tfdist import optimizers

    with pytest.warns(DeprecationWarning, match="tfdist.optimizers.LARS"):
        assert tfdist.callbacks.LARS is optimizers.LARS
    assert tfdist.launch.expand_nodelist("n[1-2]") == ["n1", "n2"]
    assert tfdist.tuning.make_plan is importlib.import_module("tfdist.tuning.plan").make_plan
    assert tfdist.LaunchError is tfdist.launch.LaunchError


def test_launch_and_tuning_load_without_tensorflow():
    # tfdist-run and the early settings must start fast: no TensorFlow behind these imports.
    code = ("import sys, tfdist, tfdist.launch.runner, tfdist.launch.recovery, tfdist.tuning.startup, "
            "tfdist.tuning.environment\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras', 'horovod')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_readme_is_a_short_guide():
    # The reference lives in docs/ (built by tests/test_docs_site.py); the README stays a guide.
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move reference material into docs/"
