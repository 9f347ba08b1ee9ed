"""The house keeps its shape (docs/architecture.md): every module the map names exists, imports run down the
layers only, with no circle, no module imports another's underscore name, and only the storage layer asks
which kind of storage a location is."""

from __future__ import annotations

import ast
import pathlib
import re
from typing import Dict, List, Set, Tuple

ROOT = pathlib.Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "nostall"

# the layer of each room (a module may import from its own layer and the ones below)
LAYERS = {
    "nostall.errors": 0, "nostall.options": 0, "nostall.core": 0,
    "nostall.storage": 1, "nostall.planning": 2,
    "nostall.saving": 3, "nostall.loading": 3, "nostall.handles": 3, "nostall.memory": 3,
    "nostall.training": 4, "nostall.api": 4, "nostall.manager": 4, "nostall": 4,
    "nostall.dcp": 5, "nostall.interop": 5, "nostall.integrations": 5,
    "nostall.tools": 6, "nostall.__main__": 6,
}


def _modules() -> Dict[str, pathlib.Path]:
    out = {}
    for p in SRC.rglob("*.py"):
        name = ".".join(("nostall",) + p.relative_to(SRC).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def _layer(module: str) -> int:
    best = max((k for k in LAYERS if module == k or module.startswith(k + ".")), key=len)
    return LAYERS[best]


def _imports() -> List[Tuple[str, str, List[str], bool]]:
    """(importer, imported module, names, at module level) for every ``from nostall... import``."""
    out = []
    for m, p in _modules().items():
        tree = ast.parse(p.read_text())
        top = {id(n) for n in tree.body}
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("nostall") and n.level == 0:
                out.append((m, n.module, [a.name for a in n.names], id(n) in top))
    return out


def test_every_module_the_map_names_exists():
    text = (ROOT / "docs" / "architecture.md").read_text()
    rooms = "core|storage|planning|saving|loading|memory|interop|integrations|tools"
    named = set(re.findall(rf"`((?:{rooms})\.[a-z_]+)", text))
    assert named, "the map names no module"
    modules = _modules()
    missing = sorted(n for n in named if f"nostall.{n}" not in modules)
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_imports_run_down_the_layers():
    up = [(m, t) for m, t, _, _ in _imports() if t in _modules() and _layer(t) > _layer(m)
          and (m, t) != ("nostall", "nostall.interop.copy")]  # the package's lazy public name table
    assert not up, f"imports that reach up a layer: {up}"


def test_no_import_circle_at_module_level():
    edges: Dict[str, Set[str]] = {m: set() for m in _modules()}
    for m, t, _, top in _imports():
        if top and t in edges and t != m:
            edges[m].add(t)
    seen: Dict[str, int] = {}

    def visit(u: str, path: List[str]) -> None:
        seen[u] = 1
        for v in edges[u]:
            assert seen.get(v) != 1, f"import circle: {' -> '.join(path[path.index(v):] + [u, v])}"
            if v not in seen:
                visit(v, path + [u])
        seen[u] = 2

    for m in edges:
        if m not in seen:
            visit(m, [])


def test_no_module_imports_another_modules_underscore_names():
    private = [(m, t, n) for m, t, names, _ in _imports() for n in names
               if n.startswith("_") and not n.startswith("__") and t != m]
    assert not private, private


def test_only_the_storage_layer_asks_what_kind_of_location_it_has():
    asking = [str(p.relative_to(SRC)) for m, p in _modules().items()
              if not m.startswith("nostall.storage") and "is_remote(" in p.read_text()]
    assert not asking, asking
