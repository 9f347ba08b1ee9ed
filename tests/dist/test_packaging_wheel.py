"""Packaging: a wheel built from the source tree holds ``nostall/py.typed`` (built from a copy, so the
tree gets no build/ directory)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_a_built_wheel_ships_py_typed(tmp_path: Path) -> None:
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(REPO / "pyproject.toml", src)
    shutil.copy(REPO / "README.md", src)
    shutil.copytree(REPO / "src" / "nostall", src / "src" / "nostall",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path / "wheels"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(src)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = out.glob("nostall-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "nostall/py.typed" in names
    assert "nostall/loading/verify.py" in names and "nostall/tools/cli.py" in names
