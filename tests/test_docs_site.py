"""The documentation site (mkdocs.yml): built strictly, complete, and readable in a real browser.

- `mkdocs build --strict` passes: no broken link or anchor, no page missing from the nav, no
  docstring that Griffe warns about (a documented parameter the signature lacks, ...);
- the nav lists every page under docs/ (benchmark reports aside), and the API pages cover the
  public names of each package (`__all__`, tfdist.pipelines' lazy exports, the console scripts);
- headless Chromium shows, on the HorovodStrategy page, every parameter of
  `HorovodStrategy.__init__` with its type annotation and a description, and takes a screenshot;
- strictness itself: the same build with one broken link fails.

`bash scripts/docs.sh build` runs the same build; `bash scripts/docs.sh screenshot` re-takes the
screenshot kept in docs/images/.
"""

import ast
import configparser
import html
import html.parser
import inspect
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from browser import chromium_or_skip, dump_dom, screenshot

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
API = DOCS / "api"
# Material for MkDocs prints a banner about its successor on every run; it is not a build warning.
ENV = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}


def _mkdocs_or_fail():
    try:
        import mkdocs  # noqa: F401
        import mkdocstrings  # noqa: F401
    except ImportError as error:
        pytest.fail(f"the docs tools are missing ({error}): pip install -e '.[docs]', or "
                    "bash scripts/bootstrap.sh (it installs setup.cfg's docs extra)")


def _build(site_dir, config=ROOT / "mkdocs.yml"):
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--clean", "-f", str(config),
                           "-d", str(site_dir)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built strictly into a temporary folder (never the repository's site/)."""
    _mkdocs_or_fail()
    site_dir = tmp_path_factory.mktemp("docs") / "site"
    out = _build(site_dir)
    warnings = [line for line in (out.stdout + out.stderr).splitlines() if "WARNING" in line or "ERROR" in line]
    assert out.returncode == 0, ("mkdocs build --strict failed:\n" + "\n".join(warnings) + "\n"
                                 + out.stderr[-4000:])
    assert not warnings, "\n".join(warnings)
    return site_dir


def _nav_pages(nav):
    """Every page path in mkdocs.yml's nav (titles and sections unwrapped)."""
    for item in nav:
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            for value in item.values():
                yield from ([value] if isinstance(value, str) else _nav_pages(value))


def test_every_page_is_in_the_nav():
    """mkdocs only logs pages missing from an explicit nav (mkdocs.yml also makes that a warning)."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    if not config.get("nav"):
        return  # automatic nav: every page is in it
    in_nav = {page for page in _nav_pages(config["nav"]) if not re.match(r"[a-z]+://", page)}
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")
             if p.relative_to(DOCS).parts[0] != "benchmarks"}  # raw benchmark reports: linked, not listed
    missing = sorted(pages - in_nav)
    assert not missing, f"pages under docs/ missing from mkdocs.yml's nav: {missing}: add them to `nav:`"


def _module_list(path, name):
    """A module-level list/dict/set literal (`__all__`, `_EXPORTS`), read without importing."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path}: no {name}")


def _public_defs(path, kind):
    return [node.name for node in ast.parse(path.read_text()).body
            if isinstance(node, kind) and not node.name.startswith("_")]


def test_api_pages_cover_the_public_names(site):
    """Each public name has its anchor on its area's page, so a new export cannot go undocumented."""
    expected = {
        "strategy": ["tfdist.strategy.HorovodStrategy"],
        "callbacks": [f"tfdist.callbacks.{n}" for n in _module_list(ROOT / "callbacks/__init__.py", "__all__")],
        "optimizers": [f"tfdist.optimizers.{n}" for n in _module_list(ROOT / "tfdist/optimizers/__init__.py", "__all__")],
        "pipelines": [f"tfdist.pipelines.{module}.{name}"
                      for module, name in _module_list(ROOT / "pipelines/__init__.py", "_EXPORTS").values()],
        "compression": [f"tfdist.exchange.compression.{n}"
                        for n in _public_defs(ROOT / "tfdist/exchange/compression.py", ast.ClassDef)],
        "errors": [f"tfdist.errors.{n}" for n in _public_defs(ROOT / "tfdist/errors.py", ast.ClassDef)],
        "tuning": [f"tfdist.tuning.plan.{n}"
                   for n in ("Plan", "Topology", "make_plan", "detect_topology", "in_effect")],
        "precision": ["tfdist.precision.set_policy", "tfdist.precision.choose_policy"],
    }
    problems = []
    for page, identifiers in expected.items():
        text = (site / "api" / f"{page}.html").read_text()
        problems += [f"api/{page}.md: {i}" for i in identifiers if f'id="{i}"' not in text]
    assert not problems, "public names without an entry in the API reference:\n" + "\n".join(problems)

    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    scripts = [line.split("=")[0].strip() for line in
               setup["options.entry_points"]["console_scripts"].strip().splitlines()]
    cli = (API / "cli.md").read_text()
    assert len(scripts) >= 8
    assert not [s for s in scripts if f"`{s}`" not in cli], "console scripts missing from docs/api/cli.md"


class _Tables(html.parser.HTMLParser):
    """Every <table> in a page, as rows of cell texts (whitespace collapsed)."""

    def __init__(self):
        super().__init__()
        self.tables, self._rows, self._cells, self._text = [], None, None, None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self._rows = []
        elif tag == "tr" and self._rows is not None:
            self._cells = []
        elif tag in ("td", "th") and self._cells is not None:
            self._text = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._text is not None:
            self._cells.append(" ".join("".join(self._text).split()))
            self._text = None
        elif tag == "tr" and self._cells is not None:
            self._rows.append(self._cells)
            self._cells = None
        elif tag == "table" and self._rows is not None:
            self.tables.append(self._rows)
            self._rows = None

    def handle_data(self, data):
        if self._text is not None:
            self._text.append(data)


def _annotation_text(annotation):
    if isinstance(annotation, str):  # `from __future__ import annotations`: the source text
        return annotation
    return inspect.formatannotation(annotation).replace("typing.", "")


def test_horovod_strategy_page_in_chromium(site, tmp_path):
    from tfdist.strategy import HorovodStrategy

    parameters = list(inspect.signature(HorovodStrategy.__init__).parameters.values())[1:]
    assert parameters, "HorovodStrategy.__init__ takes no parameters?"
    unannotated = [p.name for p in parameters if p.annotation is inspect.Parameter.empty]
    assert not unannotated, f"HorovodStrategy.__init__ parameters without a type annotation: {unannotated}"

    chromium = chromium_or_skip()
    url = (site / "api" / "strategy.html").as_uri()
    dom = dump_dom(chromium, url, budget_ms=5000)
    parser = _Tables()
    parser.feed(dom)
    # Angle brackets in a docstring are text, not tags; the signature lists one parameter a line.
    shown = html.unescape(re.sub(r"<[^>]+>", "", dom))
    assert '"powersgd:<rank>"' in shown and '"topk:<density>"' in shown, "the compression values lost their <...>"
    signature = re.search(r"HorovodStrategy\(\n(.*?)\n\)", shown, re.S)
    assert signature, "no HorovodStrategy(...) signature on the page"
    odd = [line for line in signature[1].splitlines()
           if not re.fullmatch(r"    (\*|\w+: .+ = .+),", line)]
    assert not odd, f"signature lines that are not 'name: type = default,': {odd}"
    # The docstring's Args: section, rendered as mkdocstrings' parameter table.
    tables = [t for t in parser.tables if t and t[0][:3] == ["Name", "Type", "Description"]
              and "Default" in t[0]]
    assert tables, "no Parameters table on the HorovodStrategy page (no Args: section in its docstring?)"
    rows = {row[0].lstrip("*"): row for row in tables[0][1:] if len(row) >= 3}
    problems = []
    for p in parameters:
        if p.name not in rows:
            problems.append(f"{p.name}: not in the Parameters table (document it under Args:)")
            continue
        _, shown_type, description = rows[p.name][:3]
        want = _annotation_text(p.annotation)
        if re.sub(r"\s+", "", shown_type) != re.sub(r"\s+", "", want):
            problems.append(f"{p.name}: type shown {shown_type!r}, annotation {want!r}")
        if len(description.split()) < 3:
            problems.append(f"{p.name}: description {description!r} is too short")
    assert not problems, "HorovodStrategy API page:\n" + "\n".join(problems)

    png = screenshot(chromium, url, tmp_path / "api_horovod_strategy.png", budget_ms=5000, size="1400,2200")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    assert struct.unpack(">II", data[16:24]) == (1400, 2200)
    assert len(data) > 50_000, f"screenshot of {len(data)} bytes: a blank page?"


def test_strict_build_fails_on_a_broken_link(site, tmp_path):
    """The same config over a copy of docs/ with one broken link: the build must fail and say why."""
    docs = tmp_path / "docs"
    shutil.copytree(DOCS, docs)
    page = docs / "api" / "index.md"
    page.write_text(page.read_text() + "\nSee [a page that is not there](no-such-page.md).\n")
    # mkdocs.yml as it is, only docs_dir moved (mkdocs' CLI cannot override it).
    code = """if True:
        import logging, sys
        from mkdocs.commands.build import build
        from mkdocs.config import load_config
        from mkdocs.exceptions import Abort
        logging.getLogger("mkdocs").addHandler(logging.StreamHandler())  # as the CLI: warnings to stderr
        try:
            build(load_config(sys.argv[1], docs_dir=sys.argv[2], site_dir=sys.argv[3], strict=True))
        except Abort as error:
            sys.exit(str(error))
    """
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "mkdocs.yml"), str(docs), str(tmp_path / "site")],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    output = out.stdout + out.stderr
    assert out.returncode != 0, f"a broken link did not fail the strict build:\n{output[-3000:]}"
    assert "no-such-page.md" in output, output[-3000:]
