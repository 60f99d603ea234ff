"""Checkpoints: atomic writes, loads with ``weights_only=True``, and RNG states as tensors.

Everything stored is a tensor or a plain Python value, so a checkpoint loads without
unpickling arbitrary objects.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT = 1
LAST = "last.pt"


def save(state: dict[str, Any], path: Path) -> None:
    """Writes a temporary file beside ``path`` and renames it: a crash never leaves a
    half-written checkpoint under the real name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        torch.save({"format": FORMAT, **state}, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load(path: Path) -> dict[str, Any]:
    if path.is_dir():
        path = path / LAST
    if not path.is_file():
        raise FileNotFoundError(f"--resume {path}: no checkpoint there")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {state.get('format')}, expected {FORMAT}")
    return state


def rng_state() -> dict[str, Any]:
    """torch (CPU and every CUDA device), Python and NumPy generator states."""
    version, internal, gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {
            "kind": np_kind,
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["gauss"]))
