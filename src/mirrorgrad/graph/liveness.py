"""Allocation timeline of a partitioned training step -> its peak bytes.

The step runs the forward module, then the backward module, as AOTAutograd does:

- primals (parameters and inputs) are alive throughout; so are the forward outputs
  (the caller holds them until backward is done);
- forward values are allocated at their producer and freed after their last
  reader, except the saved ones, which live until their last backward reader;
- backward starts with the tangents; recomputed (mirrored) nodes run just before
  their first use, in the order ``reordering_to_mimic_autograd_engine`` gives;
- gradients (backward outputs) stay until the end of the step;
- views share the storage of their base: a storage is freed when the last value
  aliasing it dies; an op holds its inputs and its outputs at once;
- a custom op that declares its temporaries (``mirrorgrad.ops.formulas.
  register_memory_formula``: workspace, chunk buffers) holds them too while it runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch.fx import Node

from mirrorgrad import _compat
from mirrorgrad.graph.fusion import inlined
from mirrorgrad.graph.joint import JointGraph, JointGraphError, is_getitem
from mirrorgrad.ops.formulas import memory_formula


@dataclass(kw_only=True, slots=True, frozen=True)
class Event:
    phase: str  # "forward" or "backward"
    node: str
    live_bytes: int  # bytes alive while the node runs (its inputs and outputs included)


@dataclass(kw_only=True, slots=True)
class Liveness:
    peak: int
    peak_phase: str
    peak_node: str
    turn_bytes: int  # alive between forward and backward (primals, saved, outputs)
    timeline: list[Event]
    peak_index: int = -1  # position of the peak event in the timeline
    live_values: list[Node] = field(default_factory=list)  # alive at event ``live_at``


def forward_schedule(joint: JointGraph, saved: Iterable[Node]) -> list[Node]:
    """Forward nodes the forward module runs: those its outputs and saved values need."""
    roots = [n for n in (*joint.fwd_outputs, *saved) if n in joint.forward_set]
    return joint.sorted(_closure(joint, roots, joint.forward_set))


def backward_schedule(
    joint: JointGraph, saved: Iterable[Node], mirrored: Iterable[Node]
) -> list[Node]:
    """Backward-module nodes in execution order, recomputation just before first use."""
    available = set(saved) | set(joint.tangents)
    allowed = (set(joint.backward) | set(mirrored)) - available
    roots = [n for n in joint.bwd_outputs if n not in available]
    needed = _closure(joint, roots, allowed)
    for n in needed:
        for a in joint.inputs(n):
            if a not in needed and a not in available:
                raise JointGraphError(
                    f"backward node {n.name} reads {a.name}, which is neither saved nor recomputed"
                )
    return _autograd_order(joint, needed)


def simulate(
    joint: JointGraph,
    saved: Iterable[Node],
    mirrored: Iterable[Node],
    *,
    live_at: int | None = None,
    fusion: bool = False,
) -> Liveness:
    """Simulate one step with ``saved`` stashed and ``mirrored`` recomputed in backward.

    With ``live_at`` (a timeline position, e.g. a previous run's ``peak_index``), the
    result also lists the values alive at that event. With ``fusion``, pointwise
    values a fusing compiler keeps in registers are not allocated (Inductor).
    """
    saved = list(saved)
    mirrored = list(mirrored)
    fwd = forward_schedule(joint, saved)
    bwd = backward_schedule(joint, saved, mirrored)
    sim = _Simulator(joint, live_at, fusion)
    for p in joint.primals:
        sim.hold(p)
    kept_after_forward = set(saved) | set(joint.fwd_outputs) | set(joint.primals)
    sim.run("forward", fwd, keep=kept_after_forward)
    turn = sim.live_bytes
    sim.release_unread(saved, bwd)
    for t in joint.tangents:
        sim.hold(t)
    kept_to_end = set(joint.bwd_outputs) | set(joint.fwd_outputs) | set(joint.primals)
    sim.run("backward", bwd, keep=kept_to_end)
    if not sim.timeline:
        return Liveness(peak=turn, peak_phase="forward", peak_node="", turn_bytes=turn, timeline=[])
    index = max(range(len(sim.timeline)), key=lambda i: sim.timeline[i].live_bytes)
    peak_event = sim.timeline[index]
    return Liveness(
        peak=max(peak_event.live_bytes, turn),
        peak_phase=peak_event.phase,
        peak_node=peak_event.node,
        turn_bytes=turn,
        timeline=sim.timeline,
        peak_index=index,
        live_values=sim.snapshot,
    )


class _Simulator:
    """Reference-counted storages: a value holds its storage while it is alive."""

    def __init__(self, joint: JointGraph, live_at: int | None = None, fusion: bool = False) -> None:
        self.joint = joint
        self.live_at = live_at
        self.fusion = fusion
        self.virtual: set[Node] = set()  # storages a fusing compiler never allocates
        self.snapshot: list[Node] = []
        self.refs: dict[Node, int] = {}  # storage -> number of live values on it
        self.alive: set[Node] = set()
        self.live_bytes = 0
        self.timeline: list[Event] = []

    def hold(self, value: Node) -> None:
        if value in self.alive:
            return
        self.alive.add(value)
        s = self.joint.storage(value)
        self.refs[s] = self.refs.get(s, 0) + 1
        if self.refs[s] == 1 and s not in self.virtual:
            self.live_bytes += self.joint.nbytes(s)

    def drop(self, value: Node) -> None:
        if value not in self.alive:
            return
        self.alive.remove(value)
        s = self.joint.storage(value)
        self.refs[s] -= 1
        if self.refs[s] == 0 and s not in self.virtual:
            self.live_bytes -= self.joint.nbytes(s)

    def release_unread(self, saved: list[Node], bwd: list[Node]) -> None:
        read = {a for n in bwd for a in self.joint.inputs(n)}
        kept = set(self.joint.fwd_outputs) | set(self.joint.primals)
        for s in saved:
            if s not in read and s not in kept:
                self.drop(s)

    def run(self, phase: str, schedule: list[Node], keep: set[Node]) -> None:
        last_use: dict[Node, int] = {}
        inputs = [self.joint.inputs(n) for n in schedule]
        for i, args in enumerate(inputs):
            for a in args:
                last_use[a] = i
        scheduled = set(schedule)
        if self.fusion:
            self.virtual |= _fused_away(self.joint, schedule, keep)
        for i, n in enumerate(schedule):
            transient = 0
            tuple_valued = _is_tuple(n)
            if tuple_valued:
                # A multi-output op allocates all its outputs; those nobody reads die at once.
                produced = [u for u in n.users if is_getitem(u) and u in scheduled]
                for g in produced:
                    self.hold(g)
                transient = self.joint.nbytes(n) - sum(self.joint.nbytes(g) for g in produced)
            else:
                self.hold(n)
            transient = max(transient, 0) + temporary_bytes(n)
            self.timeline.append(
                Event(phase=phase, node=n.name, live_bytes=self.live_bytes + transient)
            )
            if len(self.timeline) - 1 == self.live_at:
                self.snapshot = self.joint.sorted(self.alive)
            for a in inputs[i]:
                if last_use.get(a) == i and a not in keep:
                    self.drop(a)
            if n not in last_use and n not in keep and not tuple_valued:
                self.drop(n)


def temporary_bytes(node: Node) -> int:
    """Bytes ``node``'s op declares it allocates while it runs beyond its inputs and
    outputs (``register_memory_formula``), from the fake values of its arguments; 0 for
    an op that declares nothing."""
    formula = memory_formula(node.target) if node.op == "call_function" else None
    if formula is None:
        return 0
    args = [_fake(a) for a in node.args]
    kwargs = {k: _fake(v) for k, v in node.kwargs.items()}
    nbytes = formula(*args, **kwargs)
    return (
        _compat.optimization_hint(nbytes, fallback=0)
        if isinstance(nbytes, torch.SymInt)
        else int(nbytes)
    )


def _fake(a: object) -> object:
    if isinstance(a, Node):
        return a.meta.get("val")
    if isinstance(a, (list, tuple)):
        return type(a)(_fake(x) for x in a)
    return a


def _fused_away(joint: JointGraph, schedule: list[Node], keep: set[Node]) -> set[Node]:
    """Pointwise values a fusing compiler (Inductor) computes inside their readers'
    kernels and never writes to memory: not kept past the phase, read by at most a
    few pointwise ops or reductions (through views), never by an extern kernel."""
    readers: dict[Node, list[Node]] = {}
    for n in schedule:
        for a in joint.inputs(n):
            readers.setdefault(joint.storage(a), []).append(n)
    kept_storages = {joint.storage(v) for v in keep}
    return {n for n in schedule if n not in kept_storages and inlined(n, readers.get(n, []))}


def _is_tuple(node: Node) -> bool:
    return isinstance(node.meta.get("val"), (tuple, list))


def _closure(
    joint: JointGraph, roots: list[Node], allowed: set[Node] | frozenset[Node]
) -> set[Node]:
    seen: set[Node] = set()
    stack = [r for r in roots if r in allowed]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(a for a in joint.inputs(n) if a in allowed and a not in seen)
    return seen


def _autograd_order(joint: JointGraph, nodes: set[Node]) -> list[Node]:
    """Mimic ``reordering_to_mimic_autograd_engine``: walk the nodes from the first
    tangent reader in graph order; before each, run its not-yet-run inputs."""
    ordered = joint.sorted(nodes)
    tangents = set(joint.tangents)
    first = next((i for i, n in enumerate(ordered) if tangents.intersection(joint.inputs(n))), None)
    if first is None:
        return ordered
    done: set[Node] = set()
    schedule: list[Node] = []
    for n in ordered[first:]:
        if n in done:
            continue
        deps: set[Node] = set()
        stack = [n]
        while stack:
            d = stack.pop()
            if d in deps or d in done:
                continue
            deps.add(d)
            stack.extend(a for a in joint.inputs(d) if a in nodes)
        for d in joint.sorted(deps):
            done.add(d)
            schedule.append(d)
    return schedule
