"""The cost rule of ``impl="auto"`` where it cannot time: predicted forward+backward ms.

While a CUDA Graph is captured, or torch.compile traces with symbolic sizes, nothing may
be timed, so ``dispatch`` ranks the implementations by this rule. Every implementation's time is
modelled as a sum of per-step and per-layer terms, the step loop being what bounds it
on a GPU (docs/rnn-op.md):

    ms = us_step * S / 1e3 + w * S * G*H*H / 1e9 + s * S * B*G*H / 1e9 + layer * L*D

with S = T * L * D sequential steps (layers x directions), G gates. ``COSTS`` holds the
four constants per (implementation, memory, dtype class), fitted by ``fit`` to the
measured tables in docs/results/ (relative least squares, constants >= 0);
tests/ops/test_rnn_cost.py checks the rule against those tables. An implementation
without constants is never preferred by the rule.

The planner prices the op's forward and backward calls with ``phase_ms`` (the op's
time formula, ``formulas.register_time_formula``): the rule's stash time split by
``FORWARD_SHARE``, and for ``memory="recompute"`` of an LSTM or GRU the backward plus
``RECOMPUTE_EXTRA``, fitted by ``fit_extra`` to what recompute added in the same tables
(the difference of the two independent fits is noise at small batches: 0.01 ms
predicted where 0.23 ms was measured).

    python -m mirrorgrad.ops.rnn.time_model RESULTS.json ...

prints the constants fitted to `mirrorgrad bench --suite rnn-kernels` results (the
module methods ``mgnn-<impl>``), for COSTS.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

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
# or GRU's step (fit_extra: absolute least squares, >= 0). fp32: fitted to
# docs/results/rnn-memory-mode-timing-h100.json (H100, TF32, 11 LSTM and
# GRU stacks, forward and backward timed inside one step, the modes in alternating rounds);
# half: to the H200 bf16 table (docs/results/rnn-kernels-h200/), older kernels.
RECOMPUTE_EXTRA: dict[str, tuple[float, float, float, float]] = {
    "fp32": (0.0, 0.11, 10.026, 0.102),
    "half": (0.0, 0.0, 0.0, 0.158),
}
# The forward's share of forward+backward with memory="stash": the mean over the rows of the
# same H100 file (timing_forward_share).
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


def fit(samples: Iterable[tuple[Shape, float]]) -> tuple[float, ...]:
    """Constants (>= 0) minimising the squared relative error of the rule over measured
    (shape, ms) samples."""
    import numpy as np

    samples = list(samples)
    features = np.array([s.features() for s, _ in samples])
    measured = np.array([ms for _, ms in samples])
    return _nonnegative_lstsq(features / measured[:, None], np.ones(len(samples)))


def _nonnegative_lstsq(a, b) -> tuple[float, ...]:
    """Least squares of ``a @ c = b`` with negative constants dropped one at a time."""
    import numpy as np

    active = list(range(a.shape[1]))
    while True:
        constants = np.zeros(a.shape[1])
        constants[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
        if (constants >= 0).all():
            return tuple(round(float(c), 3) for c in constants)
        active.remove(int(np.argmin(constants)))


def fit_extra(samples: Iterable[tuple[Shape, float]]) -> tuple[float, ...]:
    """Constants (>= 0) minimising the squared error (in ms, not relative: the measured
    differences come near zero) of RECOMPUTE_EXTRA's sum over (shape, recompute - stash ms).
    Never below zero: where recompute measured faster the rule says it costs nothing."""
    import numpy as np

    samples = list(samples)
    features = np.array([s.features() for s, _ in samples])
    return _nonnegative_lstsq(features, np.array([ms for _, ms in samples]))


def _timing_shape(row: dict) -> Shape:
    """The Shape of a ``bench/op_memory_timing`` row (older files: 2-layer LSTMs, T 35)."""
    return Shape(mode=row.get("mode", "lstm"), T=row.get("T", 35), B=row["batch"],
                 H=row["hidden"], layers=row["layers"],
                 directions=row.get("directions", 1))  # fmt: skip


def _step_ms(times: dict) -> float:
    return times.get("step_ms", times["forward_ms"] + times["backward_ms"])


def timing_extra_samples(rows: Iterable[dict]) -> list[tuple[Shape, float]]:
    """(shape, what recompute added to the op's forward+backward, ms) of each LSTM or GRU
    row of ``bench/op_memory_timing`` results: the samples RECOMPUTE_EXTRA is fitted to.
    The whole step, not its backward alone: the rule prices both modes' forwards alike."""
    return [
        (shape, _step_ms(row["recompute"]) - _step_ms(row["stash"]))
        for row in rows
        if (shape := _timing_shape(row)).mode in ("lstm", "gru")
    ]


def timing_forward_share(rows: Iterable[dict]) -> float:
    """The mean share of the forward in forward+backward with memory="stash"."""
    shares = [row["stash"]["forward_ms"] / _step_ms(row["stash"]) for row in rows]
    return sum(shares) / len(shares)


def shape_of(workload: str) -> Shape:
    """The Shape of an rnn-kernels workload, rnn-<mode>-L<l>-I<i>-H<h>-B<b>-T<t>[-bi]."""
    parts = workload.split("-")
    sizes = {p[0]: int(p[1:]) for p in parts[2:] if p[:1] in "LIHBT" and p[1:].isdigit()}
    return Shape(mode=parts[1], T=sizes["T"], B=sizes["B"], H=sizes["H"], layers=sizes["L"],
                 directions=2 if parts[-1] == "bi" else 1)  # fmt: skip


def fit_results(docs: Iterable[dict]) -> dict[tuple[str, str, str], tuple[float, ...]]:
    """COSTS entries fitted to rnn-kernels results: one per module method ``mgnn-<impl>``
    (memory: the module's default, or stash for ``-stash``), mode-independent as COSTS."""
    samples: dict[tuple[str, str, str], list[tuple[Shape, float]]] = {}
    for doc in docs:
        dtype = "fp32" if doc["options"]["dtype"] == "fp32" else "half"
        for name, workload in doc["workloads"].items():
            shape = shape_of(name)
            for m in workload["methods"]:
                if m["status"] != "ok" or not m["method"].startswith("mgnn-"):
                    continue
                impl, _, memory = m["method"][5:].partition("-")
                memory = memory or ("recompute" if shape.mode == "lstm" else "stash")
                key = (impl, memory_class(impl, memory), dtype)
                samples.setdefault(key, []).append((shape, m["median_ms"]))
    return {key: fit(rows) for key, rows in samples.items() if len(rows) >= 4}


if __name__ == "__main__":
    fitted = fit_results(json.loads(Path(path).read_text()) for path in sys.argv[1:])
    for key, constants in sorted(fitted.items()):
        print(f"    {key}: {constants},")
