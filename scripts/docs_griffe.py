"""Griffe extension for the docs build (mkdocs.yml): read `tfdist.callbacks` and `tfdist.pipelines`
from the repository folders they install from.

setup.cfg's `package_dir` installs the top-level folders callbacks/ and pipelines/ as
`tfdist.callbacks` and `tfdist.pipelines`. Griffe reads packages from disk, statically (nothing is
imported, so no TensorFlow), and finds only tfdist/ for `tfdist`: this extension loads each
`package_dir` folder as the submodule it installs as, every time Griffe loads the package above it.
The mapping is read from setup.cfg, so a folder added there is documented without a change here.
"""

from __future__ import annotations

import configparser
from pathlib import Path

import griffe

ROOT = Path(__file__).resolve().parent.parent


def package_dirs(setup_cfg: Path = ROOT / "setup.cfg") -> dict[str, Path]:
    """setup.cfg's `[options] package_dir`: installed package name -> folder in the repository."""
    parser = configparser.ConfigParser()
    parser.read(setup_cfg, encoding="utf-8")
    mapping = {}
    for line in parser.get("options", "package_dir", fallback="").splitlines():
        name, sep, folder = line.partition("=")
        if sep and name.strip():  # "" = src would be a whole-tree remap: not used here
            mapping[name.strip()] = setup_cfg.parent / folder.strip()
    return mapping


class PackageDirs(griffe.Extension):
    """Attach setup.cfg's `package_dir` folders to the packages Griffe loads."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs) -> None:
        for name, folder in sorted(package_dirs().items()):
            parent_path, _, child = name.rpartition(".")
            if parent_path.split(".", 1)[0] != pkg.name or not (folder / "__init__.py").is_file():
                continue
            parent = pkg if parent_path == pkg.name else pkg.get_member(parent_path[len(pkg.name) + 1:])
            module = _load_tree(loader, child, folder, parent)
            loader.expand_exports(module)
            loader.expand_wildcards(module, external=False)


def _load_tree(loader: griffe.GriffeLoader, name: str, path: Path, parent: griffe.Module) -> griffe.Module:
    """Visit a module file or package folder (and its submodules) as `parent.name`."""
    filepath = path / "__init__.py" if path.is_dir() else path
    code = filepath.read_text(encoding="utf-8-sig")
    loader.lines_collection[filepath] = code.splitlines(keepends=False)
    module = griffe.visit(name, filepath=filepath, code=code, parent=parent, extensions=loader.extensions,
                          docstring_parser=loader.docstring_parser, docstring_options=loader.docstring_options,
                          lines_collection=loader.lines_collection, modules_collection=loader.modules_collection)
    parent.set_member(name, module)
    if path.is_dir():
        for child in sorted(path.iterdir()):
            if child.suffix == ".py" and child.name != "__init__.py" and "." not in child.stem:
                _load_tree(loader, child.stem, child, module)
            elif child.is_dir() and (child / "__init__.py").is_file():
                _load_tree(loader, child.name, child, module)
    return module
