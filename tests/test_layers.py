"""No module imports up a layer (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "mirrorgrad"
# package -> the mirrorgrad packages/modules it may import (besides itself)
# Bottom layer, importable from anywhere: _compat, _units (byte formatting), _timing (the
# one step timer), formulas (what custom ops declare to the planner: ops register, graph
# reads).
BOTTOM = {"_compat", "_units", "_timing", "formulas"}
ALLOWED = {
    "_compat": set(),
    "_units": set(),
    "_timing": set(),
    "formulas": set(),
    "options": set(),
    "graph": BOTTOM,
    # op_memory decides our RNN op's memory mode, so the planner knows that op's schema.
    "mirror": BOTTOM | {"options", "graph", "ops"},
    "compiler": BOTTOM | {"options", "graph", "mirror"},
    "ops": BOTTOM,
    "nn": BOTTOM | {"ops"},
}


def _imports(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "mirrorgrad" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_no_import_goes_up_a_layer():
    bad = []
    for package, allowed in ALLOWED.items():
        files = [SRC / f"{package}.py"] if (SRC / f"{package}.py").exists() else []
        files += sorted((SRC / package).rglob("*.py")) if (SRC / package).is_dir() else []
        assert files, package
        for path in files:
            for imported in _imports(path) - allowed - {package, "__version__"}:
                bad.append(f"{path.relative_to(SRC)} imports mirrorgrad.{imported}")
    assert not bad, "\n".join(bad)
