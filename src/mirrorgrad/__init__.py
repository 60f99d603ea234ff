"""mirrorgrad: train recurrent networks (and any PyTorch model) in less GPU memory, faster.

Public API:
- ``mirrorgrad.compile(model, mode=...)``: torch.compile with the mirror planner.
- ``mirrorgrad.backend(...)``: the planner as a ``torch.compile`` backend.
- ``mirrorgrad.explain(model, *inputs)``: the plan, printable and JSON-able.
- ``mirrorgrad.mark(module, mirror=...)``: per-module override of the policy.
- ``mirrorgrad.nn``: drop-in ``LSTM``, ``GRU``, ``RNN``.
- ``mirrorgrad.callbacks``: training-loop loggers (TensorBoard).
"""

from __future__ import annotations

__version__ = "0.1.0"
