"""Dropout masks recomputed from their seeds, after a mode has chosen its plan.

Under Inductor, dropout draws ``inductor_random(shape, seed)``: the same seed draws the
same numbers, so the backward can recompute a mask from its saved scalar seed instead
of reading a stashed mask. The modes keep a mask wherever recomputing it buys no peak
(the peak is held elsewhere, by parameters at small batches): balance drops mirroring
that does not lower the peak, and budget's least time keeps the mask because the cost
model charges the recomputation its arithmetic and credits nothing for the mask it no
longer writes and reads. Those masks are memory spent for nothing.

So every draw and the elementwise work on it alone (the mask: ``gt(draw, p)``) is
recomputed wherever that does not raise the estimated peak and keeps the mode's
promise (balance: its time cap). Where they stay stashed, ``Plan.seeded_random`` says
why.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.fx import Node

from mirrorgrad._units import format_bytes
from mirrorgrad.mirror.candidates import Candidate, Planner
from mirrorgrad.mirror.policy import is_seeded_random
from mirrorgrad.mirror.storage_balance import UnitGraph


def mask_units(graph: UnitGraph) -> frozenset[Node]:
    """The seeded draws the policy lets us recompute, and the mirrorable units computed
    from them and their seeds alone (what recomputing a mask needs beyond the seed)."""
    draws = [u for u in graph.units if is_seeded_random(u) and graph.mirrorable[u]]
    return _computed_from(graph, draws, lambda u: graph.mirrorable[u])


def _computed_from(
    graph: UnitGraph, draws: list[Node], allowed: Callable[[Node], bool]
) -> frozenset[Node]:
    """``draws`` and the ``allowed`` units that read only values of these units or the
    draws' seeds, at least one of the former."""
    seeds = {graph.root(a) for u in draws for a in u.all_input_nodes}
    found = set(draws)
    for u in graph.units:  # graph order: a unit's producers come first
        if u in found or not allowed(u):
            continue
        inputs = graph.inputs(u)
        drawn = [graph.producer(v) in found for v in inputs]
        if any(drawn) and all(d or v in seeds for d, v in zip(drawn, inputs)):
            found.add(u)
    return frozenset(found)


def recompute_masks(
    planner: Planner, chosen: Candidate, keeps_promise: Callable[[Candidate], bool]
) -> tuple[Candidate, str]:
    """``chosen`` with its seeded draws and their masks recomputed where that raises no
    peak and ``keeps_promise``; and what became of the draws, for the plan."""
    graph = planner.graph
    draws = [u for u in graph.units if is_seeded_random(u)]
    if not draws:
        return chosen, ""
    units = mask_units(graph)
    reason = ""
    if not units <= chosen.units:
        trial = planner.evaluate(set(chosen.units) | units)
        if trial.peak > chosen.peak:
            reason = (
                "recomputing them from their seeds raises the estimated peak "
                f"({format_bytes(chosen.peak)} -> {format_bytes(trial.peak)})"
            )
        elif not keeps_promise(trial):
            step = planner.step_time_s or 1.0
            reason = (
                "recomputing them from their seeds takes the added time to "
                f"+{trial.added_time_s / step:.2%}, over the mode's cap"
            )
        else:
            chosen = trial
    return chosen, _describe(planner, chosen, draws, reason)


def _describe(planner: Planner, chosen: Candidate, draws: list[Node], reason: str) -> str:
    graph = planner.graph
    recomputed = set(chosen.partition.mirrored)
    saved = {graph.root(v) for v in chosen.partition.saved}
    replayed = [u for u in draws if u in recomputed]
    parts = [f"{len(replayed)} of {len(draws)} seeded random draws (dropout masks) recomputed "
             "from their seeds in the backward"]  # fmt: skip
    kept = [u for u in draws if u not in recomputed and _mask_saved(graph, u, saved)]
    forbidden = [u for u in kept if not graph.mirrorable[u]]
    if forbidden:
        parts.append(
            f"{len(forbidden)} stashed because mirroring is forbidden there (mark(module, "
            "mirror=False), an op override or MIRRORGRAD_MIRROR=0)"
        )
    if len(kept) > len(forbidden):
        parts.append(f"{len(kept) - len(forbidden)} stashed: {reason or 'the plan keeps them'}")
    return "; ".join(parts)


def _mask_saved(graph: UnitGraph, draw: Node, saved: set[Node]) -> bool:
    """The draw, or a value computed from it alone (its mask), is saved."""
    chain = _computed_from(graph, [draw], lambda _: True)
    return any(graph.root(v) in saved for u in chain for v in graph.outputs(u))
