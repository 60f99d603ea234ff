"""Balance's target: an estimated peak at most ``TARGET_PEAK`` of torch.compile's default
partition within the time cap, and, where balance's plan misses it, why.

The reference is torch.compile's default partition (min-cut) simulated by the liveness
model balance's own peak comes from (``min_cut.py``), or the caller's (the frontier bench
has it already). Only the diagnosis pays for min-cut (1.5-3 s on GPT-2 on a CPU): ``compile``'s
plans do not diagnose. Where min-cut's partition cannot be computed, the plan standing
for it (``balance.compile_default``: balance with a ``DEFAULT_PLAN_OVERHEAD`` cap, cheap
ops recomputed), and the reference says why.

A miss is explained by one budget search for the target's peak: budget mode's
candidates, each adding search stopped once it reaches that peak, and the least added
time among every plan evaluated that reaches it, pruned as budget mode prunes. Then:

- ``costly``: that plan costs more added time than the cap: its cost, and the ops it
  recomputes that balance's plan does not, by bytes;
- ``missed``: it is within the cap, but only budget mode's search (from the
  storage-balance plan, or past the cap and pruned back) finds it;
- ``unreachable``: no plan reaches the target: the lowest peak found and what is alive
  at it (parameters, gradients, inputs, values the backward must keep).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch.fx import Node

from mirrorgrad._units import format_bytes as _fmt
from mirrorgrad.graph import liveness
from mirrorgrad.graph.joint import is_getitem, is_view, op_name
from mirrorgrad.mirror.balance import TARGET_PEAK, compile_default
from mirrorgrad.mirror.budget_search import meet_budget, trimmed_balance
from mirrorgrad.mirror.candidates import Candidate, Planner
from mirrorgrad.mirror.min_cut import min_cut_peak

# The ops a reason names (largest recomputed bytes first), and the kinds of what is alive.
NAMED = 3

Status = Literal["met", "costly", "missed", "unreachable"]
COMPILE_REFERENCE = "torch.compile's peak (its partition simulated)"
STAND_IN_REFERENCE = (
    "torch.compile's peak (as a plan recomputing cheap ops: its partition failed, {why})"
)


@dataclass(kw_only=True, slots=True, frozen=True)
class Recomputed:
    """Values of one op that a plan recomputes: their bytes, how many, the largest's
    shape."""

    op: str
    nbytes: int
    count: int
    shape: str

    def __str__(self) -> str:
        values = f"{self.count} values like" if self.count > 1 else "one value,"
        return f"{self.op} {_fmt(self.nbytes)} ({values} {self.shape})"

    def to_dict(self) -> dict:
        return {"op": self.op, "bytes": self.nbytes, "count": self.count, "shape": self.shape}


@dataclass(kw_only=True, slots=True, frozen=True)
class BalanceTarget:
    """Whether balance's plan peaks at most ``target`` x ``reference_peak``, and if not why.

    ``other_*``: for ``costly`` and ``missed`` the cheapest plan found that reaches the
    target, with what it recomputes beyond balance's plan (``recomputes``, by op, most
    bytes first); for ``unreachable`` the lowest peak found where one is below balance's,
    and what is alive at that peak (``held``)."""

    target: float
    reference: str
    reference_peak: int
    peak: int
    overhead: float
    max_overhead: float
    status: Status
    other_peak: int | None = None
    other_overhead: float | None = None
    recomputes: tuple[Recomputed, ...] = ()
    held: liveness.PeakBreakdown | None = None

    @property
    def reached(self) -> float:
        return self.peak / self.reference_peak

    def reason(self) -> str:
        """One line: the target, the verdict, and why where it is missed."""
        head = f"at most {self.target:g}x {self.reference} within +{self.max_overhead:.1%}: "
        this = self._at(self.peak, self.overhead)
        if self.status == "met":
            return f"{head}met ({this})"
        if self.status == "unreachable":
            if self.other_peak is None:
                return f"{head}no plan reaches it or peaks lower ({this}); {self._held()}"
            lowest = self._at(self.other_peak, self.other_overhead)
            return f"{head}no plan reaches it ({this}); the lowest peak is {lowest}; {self._held()}"
        ratio = f"{self.other_peak / self.reference_peak:.3f}x"
        ops = ", ".join(str(r) for r in self.recomputes[:NAMED])
        recomputing = f", recomputing {ops} more" if ops else ""
        ask = f"mode='budget', budget={_budget_arg(int(self.target * self.reference_peak))}"
        if self.status == "costly":
            other = f"a {ratio} plan costs +{self.other_overhead:.1%}{recomputing}"
            return f"{head}not within the cap ({this}): {other} ({ask})"
        other = f"a {ratio} plan at +{self.other_overhead:.1%}{recomputing}"
        return f"{head}not found by balance ({this}): budget mode's search finds {other} ({ask})"

    def verdict(self) -> str:
        """A few words for a table row: met, or why not."""
        goal = f"≤ {self.target:g}x at ≤ {1 + self.max_overhead:g}x"
        if self.status == "met":
            return f"{goal}: met"
        if self.other_peak is None:  # unreachable, and nothing peaks lower
            other = self._at(self.peak, self.overhead)
        else:
            other = self._at(self.other_peak, self.other_overhead)
        if self.status == "costly":
            return f"{goal}: not within +{self.max_overhead:.0%}: a plan at {other}"
        if self.status == "missed":
            return f"{goal}: missed: budget mode's search finds {other}"
        return f"{goal}: no plan reaches {self.target:g}x: the lowest is {other}, {self._alive()}"

    def _at(self, peak: int, overhead: float | None) -> str:
        return f"{peak / self.reference_peak:.3f}x at +{overhead or 0.0:.1%}"

    def _alive(self) -> str:
        if self.held is None:
            return ""
        kinds = sorted(((b, k) for k, b in self.held.bytes_by_kind.items() if b), reverse=True)
        return ", ".join(f"{k} {_fmt(b)}" for b, k in kinds[:NAMED])

    def _held(self) -> str:
        if self.held is None:
            return ""
        return f"alive at that peak: {self._alive()} ({self.held.phase}, at {self.held.node})"

    def to_dict(self) -> dict:
        return {
            "target": self.target,
            "reference": self.reference,
            "reference_peak": self.reference_peak,
            "reached": self.reached,
            "overhead": self.overhead,
            "max_overhead": self.max_overhead,
            "status": self.status,
            "other_peak": self.other_peak,
            "other_overhead": self.other_overhead,
            "recomputes": [r.to_dict() for r in self.recomputes],
            "held": self.held.to_dict() if self.held is not None else None,
            "verdict": self.verdict(),
            "reason": self.reason(),
        }


def _first_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _budget_arg(nbytes: int) -> str:
    """``budget=`` for a peak of at most ``nbytes``: whole MiB rounded down from 100 MiB
    (within 1%), else bytes."""
    return f"'{nbytes >> 20}MiB'" if nbytes >= 100 * 2**20 else str(nbytes)


def balance_target(
    planner: Planner,
    chosen: Candidate,
    before: Candidate,
    max_overhead: float,
    floor: liveness.PeakBreakdown,
    reference_peak: int | None = None,
) -> BalanceTarget:
    """Balance's plan ``chosen`` against the target (``before``: no mirroring; ``floor``:
    what is alive at ``chosen``'s peak; ``reference_peak``: torch.compile's estimated
    peak where the caller knows it, else simulated here)."""
    reference = COMPILE_REFERENCE
    if reference_peak is None:
        try:
            reference_peak = min_cut_peak(planner.joint, fusion=planner.fusion, index=planner.index)
        except Exception as e:  # PyTorch's partitioner, on a graph it may not take
            reference_peak = compile_default(planner, before).peak
            reference = STAND_IN_REFERENCE.format(why=_first_line(e))
    step = planner.step_time_s or 1.0
    found = dict(
        target=TARGET_PEAK,
        reference=reference,
        reference_peak=reference_peak,
        peak=chosen.peak,
        overhead=chosen.added_time_s / step,
        max_overhead=max_overhead,
    )
    goal = int(TARGET_PEAK * reference_peak)

    def lowest_of(c: Candidate) -> dict:
        return dict(other_peak=c.peak, other_overhead=c.added_time_s / step)

    if chosen.peak <= goal:
        return BalanceTarget(status="met", **found)
    other = _cheapest_at(planner, before, goal)
    if other.peak > goal:
        if other.peak >= chosen.peak:  # nothing peaks lower: what holds balance's own peak
            return BalanceTarget(status="unreachable", held=floor, **found)
        p = other.partition
        held = liveness.peak_breakdown(
            planner.joint, p.saved + p.saved_sym, p.mirrored, fusion=planner.fusion,
            index=planner.index,
        )  # fmt: skip
        return BalanceTarget(status="unreachable", held=held, **found, **lowest_of(other))
    status: Status = "costly" if other.added_time_s > max_overhead * step else "missed"
    return BalanceTarget(
        status=status, recomputes=_recomputed_beyond(planner, other, chosen), **found,
        **lowest_of(other),
    )  # fmt: skip


def _cheapest_at(planner: Planner, before: Candidate, goal: int) -> Candidate:
    """The least added time found whose peak is at most ``goal`` (pruned as budget mode
    prunes), else the lowest peak found at the least time."""
    trims = trimmed_balance(planner)
    planner.adding_path(before, last_resort=True, stop_peak=goal)
    planner.adding_path(trims[0], last_resort=True, stop_peak=goal)
    found = planner.evaluated()
    if any(c.peak <= goal for c in found):
        return meet_budget(planner, goal, found)
    return min(found, key=lambda c: (c.peak, c.added_time_s))


def _recomputed_beyond(
    planner: Planner, other: Candidate, chosen: Candidate
) -> tuple[Recomputed, ...]:
    """What ``other`` recomputes that ``chosen`` does not, by op, most bytes first."""
    by_op: dict[str, list[Node]] = {}
    for n in set(other.partition.mirrored) - set(chosen.partition.mirrored):
        if not is_getitem(n) and not is_view(n):  # a tuple's bytes are its producer's
            by_op.setdefault(op_name(n).removeprefix("aten::"), []).append(n)
    nbytes = planner.joint.nbytes
    found = []
    for op, nodes in by_op.items():
        largest = max(nodes, key=lambda n: (nbytes(n), n.name))
        val = largest.meta.get("val")
        if isinstance(val, (tuple, list)):  # a multi-output op: its first tensor
            val = next((v for v in val if hasattr(v, "shape")), None)
        shape = [int(d) if isinstance(d, int) else str(d) for d in getattr(val, "shape", ())]
        found.append(
            Recomputed(op=op, nbytes=sum(map(nbytes, nodes)), count=len(nodes), shape=str(shape))
        )
    return tuple(sorted(found, key=lambda r: (-r.nbytes, r.op)))
