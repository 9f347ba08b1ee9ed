"""Packaging: the library ships its type annotations (PEP 561's ``py.typed`` marker)."""

from __future__ import annotations

import importlib.resources
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = None

REPO = Path(__file__).resolve().parents[2]


def test_the_installed_package_has_its_py_typed_marker() -> None:
    marker = importlib.resources.files("nostall").joinpath("py.typed")
    assert marker.is_file()
    assert marker.read_bytes() == b""


def test_pyproject_ships_py_typed_as_package_data() -> None:
    if tomllib is None:  # pragma: no cover
        text = (REPO / "pyproject.toml").read_text()
        assert '[tool.setuptools.package-data]\nnostall = ["py.typed"]' in text
        return
    conf = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "py.typed" in conf["tool"]["setuptools"]["package-data"]["nostall"]
