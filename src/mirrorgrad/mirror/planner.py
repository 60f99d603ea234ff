"""``plan``: what the forward pass stashes and what the backward pass recomputes,
judged by the step's simulated peak, in one of three modes:

- ``off``: no mirroring; every forward value the backward reads is stashed.
- ``balance`` (balance.py): the lowest peak within the time cap ``max_overhead``.
- ``budget`` (budget_search.py): the least added time that meets a peak budget.

The chosen plan is then made the same in every copy of a repeated block where that
keeps the mode's promise (``Planner.uniform``), recomputes its dropout masks from their
seeds where that raises no peak (seeded_masks.py), and is checked before it is returned:
no random op recomputed, every backward read either saved or recomputed from saved
values.
"""

from __future__ import annotations

import warnings

from mirrorgrad.graph import liveness
from mirrorgrad.graph.cost import rates_for
from mirrorgrad.graph.joint import JointGraph, is_view
from mirrorgrad.mirror.balance import plan_balance
from mirrorgrad.mirror.balance_target import balance_target
from mirrorgrad.mirror.budget_search import plan_budget
from mirrorgrad.mirror.candidates import Partition, Planner, stash_sizes
from mirrorgrad.mirror.plan import (
    BUDGET_TOLERANCE,
    MirrorgradBudgetWarning,
    Plan,
    PlanError,
    PlanOptions,
    budget_message,
)
from mirrorgrad.mirror.policy import MirrorPolicy, is_random
from mirrorgrad.mirror.seeded_masks import recompute_masks
from mirrorgrad.mirror.storage_balance import UnitGraph


def plan(joint: JointGraph, options: PlanOptions, *, warn: bool = True) -> Plan:
    """Decide what the forward pass stashes and what the backward pass recomputes.

    ``warn=False``: no ``MirrorgradBudgetWarning`` (a caller that compares plans warns
    once for the one it keeps)."""
    policy = options.policy if options.policy is not None else MirrorPolicy()
    rates = options.device if options.device is not None else rates_for(joint.device)
    graph = UnitGraph(joint, policy)
    planner = Planner(joint, graph, rates, fusion=options.fusion)
    before = planner.evaluate(set())
    budget_bytes, scale, seeded = None, None, ""
    if options.mode == "off" or not policy.enabled:
        chosen = before
    elif options.mode == "balance":
        chosen = plan_balance(planner, options.max_overhead, before, options.reference_peak)
        cap_s = options.max_overhead * planner.step_time_s
        chosen, seeded = recompute_masks(planner, chosen, lambda c: c.added_time_s <= cap_s)
    else:
        chosen, budget_bytes, scale = plan_budget(planner, options.budget, before)
        # The peak does not rise, so the budget stays as met as it was.
        chosen, seeded = recompute_masks(planner, chosen, lambda c: True)
    _check(joint, chosen.partition, planner.index)
    sizes = {n: joint.nbytes(n) for n in chosen.partition.mirrored if not is_view(n)}
    sizes |= {n: 0 for n in chosen.partition.mirrored if is_view(n)}
    sizes |= stash_sizes(joint, graph, chosen.partition.saved)
    floor = liveness.peak_breakdown(
        joint,
        chosen.partition.saved + chosen.partition.saved_sym,
        chosen.partition.mirrored,
        fusion=options.fusion,
        index=planner.index,
    )
    met = None
    if budget_bytes is not None:
        met = chosen.peak <= budget_bytes * (1 + BUDGET_TOLERANCE)
    result = Plan(
        saved=chosen.partition.saved,
        saved_sym=chosen.partition.saved_sym,
        mirrored=chosen.partition.mirrored,
        stash_bytes_before=sum(stash_sizes(joint, graph, before.partition.saved).values()),
        stash_bytes_after=sum(sizes[n] for n in chosen.partition.saved),
        peak_before=before.peak,
        peak_after=chosen.peak,
        added_flops=chosen.added_flops,
        added_time_s=chosen.added_time_s,
        step_time_s=planner.step_time_s,
        mode=options.mode,
        budget_bytes=budget_bytes,
        budget_scale=scale,
        budget_met=met,
        floor=floor,
        sizes=sizes,
        seeded_random=seeded,
    )
    if options.mode == "balance" and policy.enabled and options.diagnose_balance:
        try:
            result.balance_target = balance_target(
                planner, chosen, before, options.max_overhead, floor, options.reference_peak
            )
        except PlanError:  # a report only: the plan chosen stands without it
            result.balance_target = None
    if met is False and warn:
        warnings.warn(budget_message(result), MirrorgradBudgetWarning, stacklevel=2)
    return result


def _check(joint: JointGraph, partition: Partition, index: liveness.GraphIndex) -> None:
    for n in partition.mirrored:
        if is_random(n):
            raise PlanError(f"random op {n.name} would be recomputed with a fresh draw")
        if n not in joint.forward_set:
            raise PlanError(f"mirrored node {n.name} is not a forward node")
    # Raises where a backward read is neither saved nor recomputed.
    index.backward_schedule(
        index.ids(partition.saved + partition.saved_sym), index.ids(partition.mirrored)
    )
