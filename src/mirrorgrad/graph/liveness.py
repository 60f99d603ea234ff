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
- a custom op that declares its temporaries (``mirrorgrad.formulas.
  register_memory_formula``: workspace, chunk buffers) holds them too while it runs.

The planner simulates thousands of candidate plans on graphs of ~10k nodes, so the
simulation runs on ``GraphIndex``: the graph as integer arrays, built once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch.fx import Node

from mirrorgrad import _compat
from mirrorgrad.formulas import memory_formula
from mirrorgrad.graph.fusion import (
    INLINE_READERS,
    REALIZE_ACC_READS,
    fusible_reader,
    is_pointwise,
)
from mirrorgrad.graph.joint import (
    JointGraph,
    JointGraphError,
    fake_args,
    is_getitem,
    is_view,
    op_name,
)


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
    peak_index: int = -1  # position of the peak event in the timeline
    live_values: list[Node] = field(default_factory=list)  # alive at event ``live_at``
    # Bytes of the live storages at ``live_at`` (fused-away ones excluded), by storage.
    live_storages: dict[Node, int] = field(default_factory=dict)
    event_nodes: list[Node] = field(default_factory=list, repr=False)
    event_bytes: list[int] = field(default_factory=list, repr=False)
    forward_events: int = 0  # the first this many events are the forward pass

    @property
    def timeline(self) -> list[Event]:
        return [
            Event(
                phase="forward" if i < self.forward_events else "backward",
                node=n.name,
                live_bytes=b,
            )
            for i, (n, b) in enumerate(zip(self.event_nodes, self.event_bytes))
        ]


class GraphIndex:
    """A joint graph as integer arrays (node ids in graph order) for the simulation."""

    def __init__(self, joint: JointGraph) -> None:
        self.joint = joint
        nodes = list(joint.gm.graph.nodes)
        ix = {n: i for i, n in enumerate(nodes)}
        self.nodes, self.ix = nodes, ix
        self.inputs = [tuple(ix[a] for a in joint.inputs(n)) for n in nodes]
        self.storage = [ix[joint.storage(n)] for n in nodes]
        self.nbytes = [joint.nbytes(n) for n in nodes]
        self.temporary = [temporary_bytes(n) for n in nodes]
        self.tuple_valued = [isinstance(n.meta.get("val"), (tuple, list)) for n in nodes]
        # A multi-output op allocates its outputs, those inside a list output too (a
        # custom op's saved tensors or weight gradients): the list, read by getitems, is
        # a container of 0 bytes, its elements are the op's outputs.
        nested = [self.tuple_valued[i] and is_getitem(n) for i, n in enumerate(nodes)]
        for i in (i for i, inner in enumerate(nested) if inner):
            self.nbytes[i] = 0
        self.getitems = {
            i: [ix[u] for u in _leaf_getitems(n)]
            for i, n in enumerate(nodes)
            if self.tuple_valued[i] and not nested[i]
        }
        self.view = [is_view(n) for n in nodes]
        # May be computed in its readers' kernels (fusion.inlined, before the readers).
        self.pointwise = [is_pointwise(n) and not self.view[i] for i, n in enumerate(nodes)]
        self.fusible = [fusible_reader(n) for n in nodes]
        self.forward = [i for i, n in enumerate(nodes) if n in joint.forward_set]
        self.is_forward = bytearray(len(nodes))
        for i in self.forward:
            self.is_forward[i] = 1
        self.backward = [ix[n] for n in joint.backward]
        self.primals = [ix[n] for n in joint.primals]
        self.tangents = [ix[n] for n in joint.tangents]
        self.fwd_outputs = [ix[n] for n in joint.fwd_outputs]
        self.bwd_outputs = [ix[n] for n in joint.bwd_outputs]

    def ids(self, nodes: Iterable[Node]) -> list[int]:
        return [self.ix[n] for n in nodes]

    def forward_schedule(self, saved: list[int]) -> list[int]:
        allowed = self.is_forward
        roots = [n for n in (*self.fwd_outputs, *saved) if allowed[n]]
        seen = self._closure(roots, allowed)
        return [i for i in self.forward if seen[i]]

    def backward_schedule(self, saved: list[int], mirrored: list[int]) -> list[int]:
        size = len(self.nodes)
        available = bytearray(size)
        for i in (*saved, *self.tangents):
            available[i] = 1
        allowed = bytearray(size)
        for i in (*self.backward, *mirrored):
            if not available[i]:
                allowed[i] = 1
        roots = [n for n in self.bwd_outputs if not available[n]]
        needed = self._closure(roots, allowed)
        order = [i for i in range(size) if needed[i]]
        for n in order:
            for a in self.inputs[n]:
                if not needed[a] and not available[a]:
                    raise JointGraphError(
                        f"backward node {self.nodes[n].name} reads {self.nodes[a].name}, "
                        "which is neither saved nor recomputed"
                    )
        return self._autograd_order(order, needed)

    def _closure(self, roots: list[int], allowed: bytearray) -> bytearray:
        inputs = self.inputs
        seen = bytearray(len(self.nodes))
        stack = [r for r in roots if allowed[r]]
        while stack:
            n = stack.pop()
            if seen[n]:
                continue
            seen[n] = 1
            stack.extend(a for a in inputs[n] if allowed[a] and not seen[a])
        return seen

    def _autograd_order(self, ordered: list[int], nodes: bytearray) -> list[int]:
        """Mimic ``reordering_to_mimic_autograd_engine``: walk the nodes from the first
        tangent reader in graph order; before each, run its not-yet-run inputs."""
        inputs = self.inputs
        tangents = set(self.tangents)
        first = next((k for k, n in enumerate(ordered) if tangents.intersection(inputs[n])), None)
        if first is None:
            return ordered
        done = bytearray(len(self.nodes))
        schedule: list[int] = []
        for n in ordered[first:]:
            if done[n]:
                continue
            deps: list[int] = []
            stack = [n]
            while stack:
                d = stack.pop()
                if done[d]:
                    continue
                done[d] = 1
                deps.append(d)
                stack.extend(a for a in inputs[d] if nodes[a] and not done[a])
            deps.sort()
            schedule.extend(deps)
        return schedule


def _leaf_getitems(node: Node) -> list[Node]:
    """The getitems that read ``node``'s tensors, through getitems of list outputs."""
    leaves = []
    for user in node.users:
        if not is_getitem(user):
            continue
        if isinstance(user.meta.get("val"), (tuple, list)):
            leaves += _leaf_getitems(user)
        else:
            leaves.append(user)
    return leaves


def forward_schedule(joint: JointGraph, saved: Iterable[Node]) -> list[Node]:
    """Forward nodes the forward module runs: those its outputs and saved values need."""
    index = GraphIndex(joint)
    return [index.nodes[i] for i in index.forward_schedule(index.ids(saved))]


def backward_schedule(
    joint: JointGraph, saved: Iterable[Node], mirrored: Iterable[Node]
) -> list[Node]:
    """Backward-module nodes in execution order, recomputation just before first use."""
    index = GraphIndex(joint)
    return [index.nodes[i] for i in index.backward_schedule(index.ids(saved), index.ids(mirrored))]


def simulate(
    joint: JointGraph,
    saved: Iterable[Node],
    mirrored: Iterable[Node],
    *,
    live_at: int | None = None,
    fusion: bool = False,
    index: GraphIndex | None = None,
) -> Liveness:
    """Simulate one step with ``saved`` stashed and ``mirrored`` recomputed in backward.

    With ``live_at`` (a timeline position, e.g. a previous run's ``peak_index``), the
    result also lists the values alive at that event. With ``fusion``, pointwise
    values a fusing compiler keeps in registers are not allocated (Inductor).
    ``index`` (``GraphIndex(joint)``) saves rebuilding it when simulating many plans.
    """
    ix = index if index is not None else GraphIndex(joint)
    saved_ids = ix.ids(saved)
    fwd = ix.forward_schedule(saved_ids)
    bwd = ix.backward_schedule(saved_ids, ix.ids(mirrored))
    sim = _Simulator(ix, live_at, fusion)
    for p in ix.primals:
        sim.hold(p)
    sim.run(fwd, [*saved_ids, *ix.fwd_outputs, *ix.primals])
    turn = sim.live_bytes
    forward_events = len(sim.event_bytes)
    sim.release_unread(saved_ids, bwd)
    for t in ix.tangents:
        sim.hold(t)
    sim.run(bwd, [*ix.bwd_outputs, *ix.fwd_outputs, *ix.primals])
    nodes = [ix.nodes[i] for i in sim.event_nodes]
    if not nodes:
        return Liveness(peak=turn, peak_phase="forward", peak_node="", turn_bytes=turn)
    events = sim.event_bytes
    index_ = max(range(len(events)), key=events.__getitem__)
    return Liveness(
        peak=max(events[index_], turn),
        peak_phase="forward" if index_ < forward_events else "backward",
        peak_node=nodes[index_].name,
        turn_bytes=turn,
        peak_index=index_,
        live_values=[ix.nodes[i] for i in sim.snapshot],
        live_storages={ix.nodes[s]: b for s, b in sim.snapshot_storages},
        event_nodes=nodes,
        event_bytes=events,
        forward_events=forward_events,
    )


class _Simulator:
    """Reference-counted storages: a value holds its storage while it is alive."""

    def __init__(self, ix: GraphIndex, live_at: int | None, fusion: bool) -> None:
        size = len(ix.nodes)
        self.ix = ix
        self.live_at = -1 if live_at is None else live_at
        self.fusion = fusion
        self.virtual = bytearray(size)  # storages a fusing compiler never allocates
        self.refs = [0] * size  # storage -> number of live values on it
        self.alive = bytearray(size)
        self.live_bytes = 0
        self.event_nodes: list[int] = []
        self.event_bytes: list[int] = []
        self.snapshot: list[int] = []
        self.snapshot_storages: list[tuple[int, int]] = []

    def hold(self, value: int) -> None:
        if self.alive[value]:
            return
        self.alive[value] = 1
        s = self.ix.storage[value]
        self.refs[s] += 1
        if self.refs[s] == 1 and not self.virtual[s]:
            self.live_bytes += self.ix.nbytes[s]

    def drop(self, value: int) -> None:
        if not self.alive[value]:
            return
        self.alive[value] = 0
        s = self.ix.storage[value]
        self.refs[s] -= 1
        if self.refs[s] == 0 and not self.virtual[s]:
            self.live_bytes -= self.ix.nbytes[s]

    def release_unread(self, saved: list[int], bwd: list[int]) -> None:
        inputs = self.ix.inputs
        read = {a for n in bwd for a in inputs[n]}
        kept = {*self.ix.fwd_outputs, *self.ix.primals}
        for s in saved:
            if s not in read and s not in kept:
                self.drop(s)

    def run(self, schedule: list[int], keep_ids: list[int]) -> None:
        ix = self.ix
        inputs, storage, nbytes, getitems = ix.inputs, ix.storage, ix.nbytes, ix.getitems
        keep = bytearray(len(ix.nodes))
        for i in keep_ids:
            keep[i] = 1
        last_use: dict[int, int] = {}
        for pos, n in enumerate(schedule):
            for a in inputs[n]:
                last_use[a] = pos
        if self.fusion:
            # Per phase: a value computed in registers in the forward pass may be
            # written to memory when it is recomputed for an extern backward kernel.
            self.virtual = bytearray(len(ix.nodes))
            for s in _fused_away(ix, schedule, keep_ids):
                self.virtual[s] = 1
            _extend_reads_of_inlined(ix, schedule, last_use, self.virtual)
        dies_at: dict[int, list[int]] = {}
        for a, pos in last_use.items():
            if not keep[a]:
                dies_at.setdefault(pos, []).append(a)
        alive, refs, virtual = self.alive, self.refs, self.virtual
        scheduled = bytearray(len(ix.nodes))
        for n in schedule:
            scheduled[n] = 1
        live = self.live_bytes
        start = len(self.event_bytes)
        event_nodes, event_bytes = self.event_nodes, self.event_bytes
        snapshot_at = self.live_at - start
        for pos, n in enumerate(schedule):
            produced = getitems.get(n)
            if produced is None:
                allocated, transient = (n,), 0
            else:
                # A multi-output op allocates all its outputs; those nobody reads die at once.
                allocated = [g for g in produced if scheduled[g]]
                transient = max(nbytes[n] - sum(nbytes[g] for g in allocated), 0)
            for v in allocated:
                if not alive[v]:
                    alive[v] = 1
                    s = storage[v]
                    refs[s] += 1
                    if refs[s] == 1 and not virtual[s]:
                        live += nbytes[s]
            transient += ix.temporary[n]
            event_nodes.append(n)
            event_bytes.append(live + transient)
            if pos == snapshot_at:
                self._snapshot()
            dead = dies_at.get(pos, ())
            if produced is None and n not in last_use and not keep[n]:
                dead = [*dead, n]
            for v in dead:
                if alive[v]:
                    alive[v] = 0
                    s = storage[v]
                    refs[s] -= 1
                    if refs[s] == 0 and not virtual[s]:
                        live -= nbytes[s]
        self.live_bytes = live

    def _snapshot(self) -> None:
        ix = self.ix
        self.snapshot = [i for i in range(len(ix.nodes)) if self.alive[i]]
        self.snapshot_storages = [
            (s, ix.nbytes[s])
            for s in range(len(ix.nodes))
            if self.refs[s] > 0 and not self.virtual[s]
        ]


def _extend_reads_of_inlined(
    ix: GraphIndex, schedule: list[int], last_use: dict[int, int], virtual: bytearray
) -> None:
    """An inlined value is computed inside the kernels of its readers: the values it
    reads are read there too, so they live until its last reader has run."""
    inputs, storage = ix.inputs, ix.storage
    for pos in range(len(schedule) - 1, -1, -1):
        n = schedule[pos]
        if not virtual[storage[n]]:
            continue
        end = last_use.get(n, pos)
        for a in inputs[n]:
            if last_use[a] < end:
                last_use[a] = end


def _fused_away(ix: GraphIndex, schedule: list[int], keep_ids: list[int]) -> list[int]:
    """Pointwise values a fusing compiler (Inductor) computes inside their readers'
    kernels and never writes to memory (``fusion.inlined``): not kept past the phase,
    read by at most a few pointwise ops or reductions (through views), never by an
    extern kernel. A chain whose code would read more than ``REALIZE_ACC_READS``
    buffers is written out there (Inductor's realize_acc_reads_threshold), which ends
    the lifetimes of the buffers it read (a gradient summed over many steps)."""
    size = len(ix.nodes)
    inputs, storage, view, fusible = ix.inputs, ix.storage, ix.view, ix.fusible
    direct = [0] * size  # non-view readers of each storage
    unfusible = bytearray(size)
    for n in schedule:
        if view[n]:
            continue
        for a in inputs[n]:
            s = storage[a]
            direct[s] += 1
            if not fusible[n]:
                unfusible[s] = 1
    kept = bytearray(size)
    for i in keep_ids:
        kept[storage[i]] = 1
    pointwise, nbytes = ix.pointwise, ix.nbytes
    reads: dict[int, set[int]] = {}  # inlined value -> the buffers its code reads
    for n in schedule:
        if not pointwise[n] or kept[n] or direct[n] > INLINE_READERS or unfusible[n]:
            continue
        buffers: set[int] = set()
        for a in inputs[n]:
            s = storage[a]
            if s in reads:
                buffers |= reads[s]
            elif nbytes[s]:
                buffers.add(s)
        if len(buffers) <= REALIZE_ACC_READS:
            reads[n] = buffers
    return list(reads)


# What holds memory at a peak, in the categories a memory snapshot is read in.
KINDS = (
    "parameters",
    "gradients",
    "inputs",
    "saved activations",
    "recomputed",
    "forward temporaries",
    "backward temporaries",
    "forward outputs",
    "op temporaries",
)


@dataclass(kw_only=True, slots=True)
class PeakBreakdown:
    """What is alive at a simulated peak: bytes by kind, and every live storage."""

    peak: int
    phase: str
    node: str
    bytes_by_kind: dict[str, int]
    values: list[tuple[Node, str, int]]  # (storage, kind, bytes), largest first

    def to_dict(self, largest: int = 8) -> dict:
        return {
            "peak_bytes": self.peak,
            "phase": self.phase,
            "node": self.node,
            "bytes_by_kind": dict(self.bytes_by_kind),
            "largest": [
                {"name": n.name, "op": _op(n), "kind": kind, "bytes": b}
                for n, kind, b in self.values[:largest]
            ],
        }


def peak_breakdown(
    joint: JointGraph,
    saved: Iterable[Node],
    mirrored: Iterable[Node],
    *,
    fusion: bool = False,
    index: GraphIndex | None = None,
) -> PeakBreakdown:
    """Simulate the plan and sort what is alive at its peak into ``KINDS``.

    Parameters are the primals that get a gradient; the other primals are inputs
    (and buffers). ``op temporaries`` are bytes an op holds beyond its values (the
    unread outputs of a multi-output op).
    """
    saved, mirrored = list(saved), list(mirrored)
    index = index if index is not None else GraphIndex(joint)
    first = simulate(joint, saved, mirrored, fusion=fusion, index=index)
    sim = simulate(joint, saved, mirrored, fusion=fusion, index=index, live_at=first.peak_index)
    kind_of = _kinds(joint, saved, mirrored, backward=sim.peak_phase == "backward")
    by_kind = dict.fromkeys(KINDS, 0)
    rows = []
    for storage, nbytes in sim.live_storages.items():
        kind = kind_of(storage)
        by_kind[kind] += nbytes
        rows.append((storage, kind, nbytes))
    by_kind["op temporaries"] = max(sim.peak - sum(sim.live_storages.values()), 0)
    rows.sort(key=lambda r: (-r[2], joint.order[r[0]]))
    return PeakBreakdown(
        peak=sim.peak, phase=sim.peak_phase, node=sim.peak_node, bytes_by_kind=by_kind, values=rows
    )


def _kinds(joint: JointGraph, saved: list[Node], mirrored: list[Node], *, backward: bool):
    """storage -> its kind, for the storages alive at a peak in ``backward`` or not."""
    out_args = list(next(n for n in joint.gm.graph.nodes if n.op == "output").args[0])
    grads = out_args[joint.num_fwd_outputs :]
    if len(grads) == len(joint.primals):
        params = {p for p, g in zip(joint.primals, grads) if g is not None}
    else:  # not AOTAutograd's layout: call every primal a parameter
        params = set(joint.primals)
    gradients = {joint.storage(g) for g in joint.bwd_outputs}
    stashed = {joint.storage(s) for s in saved}
    outputs = {joint.storage(o) for o in joint.fwd_outputs}
    recomputed = set(mirrored)

    def kind(storage: Node) -> str:
        if storage.op == "placeholder":
            if storage in joint.tangents:
                return "backward temporaries"
            return "parameters" if storage in params else "inputs"
        if storage in gradients:
            return "gradients"
        if storage in outputs:
            return "forward outputs"
        if storage in stashed:
            return "saved activations"
        if storage in joint.forward_set:
            return "recomputed" if backward and storage in recomputed else "forward temporaries"
        return "backward temporaries"

    return kind


def _op(node: Node) -> str:
    return op_name(node) if node.op == "call_function" else node.op


def temporary_bytes(node: Node) -> int:
    """Bytes ``node``'s op declares it allocates while it runs beyond its inputs and
    outputs (``register_memory_formula``), from the fake values of its arguments; 0 for
    an op that declares nothing."""
    formula = memory_formula(node.target) if node.op == "call_function" else None
    if formula is None:
        return 0
    args, kwargs = fake_args(node)
    nbytes = formula(*args, **kwargs)
    return (
        _compat.optimization_hint(nbytes, fallback=0)
        if isinstance(nbytes, torch.SymInt)
        else int(nbytes)
    )
