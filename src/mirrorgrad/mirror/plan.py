"""What the planner hands back: a ``Plan`` (what the forward stashes, what the backward
recomputes, the estimated peak and time), the options it was asked with
(``PlanOptions``), what a budget fraction is of (``BudgetScale``), and the errors and
warnings planning raises. The modes that make plans: balance.py, budget_search.py,
planner.py (``plan``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from torch.fx import Node

from mirrorgrad._units import format_bytes as _fmt
from mirrorgrad.graph import liveness
from mirrorgrad.graph.cost import DeviceRates
from mirrorgrad.graph.joint import is_getitem
from mirrorgrad.mirror.policy import MirrorPolicy, op_name
from mirrorgrad.options import MirrorOptions

if TYPE_CHECKING:  # balance_target.py imports the planner, which imports this module
    from mirrorgrad.mirror.balance_target import BalanceTarget

# A budget missed by more than this fraction is declared (MirrorgradBudgetWarning).
BUDGET_TOLERANCE = 0.05
# The largest values alive at the peak that a plan's summary names.
FLOOR_VALUES = 5
# What an estimated peak counts (str(plan), the budget warning, the README).
PEAK_INCLUDES = (
    "one forward+backward of the compiled graph: parameters, inputs, gradients, saved "
    "and temporary values, the ops' declared temporaries; the cuBLAS workspaces are "
    "listed apart ('held outside', in the step peak); optimizer state and other memory "
    "held outside the graph (CUDA Graph pools, data) come on top"
)


class MirrorgradBudgetWarning(UserWarning):
    """The plan's estimated peak misses the budget asked for; says what holds the floor."""


class PlanError(RuntimeError):
    """The planner reached an inconsistent state (callers fall back to PyTorch's partition)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class BudgetScale:
    """What a budget fraction is of: PyTorch's ``activation_memory_budget`` rule.

    PyTorch's fraction F bounds the saved activations to ``floor + F * (default -
    floor)``: 1 is what its default partition saves, 0 what it saves recomputing all
    it may; within that bound it takes the least recompute time. Ours applies the
    same rule to the planner's candidates (default: the plan standing for
    torch.compile's, ``DEFAULT_PLAN_OVERHEAD``; floor: the smallest stash of any
    candidate). The least-time candidate within the bound sets the peak asked for
    (the lowest such peak over F and every higher fraction, so a lower fraction
    never asks for more), and the plan is the least time at that peak: never more
    time than the rule's own choice, often less (it may stash more where that costs
    no peak). So ``budget=0.5`` asks for about what ``activation_memory_budget=0.5``
    reaches, a peak, not a stash.
    """

    fraction: float
    default_stash: int
    floor_stash: int
    peak: int  # the lowest peak of the rule's choices at this fraction and above

    @property
    def stash_bound(self) -> int:
        return int(self.floor_stash + self.fraction * (self.default_stash - self.floor_stash))

    @property
    def budget_bytes(self) -> int:
        return self.peak

    def describe(self) -> str:
        return (
            f"{self.fraction:g} on activation_memory_budget's scale: stash at most "
            f"{_fmt(self.stash_bound)} ({self.fraction:g} of the way from the smallest, "
            f"{_fmt(self.floor_stash)}, to the default plan's {_fmt(self.default_stash)}); "
            f"the least-time plan within that peaks at {_fmt(self.peak)}"
        )

    @classmethod
    def of(
        cls, fraction: float, points: list[tuple[int, int, float]], default_stash: int
    ) -> BudgetScale:
        """The scale for candidates given as (stash, peak, added seconds)."""
        scale = cls(
            fraction=fraction,
            default_stash=default_stash,
            floor_stash=min(p[0] for p in points),
            peak=0,
        )
        # The rule's choice for every stash bound from this fraction's up: the
        # least-time candidate among those stashing at most the bound.
        by_stash = sorted(points, key=lambda p: (p[0], p[2]))
        best, choices = None, []
        for i, point in enumerate(by_stash):
            if best is None or point[2] < best[2]:
                best = point
            following = by_stash[i + 1][0] if i + 1 < len(by_stash) else None
            if following is None or following > scale.stash_bound:
                choices.append(best)
        return replace(scale, peak=min(p[1] for p in choices))

    def to_dict(self) -> dict:
        return {
            "fraction": self.fraction,
            "default_stash": self.default_stash,
            "floor_stash": self.floor_stash,
            "stash_bound": self.stash_bound,
            "peak": self.peak,
        }


@dataclass(kw_only=True, slots=True, frozen=True)
class PlanOptions(MirrorOptions):
    """The user's options (validated by ``MirrorOptions``) and what the planner learns
    at compile time: the policy, the device, whether the backend fuses."""

    policy: MirrorPolicy | None = None
    # The accelerator's rates; by default looked up from the graph's device (rates_for).
    device: DeviceRates | None = None
    # The backend fuses pointwise ops (Inductor): recomputed ones run inside their
    # backward readers' kernels, and fused intermediates are never allocated. Set
    # False for backends that run each op on its own (backend="eager").
    fusion: bool = True
    # torch.compile's estimated peak, where the caller knows it (the frontier bench
    # simulates min-cut's partition): what balance's target is a share of (a plan that
    # misses it may recompute heavy ops). By default, the plan standing for it
    # (balance.compile_default) in planning, min-cut's partition simulated in the
    # diagnosis (balance_target.py).
    reference_peak: int | None = None
    # Work out balance's target (explain, the frontier bench): a report, min-cut's
    # partition and a second search where it is missed (GPT-2 on a shared 2-core CPU:
    # +3.5 s, 3.0 s of it min-cut), so compile skips it.
    diagnose_balance: bool = False


@dataclass(kw_only=True, slots=True)
class Plan:
    saved: list[Node]
    saved_sym: list[Node]
    mirrored: list[Node]
    stash_bytes_before: int
    stash_bytes_after: int
    peak_before: int
    peak_after: int
    added_flops: int
    added_time_s: float
    step_time_s: float
    mode: str
    budget_bytes: int | None = None
    # A fractional budget: what the fraction is of (None for bytes and other modes).
    budget_scale: BudgetScale | None = None
    # Budget mode: whether the estimated peak is within BUDGET_TOLERANCE of the budget.
    budget_met: bool | None = None
    # What is alive at the estimated peak of this plan; when a budget is not met, the
    # floor: what no mirroring can remove (parameters, gradients, inputs, ...).
    floor: liveness.PeakBreakdown | None = field(default=None, repr=False)
    sizes: dict[Node, int] = field(default_factory=dict, repr=False)
    # The memory mode chosen for each of our RNN ops (mirror/op_memory.py).
    op_memory: list = field(default_factory=list, repr=False)
    # What the step holds outside the graph, by holder (graph/held.py: BLAS workspaces).
    held: dict[str, int] = field(default_factory=dict, repr=False)
    # Balance mode: whether the plan reaches balance's target peak within its time cap,
    # and if not why (balance_target.py).
    balance_target: BalanceTarget | None = None
    # The LM heads + cross-entropies found before planning, fused or not (fused_loss.py).
    fused_losses: list = field(default_factory=list)
    # What became of Inductor's seeded random draws (dropout masks): how many the
    # backward recomputes from their seeds, and why any stay stashed (seeded_masks.py).
    seeded_random: str = ""

    @property
    def step_peak(self) -> int:
        """The estimated peak of the step: the graph's (``peak_after``) and ``held``."""
        return self.peak_after + sum(self.held.values())

    def _stashed(self) -> list[Node]:
        """Saved values other than primals (those are the caller's anyway)."""
        return [n for n in self.saved if n.op != "placeholder"]

    def to_dict(self) -> dict:
        def row(n: Node) -> dict:
            return {"name": n.name, "op": op_name(n), "shape": _shape(n), "bytes": self.sizes[n]}

        return {
            "mode": self.mode,
            "budget_bytes": self.budget_bytes,
            "budget_scale": self.budget_scale.to_dict() if self.budget_scale else None,
            "stashed": [row(n) for n in self._stashed()],
            "mirrored": [row(n) for n in self.mirrored if not is_getitem(n)],
            "saved_sym": [n.name for n in self.saved_sym],
            "stash_bytes_before": self.stash_bytes_before,
            "stash_bytes_after": self.stash_bytes_after,
            "peak_before": self.peak_before,
            "peak_after": self.peak_after,
            "added_flops": self.added_flops,
            "added_time_s": self.added_time_s,
            "step_time_s": self.step_time_s,
            "budget_met": self.budget_met,
            "floor": self.floor.to_dict() if self.floor is not None else None,
            "op_memory": [c.to_dict() for c in self.op_memory],
            "held": dict(self.held),
            "step_peak": self.step_peak,
            "balance_target": self.balance_target.to_dict() if self.balance_target else None,
            "fused_losses": [str(f) for f in self.fused_losses],
            "seeded_random": self.seeded_random,
        }

    def floor_summary(self) -> str:
        """One line: the bytes alive at the estimated peak by kind, and the largest values."""
        if self.floor is None:
            return ""
        kinds = ", ".join(f"{kind} {_fmt(b)}" for kind, b in self.floor.bytes_by_kind.items() if b)
        largest = ", ".join(
            f"{n.name} ({kind}) {_fmt(b)}" for n, kind, b in self.floor.values[:FLOOR_VALUES]
        )
        by_kind = self.floor.bytes_by_kind
        fixed = by_kind.get("parameters", 0) + by_kind.get("gradients", 0)
        share = fixed / self.floor.peak if self.floor.peak else 0.0
        return (
            f"alive at the peak ({self.floor.phase}, {self.floor.node}): {kinds} "
            f"(parameters and gradients {_fmt(fixed)}, {share:.0%} of it, no plan removes); "
            f"largest values: {largest}"
        )

    def _budget_state(self) -> str:
        if self.budget_met is False:
            return "NOT met"
        if self.budget_bytes is not None and self.peak_after > self.budget_bytes:
            over = self.peak_after / self.budget_bytes - 1
            return f"met within the {BUDGET_TOLERANCE:.0%} tolerance (+{over:.1%})"
        return "met"

    def summary_line(self) -> str:
        """The plan in one line, for a training log: peaks, time, op choices, budget."""
        overhead = self.added_time_s / self.step_time_s if self.step_time_s else 0.0
        parts = [
            f"mirror {self.mode}: estimated peak {_fmt(self.step_peak)} "
            f"(graph {_fmt(self.peak_after)}, {_fmt(self.peak_before)} unmirrored), "
            f"+{overhead:.1%} time"
        ]
        parts += [f"{c.module or c.node} {c.choice}" for c in self.op_memory]
        parts += [str(f) for f in self.fused_losses if f.fused]
        if self.budget_bytes is not None:
            scale = self.budget_scale
            of = f" ({scale.fraction:g} on activation_memory_budget's scale)" if scale else ""
            parts.append(f"budget {_fmt(self.budget_bytes)}{of} {self._budget_state()}")
            if not self.budget_met:
                parts.append(self.floor_summary())
        if self.balance_target is not None:
            parts.append(f"target {self.balance_target.reason()}")
        return "; ".join(parts)

    def __str__(self) -> str:
        rows = [
            (kind, n.name, op_name(n), str(_shape(n)), _fmt(self.sizes[n]))
            for kind, nodes in (("stash", self._stashed()), ("mirror", self.mirrored))
            for n in nodes
            if not (kind == "mirror" and is_getitem(n))
        ]
        header = ("", "value", "op", "shape", "bytes")
        widths = [max(len(r[i]) for r in (header, *rows)) + 2 for i in range(4)]
        lines = [f"mirrorgrad plan (mode={self.mode})", ""]
        for row in (header, *rows):
            cells = "".join(f"{cell:<{w}}" for cell, w in zip(row[:4], widths))
            lines.append(f"{cells}{row[4]:>12}")
        overhead = self.added_time_s / self.step_time_s if self.step_time_s else 0.0
        lines += [
            "",
            f"stash bytes:    {_fmt(self.stash_bytes_before)} -> {_fmt(self.stash_bytes_after)}",
            f"estimated peak: {_fmt(self.peak_before)} -> {_fmt(self.peak_after)}",
            f"                ({PEAK_INCLUDES})",
            *(
                f"held outside:   {what} {_fmt(b)}: step peak {_fmt(self.step_peak)}"
                for what, b in self.held.items()
            ),
            f"added FLOPs:    {self.added_flops:,}",
            f"added time:     {self.added_time_s * 1e6:.1f} us "
            f"({overhead:.1%} of an estimated {self.step_time_s * 1e6:.1f} us step)",
        ]
        if self.budget_bytes is not None:
            lines.append(f"budget:         {_fmt(self.budget_bytes)} ({self._budget_state()})")
        if self.budget_scale is not None:
            lines.append(f"                ({self.budget_scale.describe()})")
        if self.floor is not None:
            lines.append(f"floor:          {self.floor_summary()}")
        lines += [f"op memory:      {c}" for c in self.op_memory]
        if self.balance_target is not None:
            lines.append(f"balance target: {self.balance_target.reason()}")
        lines += [f"loss:           {f}" for f in self.fused_losses]
        if self.seeded_random:
            lines.append(f"dropout masks:  {self.seeded_random}")
        return "\n".join(lines)


def _shape(n: Node) -> list | None:
    """Shape of a tensor value (a list of shapes for a tuple), JSON-able."""

    def dims(t: object) -> list | None:
        if not hasattr(t, "shape"):
            return None
        return [d if isinstance(d, int) else str(d) for d in t.shape]

    val = n.meta.get("val")
    if isinstance(val, (tuple, list)):
        return [dims(v) for v in val]
    return dims(val)


def budget_message(p: Plan) -> str:
    held = "".join(f" Held outside the graph: {what} {_fmt(b)}." for what, b in p.held.items())
    asked = f" ({p.budget_scale.describe()})" if p.budget_scale else ""
    return (
        f"mirrorgrad: the budget of {_fmt(p.budget_bytes)}{asked} is not met: the lowest "
        f"estimated peak found is {_fmt(p.peak_after)} ({p.peak_after / p.peak_before:.2f} "
        f"of the unmirrored {_fmt(p.peak_before)}). {p.floor_summary()}.{held} The peak is "
        f"of {PEAK_INCLUDES}."
    )
