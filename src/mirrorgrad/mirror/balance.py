"""Balance mode: the lowest estimated peak within a time cap (``max_overhead``).

The storage-balance decision (storage_balance.py), then the lifetime repair (stash
recomputed values alive at the simulated backward peak, while that lowers it); then
the cap: while the added time exceeds ``max_overhead`` of the step, un-mirror the op
saving most time per stash byte added. The adding search's states within the cap
compete (``Planner.adding_path``). A plan whose peak is not below the unmirrored peak
is dropped for no mirroring: time spent for nothing. Last, the plan is made the same in
every copy of a repeated block where that stays within the cap and at most
``UNIFORM_PEAK_SLACK`` above its peak.
"""

from __future__ import annotations

from torch.fx import Node

from mirrorgrad.graph import liveness
from mirrorgrad.mirror.candidates import Candidate, Planner, partition_for
from mirrorgrad.mirror.policy import op_name

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


# What balance aims for: a plan above this share of the stash-everything peak, or
# above this added share of the step's time, says what holds it (``Plan.limits``).
GOAL_PEAK = 0.8
GOAL_OVERHEAD = 0.03
# Parameters and gradients are named as a limit from this share of the plan's peak.
FIXED_SHARE = 0.5
# One value alive at the peak that balance does not recompute, from this share.
ONE_VALUE_SHARE = 0.2
# Saved and recomputed values at the peak below this share: no stash changes it much.
CHANGEABLE_SHARE = 0.1


def limits(
    planner: Planner,
    chosen: Candidate,
    before: Candidate,
    max_overhead: float,
    floor: liveness.PeakBreakdown,
) -> list[str]:
    """What keeps balance's plan ``chosen`` above ``GOAL_PEAK`` of the unmirrored peak
    (``before``) or above ``GOAL_OVERHEAD`` added time, from the plan's own data: what
    is alive at its peak (``floor``) and the candidates the search evaluated."""
    step = planner.step_time_s or 1.0
    peak_x, overhead = chosen.peak / before.peak, chosen.added_time_s / step
    found: list[str] = []
    if peak_x > GOAL_PEAK:
        found += _peak_limits(planner, chosen, before, max_overhead, floor)
    if overhead > GOAL_OVERHEAD:
        # The search under the user's cap need not have tried the plans within the goal.
        best = balance(planner, GOAL_OVERHEAD, before)
        found.append(
            f"the time is +{overhead:.1%} because max_overhead is {max_overhead:.1%}: within "
            f"+{GOAL_OVERHEAD:.0%} the lowest peak found is {best.peak / before.peak:.3f}x "
            f"(this plan {peak_x:.3f}x)"
        )
    return found


def _peak_limits(
    planner: Planner,
    chosen: Candidate,
    before: Candidate,
    max_overhead: float,
    floor: liveness.PeakBreakdown,
) -> list[str]:
    step = planner.step_time_s or 1.0
    found = []
    lower = [c for c in planner.evaluated() if c.peak < chosen.peak]
    if lower:
        nearest = min(lower, key=lambda c: (c.added_time_s, c.peak))
        lower_x, cost = nearest.peak / before.peak, nearest.added_time_s / step
        if cost > max_overhead:
            found.append(
                f"the next lower peak found, {lower_x:.3f}x, costs +{cost:.1%} time, over "
                f"max_overhead {max_overhead:.1%}"
            )
        else:
            found.append(
                f"a peak of {lower_x:.3f}x (+{cost:.1%}) was found with a plan that differs "
                "between copies of a repeated block: this one, alike in every copy, "
                "compiles fewer kernels"
            )
    else:
        found.append(f"none of the {len(planner.evaluated())} plans evaluated peaks lower")
    peak = floor.peak or 1
    by_kind = floor.bytes_by_kind
    fixed = by_kind.get("parameters", 0) + by_kind.get("gradients", 0)
    if fixed >= FIXED_SHARE * peak:
        found.append(f"parameters and gradients are {fixed / peak:.0%} of the peak")
    changeable = by_kind.get("saved activations", 0) + by_kind.get("recomputed", 0)
    if changeable < CHANGEABLE_SHARE * peak:
        held = max(by_kind, key=by_kind.__getitem__)
        found.append(
            f"the peak ({floor.phase}, at {floor.node}) is at a point no stash changes: "
            f"saved and recomputed values are {changeable / peak:.0%} of it, {held} "
            f"{by_kind[held] / peak:.0%}"
        )
    g = planner.graph
    large = [
        (storage, kind, nbytes)
        for storage, kind, nbytes in floor.values
        if kind not in ("parameters", "gradients") and nbytes >= ONE_VALUE_SHARE * peak
    ]
    for storage, kind, nbytes in large:
        unit = g.producer(storage)
        if unit is not None and g.mirrorable.get(unit, False):
            continue  # a plan may recompute it
        op = op_name(storage)
        why = f"balance does not recompute {op}" if unit is not None else "no stash changes it"
        found.append(
            f"one value is {nbytes / peak:.0%} of the peak: {storage.name} ({op}, {kind}); {why}"
        )
    return found
