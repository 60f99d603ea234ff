"""The cost rule of ``impl="auto"`` where it cannot time: predicted forward+backward ms.

While a CUDA Graph is captured, or torch.compile traces with symbolic sizes, nothing may
be timed, so ``dispatch`` ranks the implementations by this rule. Every implementation's time is
modelled as a sum of per-step and per-layer terms, the step loop being what bounds it
on a GPU (docs/rnn-op.md):

    ms = us_step * S / 1e3 + w * S * G*H*H / 1e9 + s * S * B*G*H / 1e9 + layer * L*D

with S = T * L * D sequential steps (layers x directions), G gates. ``COSTS`` holds the
four constants per (implementation, memory, dtype class), fitted to the measured tables
in docs/results/ (relative least squares, constants >= 0: benchmarks/fit_time_model.py);
tests/ops/test_rnn_cost.py checks the rule against those tables. An implementation
without constants is never preferred by the rule.

The planner prices the op's forward and backward calls with ``phase_ms`` (the op's
time formula, ``formulas.register_time_formula``): the rule's stash time split by
``FORWARD_SHARE``, and for ``memory="recompute"`` of an LSTM or GRU the backward plus
``RECOMPUTE_EXTRA``, fitted to what recompute added in the same tables (the difference
of the two independent fits is noise at small batches: 0.01 ms predicted where 0.23 ms
was measured).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mirrorgrad.ops.rnn.cell_modes import GATES


@dataclass(kw_only=True, slots=True, frozen=True)
class Shape:
    """What the rule reads of a stack call."""

    mode: str
    T: int
    B: int
    H: int
    layers: int
    directions: int

    def features(self) -> list[float]:
        steps = self.T * self.layers * self.directions
        gh = GATES[self.mode] * self.H
        return [steps / 1e3, steps * gh * self.H / 1e9, steps * self.B * gh / 1e9,
                float(self.layers * self.directions)]  # fmt: skip


def dtype_class(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "half"


def memory_class(impl: str, memory: str) -> str:
    """cuDNN has one memory behaviour; ours differ by what is stashed."""
    return "-" if impl == "cudnn" else memory


# (impl, memory class, dtype class) -> (us per step, per 1e9 step x W_hh elements, per
# 1e9 step x state elements, ms per layer-direction). Fitted on one H200 (torch 2.11,
# TF32 in fp32) to docs/results/rnn-kernels-h200/rnn_kernels_{fp32,bf16}.json, the
# kernels driven per layer (the module adds little: docs/rnn-op.md).
COSTS: dict[tuple[str, str, str], tuple[float, float, float, float]] = {
    ("cudnn", "-", "fp32"): (28.282, 0.0, 20.258, 1.131),
    ("triton", "stash", "fp32"): (12.028, 1.686, 50.326, 0.524),
    ("triton", "recompute", "fp32"): (11.518, 1.732, 70.388, 0.509),
    ("cudnn", "-", "half"): (34.139, 0.964, 23.492, 1.077),
    ("triton", "stash", "half"): (3.133, 2.675, 9.29, 0.666),
    ("triton", "recompute", "half"): (1.801, 2.851, 14.384, 0.758),
}


# dtype class -> constants over Shape.features(): what memory="recompute" adds to an LSTM's
# or GRU's step (absolute least squares, >= 0). fp32: fitted to
# docs/results/rnn-memory-mode-timing-h100.json (H100, TF32, 11 LSTM and
# GRU stacks, forward and backward timed inside one step, the modes in alternating rounds);
# half: to the H200 bf16 table (docs/results/rnn-kernels-h200/), older kernels.
RECOMPUTE_EXTRA: dict[str, tuple[float, float, float, float]] = {
    "fp32": (0.0, 0.11, 10.026, 0.102),
    "half": (0.0, 0.0, 0.0, 0.158),
}
# The forward's share of forward+backward with memory="stash": the mean over the rows of the
# same H100 file.
FORWARD_SHARE = 0.469


def predicted_ms(impl: str, memory: str, dtype: torch.dtype, shape: Shape) -> float | None:
    """The rule's forward+backward ms, or None where COSTS has no constants for it."""
    constants = COSTS.get((impl, memory_class(impl, memory), dtype_class(dtype)))
    if constants is None:
        return None
    # Plain Python: torch.compile traces this (numpy would break the graph).
    return sum(c * f for c, f in zip(constants, shape.features()))


def phase_ms(
    impl: str, memory: str, dtype: torch.dtype, shape: Shape, *, backward: bool
) -> float | None:
    """The rule's ms for the forward call or the backward call alone, or None where
    COSTS has no constants for ``impl``. ``memory`` is "stash" or "recompute"."""
    both = predicted_ms(impl, "stash", dtype, shape)
    if both is None:
        return None
    forward = FORWARD_SHARE * both
    if not backward:
        return forward
    extra = 0.0
    if memory == "recompute" and shape.mode in ("lstm", "gru"):
        constants = RECOMPUTE_EXTRA[dtype_class(dtype)]
        extra = sum(c * f for c, f in zip(constants, shape.features()))
    return both - forward + extra


def pick(candidates: Sequence[str], memory: str, dtype: torch.dtype, shape: Shape) -> str:
    """The candidate with the lowest predicted time; the first where none is predicted
    (candidates without constants are never preferred)."""
    # A plain loop: torch.compile traces it with symbolic shapes (min(dict, key=...) breaks).
    best, best_ms = candidates[0], None
    for candidate in candidates:
        ms = predicted_ms(candidate, memory, dtype, shape)
        if ms is not None and (best_ms is None or ms < best_ms):
            best, best_ms = candidate, ms
    return best
