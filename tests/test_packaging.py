"""The distribution ships every part of the package: the folders do not nest, so pyproject lists them."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _package_folders() -> set[str]:
    """Every folder under services/ (the package root, links included) that holds Python modules."""
    found = set()
    for folder, dirs, files in os.walk(ROOT / "services", followlinks=True):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
        if any(f.endswith(".py") for f in files):
            relative = Path(folder).relative_to(ROOT / "services")
            found.add(".".join(("prefixgrove", *relative.parts)))
    return found


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    assert _package_folders() == listed


def test_no_top_level_folder_shadows_the_standard_library_or_transformers_probes():
    # `operator` would shadow the standard library and `kernels` a package transformers looks for,
    # whenever Python runs from the repository root.
    for name in ("operator", "kernels", "proto"):
        assert not (ROOT / name / "__init__.py").exists(), (
            f"{name}/__init__.py makes {name} importable"
        )
