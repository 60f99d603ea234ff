"""No module imports up a layer, and the layers have no cycle (docs/ARCHITECTURE.md).

Every package and top-level module of src/mirrorgrad has a row in ``ALLOWED``; a new one
fails `test_every_package_and_module_has_a_row` until it is given one.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "mirrorgrad"
ROOT = "__init__"  # the package itself: `import mirrorgrad`, `from mirrorgrad import compile`

# Bottom layer, importable from anywhere: _compat (every private torch name), _units (byte
# formatting), _timing (the one step timer), _folders (is an output folder writable),
# _cuda_graphs (warm up on a side stream, then capture a CUDA Graph), formulas (what
# custom ops declare to the planner: ops register, graph reads), options (the planner's
# options).
BOTTOM = {"_compat", "_units", "_timing", "_folders", "_cuda_graphs", "formulas", "options"}
# row -> the mirrorgrad packages/modules it may import (besides itself); every row lists
# only rows above it in this table.
ALLOWED = {
    "_compat": set(),
    "_units": set(),
    "_timing": set(),
    "_folders": set(),
    "_cuda_graphs": set(),
    "formulas": set(),
    "options": set(),
    # graph/mirror and ops/nn are two stacks that meet in compiler.
    "graph": BOTTOM,
    "ops": BOTTOM,
    # op_memory decides our RNN op's memory mode, so the planner knows that op's schema.
    "mirror": BOTTOM | {"graph", "ops"},
    "nn": BOTTOM | {"ops"},
    # The copies a guarded first backward falls back on (sized from the plan).
    "safety_copies": BOTTOM | {"mirror"},
    "compiler": BOTTOM | {"graph", "mirror", "safety_copies"},
    # Usable from any training loop, ours included.
    "callbacks": BOTTOM,
    # The public API (imported lazily by name).
    ROOT: BOTTOM | {"compiler", "mirror", "nn", "callbacks"},
    # train is a client of the public API (`mirrorgrad.compile`, `mirrorgrad.explain`).
    "train": BOTTOM | {"graph", "ops", "mirror", "nn", "compiler", "callbacks", ROOT},
    # The LM-step suite (bench/lm_step.py) runs train's step and loop.
    "bench": BOTTOM | {"graph", "ops", "mirror", "nn", "compiler", "callbacks", ROOT, "train"},
    "cli": BOTTOM | {ROOT, "train", "bench"},
    "__main__": {"cli"},
}
# A string that names one of our modules: importlib's argument in __init__'s and cli's
# tables of lazily imported modules.
_MODULE_NAME = re.compile(r"mirrorgrad(\.[A-Za-z_]\w*)+")


def _rows() -> set[str]:
    """Every package and top-level module in src/mirrorgrad, as a row name."""
    rows = {p.stem for p in SRC.glob("*.py")}
    rows |= {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    return rows


def _files(row: str) -> list[pathlib.Path]:
    if (SRC / row).is_dir():
        return sorted((SRC / row).rglob("*.py"))
    return [SRC / f"{row}.py"]


def _imports(path: pathlib.Path, rows: set[str]) -> set[str]:
    """The rows `path` imports: statements anywhere (also inside functions) and dotted
    module names in strings (importlib)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names += [node.value] if _MODULE_NAME.fullmatch(node.value) else []
    found = set()
    for name in names:
        parts = name.split(".")
        if parts[0] != "mirrorgrad":
            continue
        # `from mirrorgrad import compile` and `import mirrorgrad` go through __init__.
        found.add(parts[1] if len(parts) > 1 and parts[1] in rows else ROOT)
    return found




def test_every_package_and_module_has_a_row():
    rows = _rows()
    assert rows - ALLOWED.keys() == set(), "give each a row in ALLOWED"
    assert ALLOWED.keys() - rows == set(), "rows of packages/modules that are gone"


def test_each_row_imports_only_rows_above_it():
    # Listing only earlier rows makes the table an order: no cycle between packages.
    order = list(ALLOWED)
    for row, allowed in ALLOWED.items():
        later = {a for a in allowed if order.index(a) >= order.index(row)}
        assert not later, f"{row} may import {sorted(later)}, listed at or below it"


def test_no_import_goes_up_a_layer():
    rows, bad = _rows(), []
    for row, allowed in ALLOWED.items():
        for path in _files(row):
            for imported in _imports(path, rows) - allowed - {row}:
                bad.append(f"{path.relative_to(SRC)} imports mirrorgrad.{imported}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import mirrorgrad", {ROOT}),
        ("from mirrorgrad import compile, _compat", {ROOT, "_compat"}),
        ("import mirrorgrad.nn", {"nn"}),
        ("def f():\n    from mirrorgrad.train.loop import train", {"train"}),
        ("M = {'train': ('mirrorgrad.train.command', 'help')}", {"train"}),
        ("'''Docs name mirrorgrad.train.stop.Interrupted in prose.'''", set()),
        ("from . import cells\nimport torch", set()),
    ],
)
def test_imports_are_read_from_statements_and_module_names(tmp_path, source, expected):
    path = tmp_path / "module.py"
    path.write_text(source)
    assert _imports(path, _rows()) == expected
