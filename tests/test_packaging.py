"""The distribution's layout: each of the card's Python folders is a source root holding one import
package, every module has one path (no links), and no top-level folder is importable by itself."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
    "packages"
]["find"]["where"]


def test_every_folder_holding_modules_is_a_package_of_the_distribution():
    for root in SOURCE_ROOTS:
        for py in (ROOT / root).rglob("*.py"):
            if "__pycache__" in py.parts or py.parent == ROOT / root:
                continue
            assert (py.parent / "__init__.py").exists(), f"{py.parent} lacks __init__.py"
        found = find_packages(str(ROOT / root), include=["prefixgrove*"])
        assert found, f"{root}/ holds no prefixgrove package"


def test_the_tree_holds_no_symbolic_links():
    tracked = subprocess.run(
        ["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    links = [line.split("\t", 1)[1] for line in tracked if line.startswith("120000")]
    assert links == [], f"symbolic links give modules a second path: {links}"


def test_no_top_level_folder_shadows_the_standard_library_or_transformers_probes():
    # `operator` would shadow the standard library and `kernels` a package transformers looks for,
    # whenever Python runs from the repository root.
    for name in ("operator", "kernels", "proto", "services"):
        assert not (ROOT / name / "__init__.py").exists(), (
            f"{name}/__init__.py makes {name} importable"
        )
