"""Root conftest: what pytest's ``--doctest-modules`` (pyproject.toml) must not import from src/nostall.

A module whose top-level imports need an optional package is left out only when that package is
missing (then it cannot be imported at all); every other module's doctests run. ``__main__.py`` is
never imported by pytest (running it is the CLI). The tests' own fixtures: tests/conftest.py.
"""

from __future__ import annotations

import importlib.util

_NEEDS = {  # module (path from here) -> the optional packages it imports at its top
    "src/nostall/tools/reference/ray_train.py": ("ray",),
}

collect_ignore_glob = [path for path, mods in _NEEDS.items() if any(importlib.util.find_spec(m) is None for m in mods)]
