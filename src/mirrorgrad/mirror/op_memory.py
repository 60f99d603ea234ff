"""The memory mode of our RNN op as a planner decision: stash or recompute per op node.

Inside a compiled graph, an RNN op built with ``memory="auto"`` reaches the joint graph
with ``"auto"`` (``ops/rnn/dispatch.py``). ``choose_op_memory`` decides each such op
before the partitioner runs and rewrites the joint graph: the forward and backward
nodes' ``memory`` argument and the forward's ``saved`` outputs (their number and sizes
change with the mode). An explicit ``memory=`` on the module reaches the graph as
"stash" or "recompute" and is left alone; ``pinned(node)`` (a ``mark(module,
mirror=False)``) keeps stash.

- balance: recompute the ops whose saved bytes per added second are best while their
  added time stays within ``max_overhead`` of the step;
- budget: recompute, best first, until the stash removed covers what the peak exceeds
  the budget by (all of them when that is not enough);
- off: stash (what an unplanned training step keeps).

Recompute costs one forward's GEMMs again in backward (the op's FLOP formula).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node
from torch.utils.flop_counter import flop_registry

from mirrorgrad.graph.cost import H100, DeviceRates
from mirrorgrad.graph.joint import fake_value
from mirrorgrad.ops.rnn import op as rnn_op
from mirrorgrad.ops.rnn.cells import GATES

_FORWARD = torch.ops.mirrorgrad.rnn_forward.default
_BACKWARD = torch.ops.mirrorgrad.rnn_backward.default
# Positions in the ops' schemas (ops/rnn/op.py).
_FWD_MEMORY, _BWD_SAVED, _BWD_MEMORY = 12, 10, 17
_SAVED_OUTPUT = 3


@dataclass(kw_only=True, slots=True, frozen=True)
class OpMemoryChoice:
    """One RNN op's memory mode, for ``explain``."""

    node: str  # the forward op node
    choice: str  # "stash" or "recompute"
    reason: str  # "balance", "budget", "off", "pinned"
    bytes_saved: int  # stash bytes recompute removes (0 when stashing)
    added_seconds: float  # backward time recompute adds (0 when stashing)


@dataclass(kw_only=True, slots=True)
class _Candidate:
    forward: Node
    backward: list[Node]
    stash_bytes: int  # saved bytes with memory="stash"
    recompute_bytes: int
    added_seconds: float

    @property
    def saves(self) -> int:
        return self.stash_bytes - self.recompute_bytes


def choose_op_memory(
    gm: GraphModule,
    *,
    mode: str,
    step_seconds: float,
    peak_bytes: int | None = None,
    budget_bytes: int | None = None,
    max_overhead: float = 0.05,
    rates: DeviceRates = H100,
    pinned: Callable[[Node], bool] | None = None,
) -> list[OpMemoryChoice]:
    """Decide every ``memory="auto"`` RNN op of the joint graph ``gm`` and rewrite it.

    ``step_seconds``: the estimated step time (balance's overhead base); ``peak_bytes``
    and ``budget_bytes``: the estimated peak with every op stashing, and the budget
    (budget mode). Returns one choice per decided op; the caller rebuilds its
    ``JointGraph`` from ``gm`` afterwards."""
    candidates = [_candidate(n, rates) for n in gm.graph.nodes if _is_auto(n)]
    chosen: dict[Node, str] = {}
    free = [c for c in candidates if not (pinned and pinned(c.forward))]
    order = sorted(free, key=lambda c: -c.saves / max(c.added_seconds, 1e-12))
    if mode == "balance":
        allowed = max_overhead * step_seconds
        for c in order:
            if c.saves > 0 and c.added_seconds <= allowed:
                chosen[c.forward] = "recompute"
                allowed -= c.added_seconds
    elif mode == "budget" and peak_bytes is not None and budget_bytes is not None:
        excess = peak_bytes - budget_bytes
        for c in order:
            if excess <= 0 or c.saves <= 0:
                break
            chosen[c.forward] = "recompute"
            excess -= c.saves
    choices = []
    for c in candidates:
        choice = chosen.get(c.forward, "stash")
        reason = "pinned" if c not in free else mode
        _rewrite(gm, c, choice)
        recomputes = choice == "recompute"
        choices.append(
            OpMemoryChoice(
                node=c.forward.name,
                choice=choice,
                reason=reason,
                bytes_saved=c.saves if recomputes else 0,
                added_seconds=c.added_seconds if recomputes else 0.0,
            )
        )
    gm.graph.lint()
    gm.recompile()
    return choices


def _is_auto(node: Node) -> bool:
    return node.target is _FORWARD and node.args[_FWD_MEMORY] == "auto"


def _candidate(forward: Node, rates: DeviceRates) -> _Candidate:
    args = [fake_value(a) for a in forward.args]
    backward = [u for u in _users_through_getitems(forward) if u.target is _BACKWARD]
    sizes = {m: _saved_bytes(args, m) for m in ("stash", "recompute")}
    flops = flop_registry[torch.ops.mirrorgrad.rnn_forward]
    forward_flops = flops(*args, out_val=forward.meta.get("val"))
    added = len(backward) * forward_flops / rates.matmul_flops_per_s
    return _Candidate(
        forward=forward,
        backward=backward,
        stash_bytes=sizes["stash"],
        recompute_bytes=sizes["recompute"],
        added_seconds=added if args[6] in ("lstm", "gru") else 0.0,
    )


def _saved_bytes(args: list, memory: str) -> int:
    x, weights, hx = args[0], args[1], args[2]
    mode, num_layers, bidirectional, impl = args[6], args[7], args[8], args[14]
    T, B, _ = x.shape
    H = weights[1].shape[0] // GATES[mode]
    per_direction = rnn_op.layer_saved_bytes(impl, mode, memory, T, B, H, x.dtype)
    layer_outputs = (num_layers - 1) * T * B * (2 if bidirectional else 1) * hx.shape[-1]
    directions = num_layers * (2 if bidirectional else 1)
    return int(directions * per_direction + layer_outputs * x.dtype.itemsize)


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
    fake_args = [fake_value(a) for a in args]
    value = rnn_op.rnn_forward_fake(*fake_args)
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
                items.insert(0, item)
    for node in c.backward:
        bargs = list(node.args)
        bargs[_BWD_SAVED] = items
        bargs[_BWD_MEMORY] = memory
        node.args = tuple(bargs)
    if saved_list is not None:
        for u in list(saved_list.users):
            if u not in items and not u.users:
                gm.graph.erase_node(u)
