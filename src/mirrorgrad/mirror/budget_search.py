"""Budget mode: the least added time that meets a peak budget.

Chosen from a set of candidates that does not depend on the budget (mirroring more
ops one chunk at a time, from no mirroring and from the storage-balance plan; trims
of that plan), so a lower budget never gives a higher peak. Within no budget: the
lowest peak. A fraction is on PyTorch's ``activation_memory_budget`` scale
(``BudgetScale``).
"""

from __future__ import annotations

from mirrorgrad.graph.cost import rates_for
from mirrorgrad.graph.joint import JointGraph
from mirrorgrad.mirror.balance import compile_default
from mirrorgrad.mirror.candidates import Candidate, Planner, partition_for
from mirrorgrad.mirror.plan import BudgetScale, PlanOptions
from mirrorgrad.mirror.policy import MirrorPolicy
from mirrorgrad.mirror.storage_balance import UnitGraph

# Units the final pruning tries to un-mirror (one liveness simulation each).
PRUNE_TRIALS = 16


def plan_budget(
    planner: Planner, budget: float | int, before: Candidate
) -> tuple[Candidate, int, BudgetScale | None]:
    """Budget mode's plan (``before``: no mirroring), alike in every repeated block, the
    budget in bytes, and the scale a fraction was read on (None for bytes)."""
    candidates, default = budget_candidates(planner, before)
    scale = None
    if isinstance(budget, float):
        scale = budget_scale(budget, default, candidates)
        budget_bytes = scale.budget_bytes
    else:
        budget_bytes = int(budget)
    chosen = meet_budget(planner, budget_bytes, candidates)
    peak_cap, time_cap = max(budget_bytes, chosen.peak), chosen.added_time_s
    chosen = planner.uniform(chosen, lambda c: c.peak <= peak_cap and c.added_time_s <= time_cap)
    return chosen, budget_bytes, scale


def budget_candidates(planner: Planner, before: Candidate) -> tuple[list[Candidate], Candidate]:
    """The plans budget mode chooses from (they do not depend on the budget), and
    the one standing for torch.compile's default (``BudgetScale``).

    - the default: balance's plan with a ``DEFAULT_PLAN_OVERHEAD`` cap, cheap ops only
      (``compile_default``).

    - adding, from no mirroring and from the repaired storage-balance plan: mirror
      more, best bytes per second first. Chunks of the ranking double (up to
      ``MAX_CHUNK``, or ``CHUNK_SHARE`` of the units) while the peak does not
      rise (a step that leaves it unchanged can open a chain: mirroring a ReLU
      pays only once its BatchNorm is mirrored too) and halve when it does; a
      unit that raises the peak alone is never tried again; ``STALL_TRIALS``
      simulations without a lower peak end it. Every state on these paths is a
      candidate, and each last one after the lifetime repair.
    - trimming: one op at a time misses what only a group pays for (each
      decoder step's tanh needs its add mirrored too, all sharing U k), so
      the storage-balance plan (after the lifetime repair) and that plan with
      its costliest 1, 2, 4, ... units un-mirrored are candidates too.
    """
    trims = trimmed_balance(planner)
    path = planner.adding_path(before, last_resort=True)
    # Heavy ops on top of the storage-balance plan: the low-peak end of the frontier
    # (the path from nothing spends the budget on convolutions first; the balance plan
    # reaches 0.59x of ResNet-152's peak with BatchNorm and ReLU alone).
    deeper = planner.adding_path(trims[0], last_resort=True)
    default = compile_default(planner, before)
    return [default, *path, *trims, *deeper], default


def budget_scale(fraction: float, default: Candidate, candidates: list[Candidate]) -> BudgetScale:
    """``fraction`` on PyTorch's scale, ``default`` standing for torch.compile's."""
    return BudgetScale.of(fraction, scale_points(candidates), default.stash)


def meet_budget(planner: Planner, budget_bytes: int, candidates: list[Candidate]) -> Candidate:
    """The least added time whose peak meets the budget, else the lowest peak.

    Choosing the cheapest candidate within the budget from a fixed set
    (``budget_candidates``) means a lower budget never gets a higher peak. Within
    no budget, the lowest peak wins; among equal peaks the smaller stash (the
    user asked for memory: it is headroom where the estimate errs), then the
    least time.
    """
    feasible = [c for c in candidates if c.peak <= budget_bytes]
    if feasible:
        return _prune(planner, min(feasible, key=lambda c: (c.added_time_s, c.peak, c.stash)))
    return min(candidates, key=lambda c: (c.peak, c.stash, c.added_time_s))


def _prune(planner: Planner, chosen: Candidate) -> Candidate:
    """Un-mirror units that cost time and do not lower the peak, costliest first.

    A chunk of the adding search takes in units that pay nothing at the peak
    (recomputing a LayerNorm's statistics to free 4 KiB). The peak never rises,
    so a lower budget still never gets a higher peak. Only where the budget is
    met: short of it, among equal peaks the smaller stash is the headroom.
    """
    units = set(chosen.units)
    ranked = planner.costliest_first(units, set(chosen.partition.mirrored))
    for unit in ranked[:PRUNE_TRIALS]:
        trial = planner.evaluate(set(chosen.units) - {unit})
        if trial.peak <= chosen.peak and trial.added_time_s < chosen.added_time_s:
            chosen = trial
    return chosen


def trimmed_balance(planner: Planner) -> list[Candidate]:
    """The repaired storage-balance plan, then with its costliest 1, 2, 4, ...
    units stashed instead (each trim saves time and may cost peak)."""
    grouped = planner.repaired_storage_balance
    units = set(grouped.units)
    recomputed = set(partition_for(planner.joint, planner.graph, units).mirrored)
    ranked = planner.costliest_first(units, recomputed)
    trims, k = [grouped], 1
    while k < len(ranked):
        trims.append(planner.evaluate(units - set(ranked[:k])))
        k *= 2
    return trims


def scale_points(candidates: list[Candidate]) -> list[tuple[int, int, float]]:
    return [(c.stash, c.peak, c.added_time_s) for c in candidates]


def budget_points(joint: JointGraph, options: PlanOptions) -> tuple[list, int]:
    """Every budget candidate of ``joint`` as (stash, peak, added seconds), and the
    stash of the plan standing for torch.compile's default (``BudgetScale.of``)."""
    policy = options.policy if options.policy is not None else MirrorPolicy()
    rates = options.device if options.device is not None else rates_for(joint.device)
    planner = Planner(joint, UnitGraph(joint, policy), rates, fusion=options.fusion)
    candidates, default = budget_candidates(planner, planner.evaluate(set()))
    return scale_points(candidates), default.stash
