"""mirrorgrad: train recurrent networks (and any PyTorch model) in less GPU memory, faster.

Public API:
- ``mirrorgrad.compile(model, mode=...)``: torch.compile with the mirror planner.
- ``mirrorgrad.backend(...)``: the planner as a ``torch.compile`` backend; once
  installed, also ``torch.compile(model, backend="mirrorgrad", options={...})``.
- ``mirrorgrad.MirrorOptions``: the planner's options (mode, budget, overhead cap).
- ``mirrorgrad.explain(model, *inputs)``: the plan, printable and JSON-able.
- ``mirrorgrad.mark(module, mirror=...)``: per-module override of the policy.
- ``mirrorgrad.nn``: drop-in ``LSTM``, ``GRU``, ``RNN``.
- ``mirrorgrad.callbacks``: training-loop loggers (TensorBoard).
"""

from __future__ import annotations

import importlib
from importlib import metadata

try:
    __version__ = metadata.version("mirrorgrad")
except metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

# Imported on first use: `import mirrorgrad` stays cheap and a CLI subcommand loads
# only what it needs.
_LAZY = {
    "compile": ("mirrorgrad.compiler", "compile"),
    "backend": ("mirrorgrad.compiler", "backend"),
    "explain": ("mirrorgrad.compiler", "explain"),
    "mark": ("mirrorgrad.mirror.policy", "mark"),
    "MirrorOptions": ("mirrorgrad.options", "MirrorOptions"),
    "MirrorgradFallbackWarning": ("mirrorgrad.mirror.partition", "MirrorgradFallbackWarning"),
    "MirrorgradBudgetWarning": ("mirrorgrad.mirror.plan", "MirrorgradBudgetWarning"),
    "nn": ("mirrorgrad.nn", None),
    "callbacks": ("mirrorgrad.callbacks", None),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'mirrorgrad' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    return module if attr is None else getattr(module, attr)
