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
from functools import cached_property

import numpy as np
import torch
from torch.fx import Node

from mirrorgrad import _compat
from mirrorgrad.formulas import memory_formula
from mirrorgrad.graph.fusion import (
    INLINE_READERS,
    REALIZE_ACC_READS,
    fusible_reader,
    is_pointwise,
    padded_strides,
    pads_in_place,
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
    forward_events: int = 0  # the first this many events are the forward pass
    # The timeline as the simulation leaves it (node ids, bytes), turned into lists of
    # nodes and ints only when asked: the planner reads the peak alone.
    _order: list[int] = field(default_factory=list, repr=False)
    _bytes: np.ndarray | None = field(default=None, repr=False)
    _nodes: list[Node] = field(default_factory=list, repr=False)

    @property
    def event_nodes(self) -> list[Node]:
        return [self._nodes[i] for i in self._order]

    @property
    def event_bytes(self) -> list[int]:
        return [] if self._bytes is None else self._bytes.tolist()

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
        # A pad Inductor writes into its input's buffer is a view of it.
        for i in (i for i, n in enumerate(nodes) if pads_in_place(n)):
            self.view[i], self.storage[i] = True, self.storage[ix[nodes[i].args[0]]]
        # Inductor's strides for a buffer it allocates (equal keys: the same layout).
        layouts: dict[tuple, int] = {}
        padding = _compat.stride_padding()
        self.np_layout = np.asarray(
            [layouts.setdefault(_layout(n, padding), len(layouts)) for n in nodes],
            dtype=np.int64,
        )
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
        # The same as numpy arrays, for the simulation's interval arithmetic.
        self.np_storage = np.asarray(self.storage, dtype=np.int64)
        self.np_nbytes = np.asarray(self.nbytes, dtype=np.int64)
        self.np_temporary = np.asarray(self.temporary, dtype=np.int64)
        self.np_tuple_valued = np.asarray(self.tuple_valued, dtype=bool)
        self.in_count = np.asarray([len(a) for a in self.inputs], dtype=np.int64)
        self.in_ptr = np.concatenate([[0], np.cumsum(self.in_count)[:-1]]).astype(np.int64)
        self.in_idx = np.asarray([a for ins in self.inputs for a in ins], dtype=np.int64)
        self.np_is_forward = np.frombuffer(self.is_forward, dtype=np.uint8).astype(bool)
        self._fused_backward: _FusedBackward | None = None
        self.np_view = np.asarray(self.view, dtype=bool)
        self.np_pointwise = np.asarray(self.pointwise, dtype=bool)
        self.np_owned = np.zeros(len(nodes), dtype=bool)  # the caller's: primals, tangents
        self.np_owned[[*self.primals, *self.tangents]] = True
        self.np_fusible = np.asarray(self.fusible, dtype=bool)
        self.input_storages = [tuple(self.storage[a] for a in ins) for ins in self.inputs]
        self.getitem_parent = np.full(len(nodes), -1, dtype=np.int64)
        for parent, children in self.getitems.items():
            self.getitem_parent[children] = parent

    def ids(self, nodes: Iterable[Node]) -> list[int]:
        return [self.ix[n] for n in nodes]

    def forward_schedule(self, saved: list[int]) -> list[int]:
        """Forward nodes the forward module runs: what its outputs (the same for every
        plan, walked once) and the saved values need."""
        base = self._forward_base
        extra = [n for n in saved if self.is_forward[n] and not base[n]]
        if not extra:
            return list(self._forward_base_order)
        seen = self._closure(extra, self.is_forward, seen=bytearray(base))
        return [i for i in self.forward if seen[i]]

    @cached_property
    def _forward_base(self) -> bytearray:
        roots = [n for n in self.fwd_outputs if self.is_forward[n]]
        return self._closure(roots, self.is_forward)

    @cached_property
    def _forward_base_order(self) -> list[int]:
        return [i for i in self.forward if self._forward_base[i]]

    def backward_schedule(self, saved: list[int], mirrored: list[int]) -> list[int]:
        """Backward-module nodes in execution order (``saved``: forward values and
        primals). The backward nodes and their order among themselves are the same for
        every plan (``_BackwardBase``); a plan adds the recomputed forward nodes they
        need, each placed with the first backward node that needs it."""
        base = self._backward_base
        size = len(self.nodes)
        available = bytearray(size)
        for i in (*saved, *self.tangents):
            available[i] = 1
        allowed = bytearray(size)
        for i in mirrored:
            if not available[i] and self.is_forward[i]:
                allowed[i] = 1
        seeds = [a for a in base.reads_outside if allowed[a]]
        seeds += [n for n in self.bwd_outputs if allowed[n]]
        recomputed = self._closure(seeds, allowed)
        there = np.frombuffer(recomputed, np.uint8) | np.frombuffer(available, np.uint8)
        missing = np.flatnonzero(there[base.read_values] == 0)
        if len(missing):
            raise self._unavailable(*base.reads[missing[0]])
        ids = np.flatnonzero(np.frombuffer(recomputed, np.uint8)).tolist()
        for n in ids:
            for a in self.inputs[n]:
                if not recomputed[a] and not available[a]:
                    raise self._unavailable(n, a)
        return base.order_with(self, ids, recomputed)

    @cached_property
    def fused_forward(self) -> _FusedForward:
        """The forward phase's inlined chains of the base schedule."""
        return _FusedForward(self)

    def fused_backward(self, candidates: np.ndarray) -> _FusedBackward:
        """The backward nodes' inlined chains (``candidates``: the backward nodes that
        may be inlined, the same for every plan), computed on the first call."""
        if self._fused_backward is None:
            self._fused_backward = _FusedBackward(self, candidates.tolist())
        return self._fused_backward

    def _unavailable(self, node: int, value: int) -> JointGraphError:
        return JointGraphError(
            f"backward node {self.nodes[node].name} reads {self.nodes[value].name}, "
            "which is neither saved nor recomputed"
        )

    @cached_property
    def _backward_base(self) -> _BackwardBase:
        return _BackwardBase(self)

    @cached_property
    def users(self) -> list[list[int]]:
        users: list[list[int]] = [[] for _ in self.nodes]
        for n, ins in enumerate(self.inputs):
            for a in dict.fromkeys(ins):
                users[a].append(n)
        return users

    def _closure(
        self, roots: list[int], allowed: bytearray, seen: bytearray | None = None
    ) -> bytearray:
        inputs = self.inputs
        seen = bytearray(len(self.nodes)) if seen is None else seen
        stack = [r for r in roots if allowed[r]]
        while stack:
            n = stack.pop()
            if seen[n]:
                continue
            seen[n] = 1
            stack.extend(a for a in inputs[n] if allowed[a] and not seen[a])
        return seen


class _BackwardBase:
    """The backward nodes every plan runs, and their order.

    The order mimics ``reordering_to_mimic_autograd_engine``: walk the nodes in graph
    order from the first that reads a tangent; before each, run its not-yet-run
    inputs, in graph order. Equivalently, each node runs with its *trigger*, the
    first node of that walk that needs it (itself if it is on the walk), and the
    schedule is sorted by (trigger, node): forward nodes never read backward ones,
    so the backward nodes' triggers do not depend on what a plan recomputes.
    """

    def __init__(self, ix: GraphIndex) -> None:
        size = len(ix.nodes)
        backward = bytearray(size)
        for i in ix.backward:
            backward[i] = 1
        needed = ix._closure([n for n in ix.bwd_outputs if backward[n]], backward)
        ids = [i for i in range(size) if needed[i]]
        tangents = set(ix.tangents)
        self.first = next((n for n in ids if tangents.intersection(ix.inputs[n])), None)
        # (backward node, what it reads outside the backward nodes) pairs
        self.reads = [(n, a) for n in ids for a in ix.inputs[n] if not needed[a]]
        self.read_values = np.asarray([a for _, a in self.reads], dtype=np.int64)
        self.reads_outside = list(dict.fromkeys(a for _, a in self.reads))
        self.needed = needed
        self.trigger = [_NO_TRIGGER] * size
        self._set_triggers(ix, reversed(ids), needed)
        self.keys = np.asarray(
            [self.trigger[n] * size + n for n in ids if self.trigger[n] != _NO_TRIGGER],
            dtype=np.int64,
        )

    def _set_triggers(self, ix: GraphIndex, descending: Iterable[int], needed) -> None:
        """Triggers of ``descending`` (nodes, latest first), from those of their
        readers in ``needed`` (already set: readers come later in graph order)."""
        first, trigger, users = self.first, self.trigger, ix.users
        own = first is not None
        for n in descending:
            t = n if own and n >= first else _NO_TRIGGER
            for u in users[n]:
                if needed[u] and trigger[u] < t:
                    t = trigger[u]
            trigger[n] = t

    def order_with(self, ix: GraphIndex, recomputed: list[int], is_recomputed) -> list[int]:
        """The schedule with the ``recomputed`` forward nodes placed at their triggers."""
        size = len(ix.nodes)
        if self.first is None:  # no tangent reader: graph order
            base = np.flatnonzero(np.frombuffer(self.needed, np.uint8)).tolist()
            return sorted([*base, *recomputed])
        needed = bytearray(self.needed)
        for n in recomputed:
            needed[n] = 1
        self._set_triggers(ix, reversed(recomputed), needed)
        extra = [self.trigger[n] * size + n for n in recomputed if self.trigger[n] != _NO_TRIGGER]
        for n in recomputed:
            self.trigger[n] = _NO_TRIGGER
        keys = np.sort(np.concatenate([self.keys, np.asarray(extra, dtype=np.int64)]))
        return (keys % size).tolist()


_NO_TRIGGER = 1 << 40


def _layout(node: Node, padding: tuple[bool, int, int]) -> tuple:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return ()
    return (val.dtype, padded_strides(val, padding))


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
    late_addmm: bool = False,
) -> Liveness:
    """Simulate one step with ``saved`` stashed and ``mirrored`` recomputed in backward.

    With ``live_at`` (a timeline position, e.g. a previous run's ``peak_index``), the
    result also lists the values alive at that event. With ``fusion``, pointwise
    values a fusing compiler keeps in registers are not allocated (Inductor).
    ``index`` (``GraphIndex(joint)``) saves rebuilding it when simulating many plans.
    ``late_addmm``: the backward as stock Inductor runs it, each ``add(mm(a, b), c)``
    fused into one ``addmm`` where the add is (our plans split those back:
    ``mirror/late_gemm.py``; min-cut's do not).
    """
    ix = index if index is not None else GraphIndex(joint)
    saved_ids = ix.ids(saved)
    fwd = ix.forward_schedule(saved_ids)
    bwd = ix.backward_schedule(saved_ids, ix.ids(mirrored))
    if late_addmm:
        bwd = _products_at_their_adds(ix, bwd)
    live_at = -1 if live_at is None else live_at
    alive = np.zeros(len(ix.nodes), dtype=bool)
    alive[ix.primals] = True
    forward = _Phase(ix, fwd, [*saved_ids, *ix.fwd_outputs, *ix.primals], alive, fusion, live_at)
    turn = forward.live_after
    alive = forward.alive_after
    # Saved values the backward does not read are dropped at the turn.
    read = np.zeros(len(ix.nodes), dtype=bool)
    read[_read_by(ix, np.asarray(bwd, dtype=np.int64))] = True
    read[ix.fwd_outputs] = True
    read[ix.primals] = True
    unread = np.asarray(saved_ids, dtype=np.int64)
    alive[unread[~read[unread]]] = False
    alive[ix.tangents] = True
    backward = _Phase(
        ix,
        bwd,
        [*ix.bwd_outputs, *ix.fwd_outputs, *ix.primals],
        alive,
        fusion,
        live_at - len(fwd),
        backward=True,
    )
    events = np.concatenate([forward.events, backward.events])
    if not len(events):
        return Liveness(peak=turn, peak_phase="forward", peak_node="", turn_bytes=turn)
    index_ = int(np.argmax(events))
    snapshot = forward if 0 <= live_at < len(fwd) else backward
    order = [*fwd, *bwd]
    return Liveness(
        peak=max(int(events[index_]), turn),
        peak_phase="forward" if index_ < len(fwd) else "backward",
        peak_node=ix.nodes[order[index_]].name,
        turn_bytes=turn,
        peak_index=index_,
        live_values=[ix.nodes[i] for i in snapshot.snapshot],
        live_storages={ix.nodes[s]: int(ix.np_nbytes[s]) for s in snapshot.snapshot_storages},
        forward_events=len(fwd),
        _order=order,
        _bytes=events,
        _nodes=ix.nodes,
    )


def _products_at_their_adds(ix: GraphIndex, schedule: list[int]) -> list[int]:
    """``schedule`` with each ``mm`` whose one reader is an ``add`` of a tensor of its
    dtype moved to just before that add: Inductor's post-grad ``addmm`` pattern (on a
    GPU not where every reader of the add is pointwise). Views that give the product
    back as it is (a transpose of a transpose) are seen through, as Inductor's
    joint-graph passes remove them."""
    aten = torch.ops.aten
    placed = set(schedule)
    before: dict[int, list[int]] = {}
    for n in schedule:
        node = ix.nodes[n]
        if node.target is not aten.mm.default:
            continue
        out, reader, chain = node.meta.get("val"), node, [n]
        while len(reader.users) == 1 and is_view(next(iter(reader.users))):
            reader = next(iter(reader.users))
            chain.append(ix.ix[reader])
        val = reader.meta.get("val")
        if len(reader.users) != 1 or not isinstance(val, torch.Tensor):
            continue
        if val.shape != out.shape or val.stride() != out.stride():
            continue
        (add,) = reader.users
        others = [a for a in add.args if a is not reader]
        if add.target is not aten.add.Tensor or ix.ix[add] not in placed or len(others) != 1:
            continue
        other = others[0].meta.get("val") if isinstance(others[0], Node) else None
        if not isinstance(other, torch.Tensor) or other.dtype != out.dtype:
            continue
        if out.device.type == "cuda" and all(is_pointwise(u) for u in add.users):
            continue
        before.setdefault(ix.ix[add], []).extend(c for c in chain if c in placed)
    if not before:
        return schedule
    moved = {m for ms in before.values() for m in ms}
    return [m for n in schedule if n not in moved for m in (*before.get(n, ()), n)]


def _read_by(ix: GraphIndex, schedule: np.ndarray) -> np.ndarray:
    """The inputs of the nodes of ``schedule``, one entry per (reader, input) pair."""
    return ix.in_idx[_edge_slots(ix, schedule)]


def _edge_slots(ix: GraphIndex, schedule: np.ndarray) -> np.ndarray:
    """Positions in ``ix.in_idx`` of the inputs of ``schedule``'s nodes, in order."""
    starts, counts = ix.in_ptr[schedule], ix.in_count[schedule]
    total = int(counts.sum())
    offsets = np.repeat(starts - np.cumsum(counts) + counts, counts)
    return offsets + np.arange(total, dtype=np.int64)


class _Phase:
    """One pass (forward or backward) over a schedule, as interval arithmetic.

    A value is alive from the event that allocates it (its producer's; a tuple op's
    outputs at the tuple op) to the event of its last reader, or for good if it is
    kept; a storage is alive while any value on it is, and adds its bytes unless the
    fusing compiler never allocates it. The bytes alive at each event are a prefix
    sum over the storages' intervals. Values ``alive`` before the phase start at -1.
    """

    def __init__(
        self,
        ix: GraphIndex,
        schedule: list[int],
        keep_ids: list[int],
        alive: np.ndarray,
        fusion: bool,
        snapshot_at: int,
        backward: bool = False,
    ) -> None:
        size, length = len(ix.nodes), len(schedule)
        sched = np.asarray(schedule, dtype=np.int64)
        pos = np.full(size, -1, dtype=np.int64)
        pos[sched] = np.arange(length)
        slots = _edge_slots(ix, sched)
        readers = np.repeat(np.arange(length), ix.in_count[sched])
        inputs = ix.in_idx[slots]
        last_use = np.full(size, -1, dtype=np.int64)
        np.maximum.at(last_use, inputs, readers)
        virtual = np.zeros(size, dtype=bool)
        if fusion:
            # Per phase: a value computed in registers in the forward pass may be
            # written to memory when it is recomputed for an extern backward kernel.
            virtual[_fused_away(ix, sched, readers, inputs, keep_ids, backward)] = True
            _extend_reads_of_inlined(ix, sched, readers, inputs, last_use, virtual)
        keep = np.zeros(size, dtype=bool)
        keep[keep_ids] = True
        start, end = self._intervals(ix, sched, pos, last_use, keep, alive)
        self.alive_after = end == _FOREVER
        self._storages(ix, start, end, virtual, length)
        in_place = self._in_place(ix, sched, keep) if fusion else {}
        self.events = self._bytes_at(length) + self._transients(ix, sched, pos)
        for at, node in in_place.items():
            self.events[at] -= ix.np_nbytes[node]
        self.snapshot: list[int] = []
        self.snapshot_storages: list[int] = []
        if 0 <= snapshot_at < length:
            self.snapshot = np.flatnonzero((start <= snapshot_at) & (end >= snapshot_at)).tolist()
            held = (self.s_start <= snapshot_at) & (self.s_end >= snapshot_at) & self.s_counted
            shared = in_place.get(snapshot_at)  # written into its input's storage
            self.snapshot_storages = sorted(set(self.s_id[held].tolist()) - {shared})

    def _in_place(self, ix, sched, keep) -> dict[int, int]:
        """Event -> the pointwise op there that Inductor writes into the storage of a
        value read for the last time there (directly or through values it computes in
        registers; same bytes; neither a primal, tangent or kept value, nor writing
        one): its output costs
        no new bytes at that event. The loss's log-softmax is written over the logits,
        and its gradient over the saved log-softmax (a saved value is donated to the
        backward): 1,000 MiB each on the suite's Transformer, where the estimate was
        12-14% above the measured peak (H100)."""
        length = len(sched)
        done = self.s_counted & (self.s_end >= 0) & (self.s_end < length)
        source, at = self.s_id[done], self.s_end[done]
        node = sched[at]
        owner = ix.np_owned  # storages a phase may not write over
        ok = ix.np_pointwise[node] & (ix.np_storage[node] == node) & ~owner[source]
        ok &= ~keep[source] & ~keep[node] & (source != node)
        # Inductor also writes into a buffer up to 5% larger (can_match_buffer_size) where
        # both index the same way: equal padded strides, the source laid out by this
        # phase (a saved value keeps the forward's unpadded strides).
        size, out = ix.np_nbytes[source], ix.np_nbytes[node]
        fits = (out <= size) & (20 * out >= 19 * size) & (self.s_start[done] >= 0)
        fits &= ix.np_layout[source] == ix.np_layout[node]
        ok &= (size == out) | fits
        counted = np.zeros(len(ix.nodes), dtype=bool)
        counted[self.s_id[self.s_counted & (self.s_start <= self.s_end)]] = True
        ok &= counted[node]
        return dict(zip(at[ok].tolist(), node[ok].tolist()))

    @staticmethod
    def _intervals(ix, sched, pos, last_use, keep, alive):
        """Per value: the event that allocates it and the one after which it is
        dropped (_NEVER / _FOREVER where neither happens in this phase)."""
        size = len(pos)
        start = np.full(size, _NEVER, dtype=np.int64)
        start[alive] = -1
        values = sched[~ix.np_tuple_valued[sched]]
        # A tuple op's outputs are allocated with it (those this phase runs).
        parent = ix.getitem_parent[values]
        at = np.where((parent >= 0) & (pos[np.maximum(parent, 0)] >= 0), pos[parent], pos[values])
        fresh = start[values] == _NEVER
        start[values[fresh]] = at[fresh]
        end = np.full(size, _FOREVER, dtype=np.int64)
        dies = (last_use >= 0) & ~keep
        end[dies] = last_use[dies]
        unread = values[(last_use[values] < 0) & ~keep[values]]
        end[unread] = pos[unread]
        end[start == _NEVER] = _NEVER
        return start, end

    def _storages(self, ix, start, end, virtual, length):
        """Merge the values' intervals per storage (a storage is alive while any
        value on it is)."""
        values = np.flatnonzero(start != _NEVER)
        storage = ix.np_storage[values]
        span = length + 3
        lo = storage * span + (start[values] + 1)
        hi = storage * span + np.minimum(end[values], length) + 1
        order = np.argsort(lo, kind="stable")
        lo, hi, storage = lo[order], hi[order], storage[order]
        reach = np.maximum.accumulate(hi)
        first = np.ones(len(lo), dtype=bool)
        first[1:] = lo[1:] > reach[:-1]
        group = np.cumsum(first) - 1
        merged_hi = np.zeros(int(first.sum()), dtype=np.int64)
        np.maximum.at(merged_hi, group, hi)
        self.s_id = storage[first]
        base = self.s_id * span
        self.s_start = lo[first] - base - 1
        self.s_end = merged_hi - base - 1
        self.s_end[self.s_end >= length] = _FOREVER
        self.s_counted = ~virtual[self.s_id]
        self.s_bytes = np.where(self.s_counted, ix.np_nbytes[self.s_id], 0)
        self.live_after = int(self.s_bytes[self.s_end == _FOREVER].sum())

    def _bytes_at(self, length: int) -> np.ndarray:
        diff = np.zeros(length + 1, dtype=np.int64)
        np.add.at(diff, np.maximum(self.s_start, 0), self.s_bytes)
        ends = self.s_end < length
        np.add.at(diff, self.s_end[ends] + 1, -self.s_bytes[ends])
        return np.cumsum(diff)[:length]

    @staticmethod
    def _transients(ix, sched, pos):
        """Bytes an op holds beyond its values: a tuple op's outputs that nobody in
        this phase reads (not scheduled), and declared temporaries."""
        extra = ix.np_temporary[sched].copy()
        tuples = ix.np_tuple_valued[sched]
        if tuples.any():
            unread = ix.np_nbytes[sched].copy()
            children = np.flatnonzero((ix.getitem_parent >= 0) & (pos >= 0))
            parents = ix.getitem_parent[children]
            ran = pos[parents] >= 0
            np.add.at(unread, pos[parents[ran]], -ix.np_nbytes[children[ran]])
            extra += np.where(tuples, np.maximum(unread, 0), 0)
        return extra


_NEVER = np.iinfo(np.int64).min // 4  # not alive in this phase
_FOREVER = np.iinfo(np.int64).max // 4  # alive to the end of the phase


def _extend_reads_of_inlined(
    ix: GraphIndex,
    sched: np.ndarray,
    readers: np.ndarray,
    inputs: np.ndarray,
    last_use: np.ndarray,
    virtual: np.ndarray,
) -> None:
    """An inlined value is computed inside the kernels of its readers: the values it
    reads are read there too, so they live until its last reader has run (through
    chains of inlined values: repeated until nothing moves)."""
    inlined = virtual[ix.np_storage[sched]]
    edges = inlined[readers]
    if not edges.any():
        return
    src_pos, src, dst = readers[edges], sched[readers[edges]], inputs[edges]
    while True:
        end = np.where(last_use[src] >= 0, last_use[src], src_pos)
        before = last_use[dst]
        np.maximum.at(last_use, dst, end)
        if np.array_equal(before, last_use[dst]):
            return


def _fused_away(
    ix: GraphIndex,
    sched: np.ndarray,
    readers: np.ndarray,
    inputs: np.ndarray,
    keep_ids: list[int],
    backward: bool = False,
) -> list[int]:
    """Pointwise values a fusing compiler (Inductor) computes inside their readers'
    kernels and never writes to memory (``fusion.inlined``): not kept past the phase,
    read by at most a few pointwise ops or reductions (through views), never by an
    extern kernel. A chain whose code would read more than ``REALIZE_ACC_READS``
    buffers is written out there (Inductor's realize_acc_reads_threshold), which ends
    the lifetimes of the buffers it read (a gradient summed over many steps).
    ``readers``/``inputs``: the schedule's (position, input) pairs; ``backward``: the
    schedule is a backward schedule (its backward nodes' chains are cached)."""
    candidates = _candidates(ix, sched, readers, inputs, keep_ids)
    if not backward:
        return ix.fused_forward.inlined(ix, sched, candidates)
    # Recomputed forward values read forward values only: their chains come first.
    recomputed = ix.np_is_forward[candidates]
    reads = _inline_chains(ix, candidates[recomputed].tolist(), {})
    return ix.fused_backward(candidates[~recomputed]).inlined_with(ix, reads)


def _candidates(
    ix: GraphIndex, sched: np.ndarray, readers: np.ndarray, inputs: np.ndarray, keep_ids
) -> np.ndarray:
    """The pointwise nodes of ``sched`` that may be inlined (``_fused_away``): not kept,
    read directly by at most ``INLINE_READERS`` ops of the phase, all fusible."""
    size = len(ix.nodes)
    reader_nodes = sched[readers]
    direct_reads = ~ix.np_view[reader_nodes]  # views read nothing
    read = ix.np_storage[inputs[direct_reads]]
    direct = np.bincount(read, minlength=size)
    unfusible = np.zeros(size, dtype=bool)
    unfusible[read[~ix.np_fusible[reader_nodes[direct_reads]]]] = True
    kept = np.zeros(size, dtype=bool)
    kept[ix.np_storage[np.asarray(keep_ids, dtype=np.int64)]] = True
    candidate = (
        ix.np_pointwise[sched]
        & ~kept[sched]
        & (direct[sched] <= INLINE_READERS)
        & ~unfusible[sched]
    )
    return sched[candidate]


def _inline_chains(
    ix: GraphIndex, candidates: list[int], reads: dict[int, set[int]]
) -> dict[int, set[int]]:
    """Add to ``reads`` (inlined value -> the buffers its code reads) the
    ``candidates`` (in schedule order) whose code reads at most REALIZE_ACC_READS."""
    nbytes, input_storages = ix.nbytes, ix.input_storages
    for n in candidates:
        buffers: set[int] = set()
        for s in input_storages[n]:
            inlined = reads.get(s)
            if inlined is not None:
                buffers |= inlined
            elif nbytes[s]:
                buffers.add(s)
        if len(buffers) <= REALIZE_ACC_READS:
            reads[n] = buffers
    return reads


class _FusedForward:
    """The forward phase's inlined chains for the schedule every plan runs (what the
    forward outputs need), worked out once per graph.

    A plan's forward schedule adds nodes only its saved values need (nothing in the
    base reads them: the base is closed under inputs) and keeps more values, so some
    base nodes stop being candidates: only the chains reading those are redone, then
    the added nodes' chains (after the base's, as nothing in the base reads them).
    """

    def __init__(self, ix: GraphIndex) -> None:
        base = np.asarray(ix._forward_base_order, dtype=np.int64)
        slots = _edge_slots(ix, base)
        readers = np.repeat(np.arange(len(base)), ix.in_count[base])
        keep = [*ix.fwd_outputs, *ix.primals]
        inputs = ix.in_idx[slots]
        self.in_base = np.zeros(len(ix.nodes), dtype=bool)
        self.in_base[base] = True
        self.size = len(base)
        mask = np.zeros(len(ix.nodes), dtype=bool)
        mask[_candidates(ix, base, readers, inputs, keep)] = True
        self.candidate = mask
        candidates = np.flatnonzero(mask)  # node ids are in graph order
        self.position = {n: i for i, n in enumerate(candidates.tolist())}
        self.reads = _inline_chains(ix, candidates.tolist(), {})
        self.readers: dict[int, list[int]] = {}  # storage -> candidates reading it
        for n in candidates.tolist():
            for s in dict.fromkeys(ix.input_storages[n]):
                self.readers.setdefault(s, []).append(n)

    def inlined(self, ix: GraphIndex, sched: np.ndarray, candidates: np.ndarray) -> list[int]:
        """The inlined values of a forward phase over ``sched`` with ``candidates``."""
        in_base = self.in_base[sched]
        if int(in_base.sum()) != self.size:  # not a forward schedule of this graph
            return list(_inline_chains(ix, candidates.tolist(), {}))
        now = np.zeros(len(ix.nodes), dtype=bool)
        now[candidates] = True
        changed = np.flatnonzero(self.in_base & (now != self.candidate)).tolist()
        dirty = set(changed)
        stack = [m for s in changed for m in self.readers.get(s, ())]
        while stack:
            n = stack.pop()
            if n not in dirty:
                dirty.add(n)
                stack.extend(self.readers.get(n, ()))
        reads = {n: r for n, r in self.reads.items() if n not in dirty}
        redo = sorted(n for n in dirty if now[n])
        added = candidates[~self.in_base[candidates]].tolist()
        _inline_chains(ix, [*redo, *added], reads)
        return list(reads)


class _FusedBackward:
    """The backward nodes' inlined chains, worked out once per graph.

    Which backward nodes are candidates does not depend on the plan (their readers
    are backward nodes, the kept values are the same), and neither do their read sets
    unless a chain reaches a recomputed forward value that is itself inlined: only
    those chains are redone per plan.
    """

    def __init__(self, ix: GraphIndex, candidates: list[int]) -> None:
        self.position = {n: i for i, n in enumerate(candidates)}
        self.reads = _inline_chains(ix, candidates, {})  # forward values as plain buffers
        self.readers: dict[int, list[int]] = {}  # storage -> candidates reading it
        for n in candidates:
            for s in dict.fromkeys(ix.input_storages[n]):
                self.readers.setdefault(s, []).append(n)

    def inlined_with(self, ix: GraphIndex, forward: dict[int, set[int]]) -> list[int]:
        """Every inlined value of the phase, given the recomputed ones (``forward``)."""
        dirty: set[int] = set()
        stack = [m for s in forward for m in self.readers.get(s, ())]
        while stack:
            n = stack.pop()
            if n not in dirty:
                dirty.add(n)
                stack.extend(self.readers.get(n, ()))
        if not dirty:
            return [*self.reads, *forward]
        reads = {**forward, **{n: r for n, r in self.reads.items() if n not in dirty}}
        _inline_chains(ix, sorted(dirty, key=self.position.__getitem__), reads)
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
