"""Candidate plans and the moves every mode makes on them.

A candidate is a set of mirrored units (forward ops recomputed in the backward) and
what it means: the partition (``partition_for``: saved values, recomputed nodes), its
simulated peak, stash and added time. ``Planner`` evaluates candidates (cutting
recompute chains Inductor would write out, each set simulated once) and holds the
moves the modes share: the lifetime repair, the adding search, making a plan the same
in every copy of a repeated block. The modes: balance.py, budget_search.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from torch.fx import Node

from mirrorgrad.graph import liveness
from mirrorgrad.graph.cost import DeviceRates, StepCost
from mirrorgrad.graph.fusion import REALIZE_ACC_READS
from mirrorgrad.graph.joint import JointGraph, JointGraphError, is_getitem, is_sym, is_view
from mirrorgrad.graph.repeats import repeated_classes
from mirrorgrad.mirror.plan import PlanError
from mirrorgrad.mirror.policy import DEFAULT_CLASSES, op_name
from mirrorgrad.mirror.storage_balance import UnitGraph, storage_balance

# The lifetime repair stashes at most this many recomputed values, trying at most
# REPAIR_CANDIDATES of them per step (each try is one liveness simulation).
MAX_REPAIR_TRIALS = 256
REPAIR_CANDIDATES = 4
# Liveness simulations the budget search may spend, and the most units it mirrors
# in one step (larger steps are faster, smaller ones give budgets finer choices).
MAX_BUDGET_TRIALS = 512
MAX_CHUNK = 16
# On large graphs a chunk may hold up to this share of the units, so the number of
# simulations (each linear in the graph) stays about constant: planning time stays
# about linear in the graph's size.
CHUNK_SHARE = 1 / 32
# The adding search stops after this many simulations without a lower peak: its
# tail adds units that cost time and free nothing at the peak (on the ResNet-152
# layout the last ~60 of ~140 simulations found no lower peak).
STALL_TRIALS = 32
# Where one accepted chunk of the adding search lowers the peak by more than this
# share of the unmirrored peak, its halves, quarters, ... (in rank order) are
# candidates too: the doubling chunks leave gaps in the frontier (on the suite's
# Transformer one chunk of 16 went from 3,776 MiB at +18.7% to 2,884 at +24.3%, so a
# budget between paid the lower plan's time). At 0.02 the ResNet-152 layout's budget
# 0.5 went from +4.7% to +3.5% for 56 more simulations (+0.75 s, past the 3 s
# planning target); at 0.1, 11 more, the transformer's gap still filled.
REFINE_DROP = 0.1
# The most stored values one chain of recomputed elementwise ops may read (extern
# kernels and reductions end a chain): Inductor's realize_acc_reads_threshold, past
# which it writes the chain out (fusion.REALIZE_ACC_READS). Where a chain would read
# more, its recomputed input reading the most is stashed. On the suite's Transformer,
# balance recomputed the residual stream through all 12 blocks: block k's backward
# kernels re-read the saved values of every block before it, each block's kernels were
# different code (cold compile 99 s against torch.compile's 25 s on an H100) and the
# step took +10% for +4.7% estimated. Min-cut bans long chains too
# (``ban_recompute_long_fusible_chains``). Counting ops instead cut GPT-2's tanh GELU
# (9 ops, 1 read) and left its budgets at 0.61x where 0.35x was reached.
MAX_CHAIN_READS = REALIZE_ACC_READS
# A plan that differs between copies of a repeated block gives Inductor a kernel per
# variant to compile (cold compile 1.35-1.47x torch.compile's on the suite's
# Transformer and resnet50, where min-cut's identical blocks reuse 8 backward
# kernels at any depth). The chosen plan is made the same in every copy where that
# keeps its promise (``Planner.uniform``): a budget at no more time (a search by whole
# classes of repeated ops found no plan at the transformer's budget peaks as fast as
# the per-unit one); balance's cap (balance.UNIFORM_PEAK_SLACK).
# Up to this many classes decided both ways, every way of deciding them is tried
# (2**N simulations); beyond, three.
UNIFORM_EXHAUSTIVE = 4
# Rounds of stashing classes that a plan still recomputes in some copies only.
UNIFORM_SETTLE_ROUNDS = 4

# Ops whose output Inductor writes to memory (reductions, normalizations), ending a
# chain of fused elementwise ops.
_CHAIN_ENDS = frozenset(
    DEFAULT_CLASSES.reduction | DEFAULT_CLASSES.normalization | DEFAULT_CLASSES.softmax
)


@dataclass(kw_only=True, slots=True)
class Partition:
    """What a set of mirrored units means for the partition."""

    saved: list[Node]
    saved_sym: list[Node]
    mirrored: list[Node]


def partition_for(joint: JointGraph, graph: UnitGraph, mirror_units: set[Node]) -> Partition:
    """Saved values and recomputed nodes when ``mirror_units`` are recomputed in backward.

    Walks back from what the backward nodes read: a value of a mirrored unit is
    recomputed (and what it reads is needed in turn); any other forward value, and
    every primal, is saved. Forward outputs are always saved: they are alive anyway.
    Values the backward reads of units not mirrored are saved whatever the plan
    (``_PartitionFacts.read_saved``): the walk starts at the mirrored units' only.
    """
    facts = _partition_facts(joint, graph)
    kind, reads = facts.kind, facts.reads

    def kept(v: Node) -> bool:
        k = kind[v]
        return k is _ALIVE or k not in mirror_units

    for v in facts.read_tuples:
        if kept(v):
            raise PlanError(f"cannot save the tuple-valued node {v.name}")
    stack = [v for u in mirror_units for v in facts.read_of_unit.get(u, ())]
    saved = set(facts.read_saved)
    saved.difference_update(stack)
    saved_sym = set(facts.read_sym)
    mirrored: set[Node] = set()
    while stack:
        v = stack.pop()
        if v in mirrored:
            continue
        mirrored.add(v)
        for a in reads[v]:
            if a in mirrored:
                continue
            if kind[a] is _SYM:
                saved_sym.add(a)
            elif kept(a):
                if facts.tuple_valued[a]:
                    raise PlanError(f"cannot save the tuple-valued node {a.name}")
                saved.add(a)
            else:
                stack.append(a)
    return Partition(
        saved=joint.sorted(saved),
        saved_sym=joint.sorted(saved_sym),
        mirrored=joint.sorted(mirrored),
    )


_SYM, _ALIVE = object(), object()


@dataclass(kw_only=True, slots=True)
class _PartitionFacts:
    """What ``partition_for`` asks of every forward value, computed once per graph."""

    kind: dict[Node, object]  # _SYM, _ALIVE (primal, forward output) or its unit
    tuple_valued: dict[Node, bool]
    reads: dict[Node, list[Node]]  # what recomputing the value reads
    # The forward values the backward nodes read: by unit (recomputed when it is
    # mirrored), the tensors among them (saved when it is not) and the symbols.
    read_of_unit: dict[Node, list[Node]]
    read_saved: frozenset[Node]
    read_sym: frozenset[Node]
    read_tuples: list[Node]  # tuple-valued: a plan must recompute them


def _partition_facts(joint: JointGraph, graph: UnitGraph) -> _PartitionFacts:
    facts = graph.__dict__.get("_partition_facts")
    if facts is not None:
        return facts
    values = [n for n in joint.gm.graph.nodes if _is_fwd_value(joint, n)]
    kind: dict[Node, object] = {}
    for v in values:
        unit = graph.producer(graph.root(v))
        if is_sym(v):
            kind[v] = _SYM
        elif v.op == "placeholder" or v in graph.fwd_outputs:
            kind[v] = _ALIVE
        else:
            kind[v] = unit
    reads = {
        v: [v.args[0], *v.all_input_nodes] if is_getitem(v) else list(v.all_input_nodes)
        for v in values
    }
    tuple_valued = {v: isinstance(v.meta.get("val"), (tuple, list)) for v in values}
    backward_reads = dict.fromkeys(
        a for n in joint.backward for a in n.all_input_nodes if _is_fwd_value(joint, a)
    )
    read_of_unit: dict[Node, list[Node]] = {}
    for v in backward_reads:
        if kind[v] is not _SYM and kind[v] is not _ALIVE:
            read_of_unit.setdefault(kind[v], []).append(v)
    tensors = [v for v in backward_reads if kind[v] is not _SYM]
    facts = _PartitionFacts(
        kind=kind,
        tuple_valued=tuple_valued,
        reads=reads,
        read_of_unit=read_of_unit,
        read_saved=frozenset(tensors),
        read_sym=frozenset(v for v in backward_reads if kind[v] is _SYM),
        read_tuples=[v for v in tensors if tuple_valued[v]],
    )
    graph.__dict__["_partition_facts"] = facts
    return facts


def _is_fwd_value(joint: JointGraph, node: Node) -> bool:
    return (node.op == "placeholder" and node not in joint.tangents) or node in joint.forward_set


def stash_sizes(joint: JointGraph, graph: UnitGraph, saved: list[Node]) -> dict[Node, int]:
    """Bytes each saved value adds to the step, counting a shared storage once.

    Values alive anyway (primals, forward outputs, their views) add nothing; a saved
    view of an intermediate keeps its whole base alive.
    """
    sizes: dict[Node, int] = {}
    seen: set[Node] = set()
    for v in saved:
        root = graph.root(v)
        sizes[v] = 0 if graph.is_free(v) or root in seen else joint.nbytes(root)
        seen.add(root)
    return sizes


@dataclass(kw_only=True, slots=True)
class Candidate:
    """A set of mirrored units (after chain cuts) and its simulated result."""

    units: frozenset[Node]
    partition: Partition
    peak: int
    peak_index: int
    stash: int
    added_flops: int
    added_time_s: float


class Planner:
    """One graph's planning state: its index, costs and every candidate evaluated."""

    def __init__(
        self, joint: JointGraph, graph: UnitGraph, rates: DeviceRates, *, fusion: bool
    ) -> None:
        self.joint, self.graph, self.rates, self.fusion = joint, graph, rates, fusion
        costs = StepCost(joint, rates, fusion=fusion)
        self.index = liveness.GraphIndex(joint)
        self.step_time_s = costs.step_seconds
        self.inlined = costs.inlined  # values computed in their readers' kernels
        self.recompute = {n: costs.recomputed(n) for n in joint.forward}
        self._evaluated: dict[frozenset[Node], Candidate] = {}
        self._chain_cache: dict[Node, tuple[str, list, int, frozenset]] = {}

    def evaluated(self) -> list[Candidate]:
        """Every candidate simulated so far, once each."""
        return list({id(c): c for c in self._evaluated.values()}.values())

    def added_time_s(self, partition: Partition) -> float:
        return sum(self.recompute[n].seconds for n in partition.mirrored)

    def evaluate(self, units: set[Node]) -> Candidate:
        """The plan that mirrors ``units`` once its long recompute chains are cut
        (``MAX_CHAIN_READS``: its ``units`` may be fewer), simulated once per set."""
        key = frozenset(units)
        known = self._evaluated.get(key)
        if known is None:
            partition = partition_for(self.joint, self.graph, set(key))
            cut = self._cut_long_chains(key, partition.mirrored)
            known = self._evaluated.get(cut)
            if known is None:
                known = self._evaluate(cut, partition if cut == key else None)
                self._evaluated[cut] = known
            self._evaluated[key] = known
        return known

    @cached_property
    def _classes(self) -> list[frozenset[Node]]:
        """Units that are the same op in copies of a repeated block."""
        return [frozenset(c) for c in repeated_classes(self.joint, self.graph.units)]

    @cached_property
    def _class_of(self) -> dict[Node, frozenset[Node]]:
        return {u: c for c in self._classes for u in c}

    def uniform(self, chosen: Candidate, keeps_promise) -> Candidate:
        """``chosen`` with the same decisions in every copy of each repeated block,
        where one such plan ``keeps_promise`` (the least time of those that do), else
        ``chosen``. Each class decided both ways is all stashed or all mirrored: every
        combination for a few classes, else all stashed, all mirrored, each as most
        of its copies are, and then one class flipped at a time from the best of
        those."""
        units = set(chosen.units)
        mixed = self._mixed(chosen)
        if not mixed:
            return chosen
        g = self.graph
        allowed = [frozenset(u for u in c if g.mirrorable[u] or u in g.last_resort) for c in mixed]
        down = frozenset(units.difference(*mixed))

        def trial(up: tuple[bool, ...]) -> Candidate:
            return self._settled(down.union(*(a for a, u in zip(allowed, up) if u)))

        def score(c: Candidate) -> tuple:
            kept = keeps_promise(c) and self._is_uniform(c)
            return (not kept, c.added_time_s if kept else c.peak, c.peak)

        k = len(mixed)
        if k <= UNIFORM_EXHAUSTIVE:
            ways = [tuple(bool(bits >> i & 1) for i in range(k)) for bits in range(2**k)]
        else:
            most = tuple(2 * len(units & c) >= len(c) for c in mixed)
            ways = [(False,) * k, most, (True,) * k]
        best_way = min(ways, key=lambda w: score(trial(w)))
        if k > UNIFORM_EXHAUSTIVE:
            for i in range(k):
                flipped = (*best_way[:i], not best_way[i], *best_way[i + 1 :])
                if score(trial(flipped)) < score(trial(best_way)):
                    best_way = flipped
        best = trial(best_way)
        return best if not score(best)[0] else chosen

    def _settled(self, units: frozenset[Node]) -> Candidate:
        """The plan of ``units``, and then the classes still recomputed in some copies
        only (the backward reaches a unit through readers decided elsewhere) stashed in
        all, until none is left."""
        for _ in range(UNIFORM_SETTLE_ROUNDS):
            candidate = self.evaluate(units)
            mixed = self._mixed(candidate)
            if not mixed:
                break
            units = frozenset(candidate.units.difference(*mixed))
        return candidate

    def _mixed(self, candidate: Candidate) -> list[frozenset[Node]]:
        """Classes recomputed in some copies and not in others (a unit asked for is
        recomputed only where the backward reaches it: ``partition_for``)."""
        recomputed = set(candidate.partition.mirrored)
        return [c for c in self._classes if 0 < len(recomputed & c) < len(c)]

    def _is_uniform(self, candidate: Candidate) -> bool:
        return not self._mixed(candidate)

    def _cut_long_chains(self, units: frozenset[Node], recomputed: list[Node]) -> frozenset[Node]:
        """``units`` less those whose stashing keeps every chain of recomputed
        elementwise ops computed in registers (``StepCost.inlined``: a value an extern
        kernel reads is written out and ends the chain, as a ResNet block's output
        does) within ``MAX_CHAIN_READS`` stored values of at least a quarter of the
        reading op's output (per-channel statistics and weights do not count): walking
        the recomputed nodes in order, where a chain would read more, its recomputed
        input reading the most is stashed, in every copy of its repeated block
        (``repeated_classes``): a chain through the residual stream of a Transformer
        is then cut at the same place in every block, not every few blocks wherever
        the reads ran out (one kernel variant per cut position). Stashing only
        shortens chains: one walk suffices."""
        stashed: set[Node] = set()
        # Value -> what its chain reads; set in graph order, so a recomputed input's
        # entry is there before its readers' (only recomputed values have one).
        reads: dict[Node, frozenset[Node]] = {}
        empty: frozenset[Node] = frozenset()
        known = self._chain_cache

        def chained(a: Node, unit: Node) -> bool:  # computed in a chain's kernel
            return bool(reads.get(a)) and unit not in stashed

        for n in recomputed:
            role, inputs, floor, own = known.get(n) or self._chain_facts(n)
            if role == "end":
                reads[n] = empty
                continue
            links = [(a, unit) for a, unit, _, _ in inputs if chained(a, unit)]
            if not links:  # reads only stored values: an op inlined starts a chain
                reads[n] = own if role == "inlined" else empty
                continue
            while True:
                read: set[Node] = set()
                for a, unit, root, size in inputs:
                    if chained(a, unit):
                        read |= reads[a]
                    elif size >= floor:
                        read.add(root)
                links = [(a, unit) for a, unit in links if unit not in stashed]
                if len(read) <= MAX_CHAIN_READS or not links:
                    break
                unit = max(links, key=lambda link: len(reads[link[0]]))[1]
                stashed |= self._class_of.get(unit, {unit})
            # an op not inlined is written to memory: its readers read it alone
            reads[n] = frozenset(read) if role != "written" else empty
        return units - stashed if stashed else units

    def _chain_facts(
        self, n: Node
    ) -> tuple[str, list[tuple[Node, Node, Node, int]], int, frozenset]:
        """Per node, once: its role in a chain ("end": an extern kernel or a reduction;
        "view": a view or getitem, part of its input's chain; "inlined"; "written"), its
        inputs as (value, unit, root, root bytes), the smallest read that counts, and
        what it reads where no input is computed in its kernel."""
        facts = self._chain_cache.get(n)
        if facts is None:
            g = self.graph
            inputs = [
                (a, g.producer(g.root(a)), g.root(a), self.joint.nbytes(g.root(a)))
                for a in n.all_input_nodes
            ]
            if is_view(n) or is_getitem(n):
                role, floor = "view", 0
            else:
                ends = n in g.last_resort or not g.mirrorable.get(n, True)
                ends = ends or op_name(n).split("::")[-1] in _CHAIN_ENDS
                role = "end" if ends else "inlined" if n in self.inlined else "written"
                floor = self.joint.nbytes(n) // 4
            own = frozenset(root for _, _, root, size in inputs if size >= floor)
            facts = self._chain_cache[n] = (role, inputs, floor, own)
        return facts

    def _evaluate(self, units: frozenset[Node], partition: Partition | None) -> Candidate:
        if partition is None:
            partition = partition_for(self.joint, self.graph, set(units))
        available = partition.saved + partition.saved_sym
        try:
            sim = liveness.simulate(
                self.joint, available, partition.mirrored, fusion=self.fusion, index=self.index
            )
        except JointGraphError as e:
            raise PlanError(f"inconsistent partition: {e}") from e
        return Candidate(
            units=units,
            partition=partition,
            peak=sim.peak,
            peak_index=sim.peak_index,
            stash=sum(stash_sizes(self.joint, self.graph, partition.saved).values()),
            added_flops=sum(self.recompute[n].flops for n in partition.mirrored),
            added_time_s=self.added_time_s(partition),
        )

    @cached_property
    def repaired_storage_balance(self) -> Candidate:
        """The storage-balance plan after the lifetime repair (budget mode's default
        plan, its trims and balance mode all start from it)."""
        return self.shorten_recompute_lifetimes(self.evaluate(storage_balance(self.graph)))

    def shorten_recompute_lifetimes(self, current: Candidate) -> Candidate:
        """Stash instead of mirror where that lowers the simulated peak.

        Storage balance judges each subgraph by its stash alone. A recomputed value
        the backward needs early and late (a residual stream: each block's output
        feeds the next block and, through the skip connection, every block after
        it) is alive across the backward like a stash, and recomputing it drags its
        whole producer chain along. So: while the peak is in the backward, stash
        the largest recomputed value alive at the peak (latest first on ties), if
        that lowers the peak.
        """
        for _ in range(MAX_REPAIR_TRIALS):
            p = current.partition
            sim = liveness.simulate(
                self.joint,
                p.saved + p.saved_sym,
                p.mirrored,
                live_at=current.peak_index,
                fusion=self.fusion,
                index=self.index,
            )
            if sim.peak_phase != "backward":
                break
            recomputed = set(p.mirrored)
            held: dict[Node, int] = {}
            for v in {self.graph.root(v) for v in sim.live_values if v in recomputed}:
                unit = self.graph.producer(v)
                if unit in current.units:
                    held[unit] = held.get(unit, 0) + self.joint.nbytes(v)
            candidates = sorted(held, key=lambda u: (-held[u], -self.joint.order[u]))
            for unit in candidates[:REPAIR_CANDIDATES]:
                trial = self.evaluate(set(current.units) - {unit})
                if trial.peak < current.peak:
                    current = trial
                    break
            else:
                break
        return current

    def costliest_first(self, units: set[Node], recomputed: set[Node]) -> list[Node]:
        """Mirrored units by time their un-mirroring saves per stash byte it adds.

        Stashing a unit's outputs also ends the recomputation of the mirrored
        producers only it reads (a ReLU's BatchNorm): their time counts too.
        """

        mirrored = units & recomputed

        def score(u: Node) -> float:
            if u not in recomputed:
                return -1.0  # nothing recomputes it: dropping it saves no time
            stash = sum(self.graph.cost(v) for v in self.graph.outputs(u))
            return self._exclusive_seconds(u, mirrored) / max(stash, 1)

        scores = {u: score(u) for u in units}
        return sorted(units, key=lambda u: (-scores[u], self.joint.order[u]))

    def _exclusive_seconds(self, unit: Node, recomputed: set[Node]) -> float:
        """Recompute time of ``unit`` and of the recomputed producers only it needs."""
        g = self.graph
        chain, stack, seconds = {unit}, [unit], 0.0
        while stack:
            u = stack.pop()
            seconds += self.recompute[u].seconds
            for p in g.input_units(u):
                if p in chain or p not in recomputed:
                    continue
                outputs = [v for v in g.outputs(p) if not g.is_free(v)]
                readers = {r for v in outputs for r in g.readers(g.root(v))}
                if readers <= chain:
                    chain.add(p)
                    stack.append(p)
        return seconds

    def adding_path(
        self,
        before: Candidate,
        *,
        last_resort: bool,
        cap_s: float = float("inf"),
        stop_peak: int = -1,
    ) -> list[Candidate]:
        """The states of the adding search (``meet_budget``), the last one also
        after the lifetime repair. ``last_resort``: matmuls and convolutions too, and
        the prefixes of chunks that lower the peak by more than ``REFINE_DROP``.
        Added time only grows along the path: it stops once past ``cap_s``, or once
        the peak is at most ``stop_peak`` (the later states cost more)."""
        path, between = [before], []
        current, rejected, k = before, set(), 1
        max_chunk = max(MAX_CHUNK, int(len(self.graph.units) * CHUNK_SHARE))
        stalled = 0  # simulations since the peak last fell
        ranked: list[Node] | None = None  # for ``current``; a rejection only shortens it
        for _ in range(MAX_BUDGET_TRIALS):
            if current.added_time_s > cap_s or stalled >= STALL_TRIALS:
                break
            if current.peak <= stop_peak:
                break
            if ranked is None:
                ranked = self._ranked_additions(current, rejected, last_resort=last_resort)
            if not ranked:
                break
            chunk = ranked[:k]
            trial = self.evaluate(set(current.units) | set(chunk))
            rejected |= set(chunk) - trial.units  # stashed to cut a long chain
            stalled = 0 if trial.peak < current.peak else stalled + 1
            if trial.peak <= current.peak:
                if last_resort and current.peak - trial.peak > REFINE_DROP * before.peak:
                    between += self._prefixes(current, chunk)
                current, k, ranked = trial, min(2 * k, max_chunk), None
                path.append(current)
            elif k > 1:
                k //= 2
            else:
                rejected.add(chunk[0])
                ranked = ranked[1:]
        return [*path, *between, self.shorten_recompute_lifetimes(current)]

    def _prefixes(self, current: Candidate, chunk: list[Node]) -> list[Candidate]:
        """``current`` with the first half, quarter, ... of ``chunk`` added."""
        found, k = [], len(chunk) // 2
        while k >= 1:
            found.append(self.evaluate(set(current.units) | set(chunk[:k])))
            k //= 2
        return found

    def _ranked_additions(
        self, current: Candidate, rejected: set[Node], *, last_resort: bool
    ) -> list[Node]:
        """Mirrorable stashed units, best bytes freed per added second first.

        Matmuls and convolutions (``UnitGraph.last_resort``) compete on the same
        score: their FLOPs make them slow to recompute, so they usually rank after
        the cheap ops.
        """
        g = self.graph
        # A view saved for backward keeps its base's storage: count it as its base.
        saved = {g.root(v) for v in current.partition.saved}
        scored = []
        for u in g.units:
            if u in current.units or u in rejected:
                continue
            if not g.mirrorable[u] and not (last_resort and u in g.last_resort):
                continue
            outs = [v for v in g.outputs(u) if v in saved]
            if not outs:
                continue
            freed = sum(g.cost(v) for v in outs)
            newly = sum(g.cost(v) for v in g.inputs(u) if v not in saved)
            seconds = self.recompute[u].seconds or 1e-12
            scored.append(((freed - newly) / seconds, -self.joint.order[u], u))
        scored.sort(key=lambda t: (t[0], t[1]), reverse=True)
        return [u for *_, u in scored]
