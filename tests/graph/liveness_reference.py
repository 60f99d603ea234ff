"""The liveness simulation as it was before the interval arithmetic (one Python loop
over the schedule, reference-counted storages): the oracle the vectorised
``liveness.simulate`` must match exactly."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from torch.fx import Node

from mirrorgrad.graph.fusion import INLINE_READERS, REALIZE_ACC_READS
from mirrorgrad.graph.joint import JointGraph, JointGraphError
from mirrorgrad.graph.liveness import GraphIndex, Liveness


def simulate_reference(
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
    fwd = forward_schedule_reference(ix, saved_ids)
    bwd = backward_schedule_reference(ix, saved_ids, ix.ids(mirrored))
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
        forward_events=forward_events,
        _order=list(sim.event_nodes),
        _bytes=np.asarray(events, dtype=np.int64),
        _nodes=ix.nodes,
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
            dead = dies_at.get(pos, ())
            if produced is None and n not in last_use and not keep[n]:
                dead = [*dead, n]
            in_place = produced is None and self._written_in_place(n, dead, keep)
            event_nodes.append(n)
            event_bytes.append(live + transient - (nbytes[n] if in_place else 0))
            if pos == snapshot_at:
                self._snapshot(skip=n if in_place else None)
            for v in dead:
                if alive[v]:
                    alive[v] = 0
                    s = storage[v]
                    refs[s] -= 1
                    if refs[s] == 0 and not virtual[s]:
                        live -= nbytes[s]
        self.live_bytes = live

    def _written_in_place(self, n: int, dead, keep) -> bool:
        """Inductor writes pointwise ``n`` over a storage whose last value dies here (same
        bytes; not a primal, tangent or kept one; ``n`` not kept)."""
        ix = self.ix
        if not self.fusion or not ix.pointwise[n] or ix.storage[n] != n:
            return False
        if self.virtual[n] or keep[n]:
            return False
        owners = {*ix.primals, *ix.tangents}
        dying: dict[int, int] = {}
        for v in dead:
            if self.alive[v]:
                dying[ix.storage[v]] = dying.get(ix.storage[v], 0) + 1
        return any(
            count == self.refs[s] and s != n and not self.virtual[s] and s not in owners
            and not keep[s] and ix.nbytes[s] == ix.nbytes[n]
            for s, count in dying.items()
        )  # fmt: skip

    def _snapshot(self, skip: int | None = None) -> None:
        ix = self.ix
        self.snapshot = [i for i in range(len(ix.nodes)) if self.alive[i]]
        self.snapshot_storages = [
            (s, ix.nbytes[s])
            for s in range(len(ix.nodes))
            if self.refs[s] > 0 and not self.virtual[s] and s != skip
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


def backward_schedule_reference(ix: GraphIndex, saved: list[int], mirrored: list[int]) -> list[int]:
    """The backward schedule by a closure over the whole graph and a depth-first walk
    per node (``reordering_to_mimic_autograd_engine`` as written)."""
    size = len(ix.nodes)
    available = bytearray(size)
    for i in (*saved, *ix.tangents):
        available[i] = 1
    allowed = bytearray(size)
    for i in (*ix.backward, *mirrored):
        if not available[i]:
            allowed[i] = 1
    roots = [n for n in ix.bwd_outputs if not available[n]]
    needed = ix._closure(roots, allowed)
    ordered = [i for i in range(size) if needed[i]]
    for n in ordered:
        for a in ix.inputs[n]:
            if not needed[a] and not available[a]:
                raise JointGraphError(f"{ix.nodes[n].name} reads {ix.nodes[a].name}")
    tangents = set(ix.tangents)
    first = next((k for k, n in enumerate(ordered) if tangents.intersection(ix.inputs[n])), None)
    if first is None:
        return ordered
    done = bytearray(size)
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
            stack.extend(a for a in ix.inputs[d] if needed[a] and not done[a])
        deps.sort()
        schedule.extend(deps)
    return schedule


def forward_schedule_reference(ix: GraphIndex, saved: list[int]) -> list[int]:
    roots = [n for n in (*ix.fwd_outputs, *saved) if ix.is_forward[n]]
    seen = ix._closure(roots, ix.is_forward)
    return [i for i in ix.forward if seen[i]]


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
