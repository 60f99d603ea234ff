"""Balance mode: the lowest estimated peak within a time cap (``max_overhead``).

The storage-balance decision (storage_balance.py), then the lifetime repair (stash
recomputed values alive at the simulated backward peak, while that lowers it); then
the cap: while the added time exceeds ``max_overhead`` of the step, un-mirror the op
saving most time per stash byte added. The adding search's states within the cap
compete (``Planner.adding_path``). These recompute cheap ops only. Where the lowest
peak among them misses balance's target (``TARGET_PEAK`` of torch.compile's peak),
the adding search with matmuls and convolutions competes too (``_with_heavy_ops``).
A plan whose peak is not below the unmirrored peak is dropped for no mirroring: time
spent for nothing. Last, the plan is made the same in every copy of a repeated block
where that stays within the cap and at most ``UNIFORM_PEAK_SLACK`` above its peak.
Whether the plan reaches the target, and why not: balance_target.py.
"""

from __future__ import annotations

from torch.fx import Node

from mirrorgrad.mirror.candidates import Candidate, Planner, partition_for

# How far above the per-unit plan's peak the plan alike in every copy may go.
UNIFORM_PEAK_SLACK = 0.02
# Balance's target: an estimated peak at most this share of torch.compile's.
TARGET_PEAK = 0.8
# torch.compile's default partition (min-cut) recomputes only cheap ops that Inductor
# fuses for nearly nothing; the plan that stands for it (balance's target, the budget
# scale's ``BudgetScale``) is balance's with this time cap (our cost model charges a
# fused recomputation its arithmetic). Running min-cut itself would cost 4-7 s of
# planning on a 10k-node graph.
DEFAULT_PLAN_OVERHEAD = 0.01


def plan_balance(
    planner: Planner, max_overhead: float, before: Candidate, reference_peak: int | None = None
) -> Candidate:
    """Balance's plan (``before``: no mirroring), alike in every repeated block.
    ``reference_peak``: torch.compile's estimated peak where the caller knows it, else
    the plan standing for it (``compile_default``)."""
    chosen = balance(planner, max_overhead, before)
    cap_s = max_overhead * planner.step_time_s
    if misses_target(planner, chosen, before, reference_peak):
        chosen = _with_heavy_ops(planner, chosen, before, cap_s)
    return planner.uniform(
        chosen,
        lambda c: (
            c.added_time_s <= cap_s
            and c.peak < before.peak
            and c.peak <= chosen.peak * (1 + UNIFORM_PEAK_SLACK)
        ),
    )


def misses_target(
    planner: Planner, chosen: Candidate, before: Candidate, reference_peak: int | None
) -> bool:
    """Whether ``chosen`` peaks above ``TARGET_PEAK`` of ``reference_peak``, by default
    of ``compile_default``'s peak. That plan peaks at most as high as ``before``: above
    the target's share of ``before``'s peak, ``chosen`` misses without planning it."""
    if reference_peak is None:
        if chosen.peak > int(TARGET_PEAK * before.peak):
            return True
        reference_peak = compile_default(planner, before).peak
    return chosen.peak > int(TARGET_PEAK * reference_peak)


def compile_default(planner: Planner, before: Candidate) -> Candidate:
    """The plan standing for torch.compile's default partition (``DEFAULT_PLAN_OVERHEAD``)."""
    return balance(planner, DEFAULT_PLAN_OVERHEAD, before)


def balance(planner: Planner, max_overhead: float, before: Candidate) -> Candidate:
    """The lowest peak within the time cap recomputing cheap ops: the storage-balance
    plan, repaired and trimmed to the cap, or a state of the adding search within it."""
    cap_s = max_overhead * planner.step_time_s
    chosen = planner.repaired_storage_balance
    units = _within_cap(planner, set(chosen.units), cap_s)
    if units != chosen.units:
        chosen = planner.evaluate(units)
    path = planner.adding_path(before, last_resort=False, cap_s=cap_s)
    candidates = [chosen, *(c for c in path if c.added_time_s <= cap_s)]
    chosen = min(candidates, key=lambda c: (c.peak, c.added_time_s))
    return chosen if chosen.peak < before.peak else before


def _with_heavy_ops(
    planner: Planner, chosen: Candidate, before: Candidate, cap_s: float
) -> Candidate:
    """``chosen``, or a state of the adding search with matmuls and convolutions from no
    mirroring (best bytes freed per second first) within the cap where its peak is lower.

    Only where the cheap ops miss the target: their price is bytes moved, a heavy op's
    its FLOPs at a fitted rate (at the matmul rate convolutions looked 4x cheaper than
    the H100 measured), so a plan that meets the target without them stays as it is.
    On resnet50 the search takes a few convolutions whose outputs are large and whose
    inputs are stashed anyway (0.756x min-cut's peak at +2.9%, where BatchNorm and ReLU
    within the cap reach 0.854x). From ``chosen`` instead, the cap is nearly spent.
    """
    path = planner.adding_path(before, last_resort=True, cap_s=cap_s)
    candidates = [chosen, *(c for c in path if c.added_time_s <= cap_s)]
    return min(candidates, key=lambda c: (c.peak, c.added_time_s))


def _within_cap(planner: Planner, units: set[Node], cap_s: float) -> set[Node]:
    """Un-mirror the fewest units, costliest first, for an added time <= ``cap_s``.

    Un-mirroring never adds recomputation, so the added time falls as more of the
    ranking is dropped: a binary search finds the shortest prefix that fits.
    """
    joint, graph = planner.joint, planner.graph
    partition = partition_for(joint, graph, units)
    if planner.added_time_s(partition) <= cap_s:
        return units
    ranked = planner.costliest_first(units, set(partition.mirrored))
    lo, hi = 0, len(ranked)
    while lo < hi:
        mid = (lo + hi) // 2
        kept = units - set(ranked[:mid])
        if planner.added_time_s(partition_for(joint, graph, kept)) <= cap_s:
            hi = mid
        else:
            lo = mid + 1
    return units - set(ranked[:lo])
