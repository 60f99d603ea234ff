"""Balance mode: the lowest estimated peak within a time cap (``max_overhead``).

The storage-balance decision (storage_balance.py), then the lifetime repair (stash
recomputed values alive at the simulated backward peak, while that lowers it); then
the cap: while the added time exceeds ``max_overhead`` of the step, un-mirror the op
saving most time per stash byte added. The adding search's states within the cap
compete (``Planner.adding_path``). A plan whose peak is not below the unmirrored peak
is dropped for no mirroring: time spent for nothing. Last, the plan is made the same in
every copy of a repeated block where that stays within the cap and at most
``UNIFORM_PEAK_SLACK`` above its peak. Whether the plan reaches balance's target, and
why not: balance_target.py.
"""

from __future__ import annotations

from torch.fx import Node

from mirrorgrad.mirror.candidates import Candidate, Planner, partition_for

# How far above the per-unit plan's peak the plan alike in every copy may go.
UNIFORM_PEAK_SLACK = 0.02


def plan_balance(planner: Planner, max_overhead: float, before: Candidate) -> Candidate:
    """Balance's plan (``before``: no mirroring), alike in every repeated block."""
    chosen = balance(planner, max_overhead, before)
    cap_s = max_overhead * planner.step_time_s
    return planner.uniform(
        chosen,
        lambda c: (
            c.added_time_s <= cap_s
            and c.peak < before.peak
            and c.peak <= chosen.peak * (1 + UNIFORM_PEAK_SLACK)
        ),
    )


def balance(planner: Planner, max_overhead: float, before: Candidate) -> Candidate:
    """The lowest peak within the time cap: the storage-balance plan, repaired
    and trimmed to the cap, or a state of the adding search within it."""
    cap_s = max_overhead * planner.step_time_s
    chosen = planner.repaired_storage_balance
    units = _within_cap(planner, set(chosen.units), cap_s)
    if units != chosen.units:
        chosen = planner.evaluate(units)
    path = planner.adding_path(before, last_resort=False, cap_s=cap_s)
    candidates = [chosen, *(c for c in path if c.added_time_s <= cap_s)]
    chosen = min(candidates, key=lambda c: (c.peak, c.added_time_s))
    return chosen if chosen.peak < before.peak else before


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
