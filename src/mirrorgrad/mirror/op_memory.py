"""The memory mode of our RNN op as a planner decision: stash or recompute per op node.

Inside a compiled graph, an RNN op built with ``memory="auto"`` reaches the joint graph
with ``"auto"`` (``ops/rnn/dispatch.py``). ``plan_joint`` decides each such op together
with the value plan (``planner.plan``), rewriting the joint graph for each
candidate: the forward and backward nodes' ``memory`` argument and the forward's
``saved`` outputs (their number and sizes change with the mode), so the value planner
sees the saved values and the op's declared temporaries of that mode. An explicit
``memory=`` on the module reaches the graph as "stash" or "recompute" and is left
alone; ``MirrorPolicy.forbids(node)`` (a ``mark(module, mirror=False)``, an op
override ``mirrorgrad::rnn_forward=False``, ``MIRRORGRAD_MIRROR=0``) keeps stash.

Candidates: no op recomputed, then the ops switched to recompute one more at a time,
best saved bytes per added second first; each gets its own value plan.

- balance: the lowest estimated peak whose op time plus value time stays within
  ``max_overhead`` of the step (the value planner gets what the ops leave of the cap);
- budget: the least added time (ops and values) whose peak meets the budget, a
  fraction of the peak with every op stashing and nothing mirrored; else the lowest
  peak (one ``MirrorgradBudgetWarning`` for the final plan, not one per candidate);
- off: stash (no recomputation of any kind).

What recompute adds is the difference of the op's priced time in the two modes: its time
formula (``formulas.register_time_formula``; for the RNN op ops/rnn/time_model.py's fitted
per-step rule), else one forward's GEMMs again in backward (the op's FLOP formula).
"""

from __future__ import annotations

import dataclasses
import operator
import warnings
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node
from torch.utils.flop_counter import flop_registry

from mirrorgrad import _compat
from mirrorgrad._units import format_bytes
from mirrorgrad.formulas import time_formula
from mirrorgrad.graph.cost import DeviceRates, op_cost, rates_for
from mirrorgrad.graph.held import held_bytes
from mirrorgrad.graph.joint import JointGraph, fake_value
from mirrorgrad.mirror import budget_search, planner
from mirrorgrad.mirror.plan import (
    BUDGET_TOLERANCE,
    BudgetScale,
    MirrorgradBudgetWarning,
    Plan,
    PlanOptions,
    budget_message,
)
from mirrorgrad.mirror.policy import MirrorPolicy, module_path
from mirrorgrad.ops.rnn import op as rnn_op
from mirrorgrad.ops.rnn.cell_modes import GATES

_FORWARD = torch.ops.mirrorgrad.rnn_forward.default
_BACKWARD = torch.ops.mirrorgrad.rnn_backward.default
# Positions in the ops' schemas (ops/rnn/op.py).
_FWD_MEMORY, _FWD_MODE, _FWD_IMPL, _BWD_SAVED, _BWD_MEMORY = 12, 6, 14, 10, 17
_SAVED_OUTPUT = 3


@dataclass(kw_only=True, slots=True, frozen=True)
class OpMemoryChoice:
    """One RNN op's memory mode, as ``explain`` lists it."""

    node: str  # the forward op node
    module: str  # the module that called it ("" if unknown)
    choice: str  # "stash" or "recompute"
    reason: str  # "balance", "budget", "off", "pinned" or "explicit"
    stash_bytes: int  # what the op saves for backward with memory="stash"
    recompute_bytes: int  # ... with memory="recompute"
    recompute_seconds: float  # backward time recompute adds (estimated)
    seconds: float = 0.0  # the op's forward and backward calls as priced, in this choice

    @property
    def added_seconds(self) -> float:
        return self.recompute_seconds if self.choice == "recompute" else 0.0

    @property
    def bytes_saved(self) -> int:
        """Stash bytes the choice removes against stashing."""
        return self.stash_bytes - self.recompute_bytes if self.choice == "recompute" else 0

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __str__(self) -> str:
        where = f" ({self.module})" if self.module else ""
        sizes = (
            f"saved {format_bytes(self.stash_bytes)} -> {format_bytes(self.recompute_bytes)}, "
            f"+{self.recompute_seconds * 1e6:.1f} us"
        )
        priced = f"; op priced {self.seconds * 1e3:.3f} ms fwd+bwd" if self.seconds else ""
        if self.choice == "recompute":
            return f"{self.node}{where}: recompute [{self.reason}] ({sizes}{priced})"
        return f"{self.node}{where}: {self.choice} [{self.reason}] (recompute: {sizes}{priced})"


@dataclass(kw_only=True, slots=True)
class _Candidate:
    forward: Node
    backward: list[Node]
    stash_bytes: int  # saved bytes with memory="stash"
    recompute_bytes: int
    added_seconds: float
    added_flops: int

    @property
    def saves(self) -> int:
        return self.stash_bytes - self.recompute_bytes


def plan_joint(
    joint_gm: GraphModule, num_fwd_outputs: int, options: PlanOptions
) -> tuple[JointGraph, Plan]:
    """The plan of ``joint_gm``, with every ``memory="auto"`` RNN op decided and the graph
    rewritten for that decision; returns the joint graph as planned and the plan."""
    policy = options.policy if options.policy is not None else MirrorPolicy()
    joint = JointGraph.from_fx(joint_gm, num_fwd_outputs)
    rates = options.device if options.device is not None else rates_for(joint.device)
    ops = [n for n in joint_gm.graph.nodes if n.target is _FORWARD]
    sized = {n: _candidate(n, rates) for n in ops}
    candidates = [sized[n] for n in ops if n.args[_FWD_MEMORY] == "auto"]
    free = [c for c in candidates if not policy.forbids(c.forward)]
    if options.mode == "off" or not policy.enabled:
        free = []
    free = [c for c in free if c.saves > 0]
    free.sort(key=lambda c: -c.saves / max(c.added_seconds, 1e-12))

    def planned_graph(k: int) -> JointGraph:
        recomputed = {c.forward for c in free[:k]}
        for c in candidates:
            _rewrite(joint_gm, c, "recompute" if c.forward in recomputed else "stash")
        if candidates:
            joint_gm.graph.lint()
            joint_gm.recompile()
        return JointGraph.from_fx(joint_gm, num_fwd_outputs)

    def planned(k: int, inner: PlanOptions) -> tuple[JointGraph, Plan]:
        graph = planned_graph(k)
        return graph, planner.plan(graph, inner, warn=False)

    scale = None
    if options.mode == "budget" and isinstance(options.budget, float) and free:
        scale = _scale_over_op_choices(options, free, planned_graph)
        options = dataclasses.replace(options, budget=max(scale.budget_bytes, 2))
    joint, base = planned(0, options)
    if scale is not None:
        base = dataclasses.replace(base, budget_scale=scale)
    trials = {0: (base, options)}
    for k in range(1, len(free) + 1):
        inner = _inner_options(options, base, _op_seconds(free[:k]))
        if inner is None:  # balance: these ops alone exceed the cap
            break
        joint, trial = planned(k, inner)
        trials[k] = (trial, inner)
    best = _choose(options, base, {k: p for k, (p, _) in trials.items()}, free)
    chosen = trials[best][0]
    if best != max(trials):  # the graph holds the last trial's rewrite: plan it again
        joint, chosen = planned(best, trials[best][1])
    choices = _choices(sized, candidates, free[:best], policy, options.mode, rates)
    result = _combined(chosen, base, free[:best], choices)
    result.held = held_bytes(joint)
    if result.budget_met is False:
        warnings.warn(
            budget_message(result), MirrorgradBudgetWarning,
            stacklevel=3,
        )  # fmt: skip
    return joint, result


def _scale_over_op_choices(
    options: PlanOptions, free: list[_Candidate], planned_graph
) -> BudgetScale:
    """A fraction's scale (``BudgetScale``) over the value plans of every op choice
    (k = 0, 1, ... ops recomputing, their time added): recomputing an op drops its
    stash, so the smallest stash, and what a fraction asks for, counts it."""
    points, default_stash = [], None
    for k in range(len(free) + 1):
        found, default = budget_search.budget_points(planned_graph(k), options)
        points += [(stash, peak, t + _op_seconds(free[:k])) for stash, peak, t in found]
        default_stash = default if default_stash is None else default_stash
    return BudgetScale.of(options.budget, points, default_stash)


def _op_seconds(recomputed: list[_Candidate]) -> float:
    return sum(c.added_seconds for c in recomputed)


def _inner_options(options: PlanOptions, base: Plan, op_seconds: float) -> PlanOptions | None:
    """The value planner's options once ops take ``op_seconds``: balance gets what they
    leave of the cap (None: nothing), budget the base plan's budget in bytes."""
    if options.mode == "budget":
        return dataclasses.replace(options, budget=max(int(base.budget_bytes or 0), 2))
    left = options.max_overhead * base.step_time_s - op_seconds
    if left < 0:
        return None
    return dataclasses.replace(options, max_overhead=left / max(base.step_time_s, 1e-30))


def _choose(options: PlanOptions, base: Plan, trials: dict[int, Plan], free) -> int:
    """How many of ``free`` (best first) to recompute: balance the lowest peak (then the
    least time); budget the least time that meets it (else the lowest peak)."""

    def seconds(k: int) -> float:
        return trials[k].added_time_s + _op_seconds(free[:k])

    lowest = min(trials, key=lambda k: (trials[k].peak_after, seconds(k), k))
    if options.mode != "budget" or base.budget_bytes is None:
        return lowest
    feasible = [k for k in trials if trials[k].peak_after <= base.budget_bytes]
    return min(feasible, key=lambda k: (seconds(k), trials[k].peak_after, k), default=lowest)


def _combined(chosen: Plan, base: Plan, recomputed: list[_Candidate], choices) -> Plan:
    """``chosen`` (the value plan after the op rewrite) measured against ``base`` (every op
    stashing, nothing mirrored), with the ops' recompute time and choices added."""
    met = None
    if base.budget_bytes is not None:
        met = chosen.peak_after <= base.budget_bytes * (1 + BUDGET_TOLERANCE)
    return dataclasses.replace(
        chosen,
        peak_before=base.peak_before,
        stash_bytes_before=base.stash_bytes_before,
        step_time_s=base.step_time_s,
        added_time_s=chosen.added_time_s + _op_seconds(recomputed),
        added_flops=chosen.added_flops + sum(c.added_flops for c in recomputed),
        budget_bytes=base.budget_bytes,
        budget_scale=base.budget_scale,
        budget_met=met,
        op_memory=choices,
    )


def _choices(sized: dict[Node, _Candidate], decided: list[_Candidate],
             recomputed: list[_Candidate], policy: MirrorPolicy,
             mode: str, rates: DeviceRates) -> list[OpMemoryChoice]:  # fmt: skip
    """One ``OpMemoryChoice`` per RNN op of the graph (``sized``), in graph order; the
    graph holds the chosen rewrite, so the op's priced time is the chosen mode's."""
    auto = {c.forward for c in decided}
    chosen = {c.forward for c in recomputed}
    rows = []
    for node, c in sized.items():
        if node not in auto:  # an explicit memory= on the module
            reason, choice = "explicit", str(node.args[_FWD_MEMORY])
        else:
            choice = "recompute" if node in chosen else "stash"
            reason = "pinned" if policy.forbids(node) else mode
        rows.append(
            OpMemoryChoice(
                node=node.name,
                module=_module_of(node),
                choice=choice,
                reason=reason,
                stash_bytes=c.stash_bytes,
                recompute_bytes=c.recompute_bytes,
                recompute_seconds=c.added_seconds,
                seconds=sum(op_cost(n, rates).seconds for n in (node, *c.backward)),
            )
        )
    return rows


def _module_of(node: Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    dynamo_path = list(stack.values())[-1][0]
    return module_path(dynamo_path)


def _candidate(forward: Node, rates: DeviceRates) -> _Candidate:
    args = [fake_value(a) for a in forward.args]
    backward = [u for u in _users_through_getitems(forward) if u.target is _BACKWARD]
    flops = flop_registry[torch.ops.mirrorgrad.rnn_forward]
    forward_flops = _hint(flops(*args, out_val=forward.meta.get("val")))
    recomputes = args[_FWD_MODE] in ("lstm", "gru")
    added = len(backward) * forward_flops if recomputes else 0
    timed = [_timed_difference(forward, _FWD_MEMORY)]
    timed += [_timed_difference(b, _BWD_MEMORY) for b in backward]
    seconds = sum(timed) if None not in timed else added / rates.matmul_flops_per_s
    return _Candidate(
        forward=forward,
        backward=backward,
        stash_bytes=_saved_bytes(forward, "stash"),
        recompute_bytes=_saved_bytes(forward, "recompute"),
        added_seconds=seconds,
        added_flops=int(added),
    )


def _timed_difference(node: Node, position: int) -> float | None:
    """Seconds the call at ``node`` takes with memory="recompute" more than with "stash",
    by its op's time formula; None without one (or where it has no estimate)."""
    formula = time_formula(node.target)
    if formula is None:
        return None
    args = [fake_value(a) for a in node.args]
    times = []
    for memory in ("stash", "recompute"):
        args[position] = memory
        times.append(formula(*args))
    if None in times:
        return None
    return times[1] - times[0]


def _saved_bytes(forward: Node, memory: str) -> int:
    """What the op saves for backward (its own stash and the inner layers' outputs)."""
    args = [fake_value(a) for a in forward.args]
    x, weights, hx = args[0], args[1], args[2]
    mode, num_layers, bidirectional, impl = args[6], args[7], args[8], args[_FWD_IMPL]
    T, B, _ = x.shape
    H = weights[1].shape[0] // GATES[mode]
    per_direction = rnn_op.layer_saved_bytes(impl, mode, memory, T, B, H, x.dtype)
    layer_outputs = (num_layers - 1) * T * B * (2 if bidirectional else 1) * hx.shape[-1]
    directions = num_layers * (2 if bidirectional else 1)
    return _hint(directions * per_direction + layer_outputs * x.dtype.itemsize)


def _hint(value: object) -> int:
    """An int from a size that may be symbolic (dynamic shapes: its example value)."""
    if isinstance(value, torch.SymInt):
        return int(_compat.optimization_hint(value, fallback=4096))
    return int(value)


def _users_through_getitems(node: Node) -> list[Node]:
    out, stack = [], list(node.users)
    while stack:
        u = stack.pop()
        if u.target is operator.getitem:
            stack.extend(u.users)
        elif u not in out:
            out.append(u)
    return out


def _rewrite(gm: GraphModule, c: _Candidate, memory: str) -> None:
    """Set ``memory`` on the op's forward and backward nodes and rebuild the forward's
    saved outputs for it (their getitems and fake values)."""
    forward = c.forward
    args = list(forward.args)
    args[_FWD_MEMORY] = memory
    forward.args = tuple(args)
    _refresh_input_vals(forward)
    value = rnn_op.rnn_forward_fake(*[fake_value(a) for a in args])
    forward.meta["val"] = value
    saved_list = next(
        (u for u in forward.users if u.target is operator.getitem and u.args[1] == _SAVED_OUTPUT),
        None,
    )
    items: list[Node] = []
    if saved_list is not None:
        saved_list.meta["val"] = value[_SAVED_OUTPUT]
        old = {u.args[1]: u for u in saved_list.users if u.target is operator.getitem}
        template = next(iter(old.values()), saved_list)
        with gm.graph.inserting_after(saved_list):
            for i in reversed(range(len(value[_SAVED_OUTPUT]))):
                item = gm.graph.call_function(operator.getitem, (saved_list, i))
                item.meta = {**template.meta, "val": value[_SAVED_OUTPUT][i]}
                item.meta.pop("tensor_meta", None)  # the old element's shape
                items.insert(0, item)
    for node in c.backward:
        bargs = list(node.args)
        bargs[_BWD_SAVED] = items
        bargs[_BWD_MEMORY] = memory
        node.args = tuple(bargs)
        _refresh_input_vals(node)
    if saved_list is not None:
        for u in list(saved_list.users):
            if u not in items and not u.users:
                gm.graph.erase_node(u)


def _refresh_input_vals(node: Node) -> None:
    """Make ``meta["eager_input_vals"]`` (the fake arguments recorded at tracing, from which
    Inductor rebuilds a custom op's call to fix its inputs' strides) the rewritten ones:
    a stale copy made Inductor pass the old number of saved tensors to the backward."""
    if "eager_input_vals" in node.meta:
        node.meta["eager_input_vals"] = (
            tuple(fake_value(a) for a in node.args),
            {k: fake_value(v) for k, v in node.kwargs.items()},
        )
