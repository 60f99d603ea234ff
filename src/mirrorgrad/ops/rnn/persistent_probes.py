"""What benchmarks record of the persistent kernels: per-step timestamps of the next
launches (``recording``) and what each kernel compiled to (``COMPILED``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import Tensor

# While ``recording``: kind ("fwd" / "bwd") -> int64 [groups, programs, T, STAMPS] of the
# last such launch (backward: steps in the order run, T-1 first); None otherwise.
PROBES: dict[str, Tensor] | None = None
# Which stamps a recording launch writes, 1-3 (persistent_kernels.py's STAMPS comment).
PROBE_LEVEL = 1
# Compiled kernels by (kind, mode, dtype, plan): registers, spills, shared memory.
COMPILED: dict[tuple, dict[str, int]] = {}


@contextlib.contextmanager
def recording(level: int = 1) -> Iterator[dict[str, Tensor]]:
    """Launches in the block (GPU only) stamp each step's phases at ``level`` into the
    dict this yields; they run uncaptured (the stamps are allocated per launch)."""
    global PROBES, PROBE_LEVEL
    if not 1 <= level <= 3:
        raise ValueError(f"probe level must be 1, 2 or 3, got {level}")
    before = PROBES, PROBE_LEVEL
    PROBES, PROBE_LEVEL = {}, level
    try:
        yield PROBES
    finally:
        PROBES, PROBE_LEVEL = before
