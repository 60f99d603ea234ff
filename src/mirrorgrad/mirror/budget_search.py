"""Peak-aware planning, the budget search and the modes around it: what to stash and
what to mirror, judged by the step's peak.

- ``off``: no mirroring; every forward value the backward reads is stashed.
- ``balance``: the storage-balance decision (storage_balance.py); then the lifetime repair
  (stash recomputed values that sit alive at the simulated backward peak, while
  that lowers it); then the cap: while the added time exceeds ``max_overhead`` of
  the step, un-mirror the op saving most time per stash byte added. A plan whose
  peak is not below the unmirrored peak is dropped for no mirroring: time spent
  for nothing.
- ``budget``: the least added time that meets a peak budget, chosen from a set of
  candidates that does not depend on the budget (mirroring more ops one chunk at a
  time, from no mirroring and from the storage-balance plan; trims of that plan), so
  a lower budget never gives a higher peak. Within no budget: the lowest peak. A
  fraction is on PyTorch's ``activation_memory_budget`` scale (``BudgetScale``).

Every plan is checked before it is returned: no random op recomputed, every
backward read either saved or recomputed from saved values.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from functools import cached_property

from torch.fx import Node

from mirrorgrad._units import format_bytes as _fmt
from mirrorgrad.graph import liveness
from mirrorgrad.graph.cost import DeviceRates, StepCost, rates_for
from mirrorgrad.graph.fusion import REALIZE_ACC_READS
from mirrorgrad.graph.joint import JointGraph, JointGraphError, is_getitem, is_sym, is_view
from mirrorgrad.graph.repeats import repeated_classes
from mirrorgrad.mirror.policy import DEFAULT_CLASSES, MirrorPolicy, is_random, op_name
from mirrorgrad.mirror.storage_balance import UnitGraph, storage_balance
from mirrorgrad.options import MirrorOptions

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
# Units the final pruning tries to un-mirror (one liveness simulation each).
PRUNE_TRIALS = 16
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
# A budget missed by more than this fraction is declared (MirrorgradBudgetWarning).
BUDGET_TOLERANCE = 0.05
# torch.compile's default partition (min-cut) recomputes only cheap ops that Inductor
# fuses for nearly nothing; the plan that stands for it on the budget scale
# (BudgetScale) is balance's with this time cap (our cost model charges a fused
# recomputation its arithmetic). Running min-cut itself would cost 4-7 s of planning
# on a 10k-node graph.
DEFAULT_PLAN_OVERHEAD = 0.01
# A plan that differs between copies of a repeated block gives Inductor a kernel per
# variant to compile (cold compile 1.35-1.47x torch.compile's on the suite's
# Transformer and resnet50, where min-cut's identical blocks reuse 8 backward
# kernels at any depth). The chosen plan is made the same in every copy where that
# keeps its promise: a budget at no more time (a search by whole classes of
# repeated ops found no plan at the transformer's budget peaks as fast as the
# per-unit one); balance's cap, at most this share above its peak.
UNIFORM_PEAK_SLACK = 0.02
# Up to this many classes decided both ways, every way of deciding them is tried
# (2**N simulations); beyond, three.
UNIFORM_EXHAUSTIVE = 4
# Rounds of stashing classes that a plan still recomputes in some copies only.
UNIFORM_SETTLE_ROUNDS = 4
# The largest values alive at the peak that a plan's summary names.
FLOOR_VALUES = 5
# What an estimated peak counts (str(plan), the budget warning, the README).
PEAK_INCLUDES = (
    "one forward+backward of the compiled graph: parameters, inputs, gradients, saved "
    "and temporary values, the ops' declared temporaries; the cuBLAS workspaces are "
    "listed apart ('held outside', in the step peak); optimizer state and other memory "
    "held outside the graph (CUDA Graph pools, data) come on top"
)


# Ops whose output Inductor writes to memory (reductions, normalizations), ending a
# chain of fused elementwise ops.
_CHAIN_ENDS = frozenset(
    DEFAULT_CLASSES.reduction | DEFAULT_CLASSES.normalization | DEFAULT_CLASSES.softmax
)


class MirrorgradBudgetWarning(UserWarning):
    """The plan's estimated peak misses the budget asked for; says what holds the floor."""


class PlanError(RuntimeError):
    """The planner reached an inconsistent state (callers fall back to PyTorch's partition)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class BudgetScale:
    """What a budget fraction is of: PyTorch's ``activation_memory_budget`` rule.

    PyTorch's fraction F bounds the saved activations to ``floor + F * (default -
    floor)``: 1 is what its default partition saves, 0 what it saves recomputing all
    it may; within that bound it takes the least recompute time. Ours applies the
    same rule to the planner's candidates (default: the plan standing for
    torch.compile's, ``DEFAULT_PLAN_OVERHEAD``; floor: the smallest stash of any
    candidate). The least-time candidate within the bound sets the peak asked for
    (the lowest such peak over F and every higher fraction, so a lower fraction
    never asks for more), and the plan is the least time at that peak: never more
    time than the rule's own choice, often less (it may stash more where that costs
    no peak). So ``budget=0.5`` asks for about what ``activation_memory_budget=0.5``
    reaches, a peak, not a stash.
    """

    fraction: float
    default_stash: int
    floor_stash: int
    peak: int  # the lowest peak of the rule's choices at this fraction and above

    @property
    def stash_bound(self) -> int:
        return int(self.floor_stash + self.fraction * (self.default_stash - self.floor_stash))

    @property
    def budget_bytes(self) -> int:
        return self.peak

    def describe(self) -> str:
        return (
            f"{self.fraction:g} on activation_memory_budget's scale: stash at most "
            f"{_fmt(self.stash_bound)} ({self.fraction:g} of the way from the smallest, "
            f"{_fmt(self.floor_stash)}, to the default plan's {_fmt(self.default_stash)}); "
            f"the least-time plan within that peaks at {_fmt(self.peak)}"
        )

    @classmethod
    def of(
        cls, fraction: float, points: list[tuple[int, int, float]], default_stash: int
    ) -> BudgetScale:
        """The scale for candidates given as (stash, peak, added seconds)."""
        scale = cls(
            fraction=fraction,
            default_stash=default_stash,
            floor_stash=min(p[0] for p in points),
            peak=0,
        )
        # The rule's choice for every stash bound from this fraction's up: the
        # least-time candidate among those stashing at most the bound.
        by_stash = sorted(points, key=lambda p: (p[0], p[2]))
        best, choices = None, []
        for i, point in enumerate(by_stash):
            if best is None or point[2] < best[2]:
                best = point
            following = by_stash[i + 1][0] if i + 1 < len(by_stash) else None
            if following is None or following > scale.stash_bound:
                choices.append(best)
        return replace(scale, peak=min(p[1] for p in choices))

    def to_dict(self) -> dict:
        return {
            "fraction": self.fraction,
            "default_stash": self.default_stash,
            "floor_stash": self.floor_stash,
            "stash_bound": self.stash_bound,
            "peak": self.peak,
        }


@dataclass(kw_only=True, slots=True, frozen=True)
class PlanOptions(MirrorOptions):
    """The user's options (validated by ``MirrorOptions``) and what the planner learns
    at compile time: the policy, the device, whether the backend fuses."""

    policy: MirrorPolicy | None = None
    # The accelerator's rates; by default looked up from the graph's device (rates_for).
    device: DeviceRates | None = None
    # The backend fuses pointwise ops (Inductor): recomputed ones run inside their
    # backward readers' kernels, and fused intermediates are never allocated. Set
    # False for backends that run each op on its own (backend="eager").
    fusion: bool = True


@dataclass(kw_only=True, slots=True)
class Plan:
    saved: list[Node]
    saved_sym: list[Node]
    mirrored: list[Node]
    stash_bytes_before: int
    stash_bytes_after: int
    peak_before: int
    peak_after: int
    added_flops: int
    added_time_s: float
    step_time_s: float
    mode: str
    budget_bytes: int | None = None
    # A fractional budget: what the fraction is of (None for bytes and other modes).
    budget_scale: BudgetScale | None = None
    # Budget mode: whether the estimated peak is within BUDGET_TOLERANCE of the budget.
    budget_met: bool | None = None
    # What is alive at the estimated peak of this plan; when a budget is not met, the
    # floor: what no mirroring can remove (parameters, gradients, inputs, ...).
    floor: liveness.PeakBreakdown | None = field(default=None, repr=False)
    sizes: dict[Node, int] = field(default_factory=dict, repr=False)
    # The memory mode chosen for each of our RNN ops (mirror/op_memory.py).
    op_memory: list = field(default_factory=list, repr=False)
    # What the step holds outside the graph, by holder (graph/held.py: BLAS workspaces).
    held: dict[str, int] = field(default_factory=dict, repr=False)

    @property
    def step_peak(self) -> int:
        """The estimated peak of the step: the graph's (``peak_after``) and ``held``."""
        return self.peak_after + sum(self.held.values())

    def _stashed(self) -> list[Node]:
        """Saved values other than primals (those are the caller's anyway)."""
        return [n for n in self.saved if n.op != "placeholder"]

    def to_dict(self) -> dict:
        def row(n: Node) -> dict:
            return {"name": n.name, "op": op_name(n), "shape": _shape(n), "bytes": self.sizes[n]}

        return {
            "mode": self.mode,
            "budget_bytes": self.budget_bytes,
            "budget_scale": self.budget_scale.to_dict() if self.budget_scale else None,
            "stashed": [row(n) for n in self._stashed()],
            "mirrored": [row(n) for n in self.mirrored if not is_getitem(n)],
            "saved_sym": [n.name for n in self.saved_sym],
            "stash_bytes_before": self.stash_bytes_before,
            "stash_bytes_after": self.stash_bytes_after,
            "peak_before": self.peak_before,
            "peak_after": self.peak_after,
            "added_flops": self.added_flops,
            "added_time_s": self.added_time_s,
            "step_time_s": self.step_time_s,
            "budget_met": self.budget_met,
            "floor": self.floor.to_dict() if self.floor is not None else None,
            "op_memory": [c.to_dict() for c in self.op_memory],
            "held": dict(self.held),
            "step_peak": self.step_peak,
        }

    def floor_summary(self) -> str:
        """One line: the bytes alive at the estimated peak by kind, and the largest values."""
        if self.floor is None:
            return ""
        kinds = ", ".join(f"{kind} {_fmt(b)}" for kind, b in self.floor.bytes_by_kind.items() if b)
        largest = ", ".join(
            f"{n.name} ({kind}) {_fmt(b)}" for n, kind, b in self.floor.values[:FLOOR_VALUES]
        )
        by_kind = self.floor.bytes_by_kind
        fixed = by_kind.get("parameters", 0) + by_kind.get("gradients", 0)
        share = fixed / self.floor.peak if self.floor.peak else 0.0
        return (
            f"alive at the peak ({self.floor.phase}, {self.floor.node}): {kinds} "
            f"(parameters and gradients {_fmt(fixed)}, {share:.0%} of it, no plan removes); "
            f"largest values: {largest}"
        )

    def _budget_state(self) -> str:
        if self.budget_met is False:
            return "NOT met"
        if self.budget_bytes is not None and self.peak_after > self.budget_bytes:
            over = self.peak_after / self.budget_bytes - 1
            return f"met within the {BUDGET_TOLERANCE:.0%} tolerance (+{over:.1%})"
        return "met"

    def summary_line(self) -> str:
        """The plan in one line, for a training log: peaks, time, op choices, budget."""
        overhead = self.added_time_s / self.step_time_s if self.step_time_s else 0.0
        parts = [
            f"mirror {self.mode}: estimated peak {_fmt(self.step_peak)} "
            f"(graph {_fmt(self.peak_after)}, {_fmt(self.peak_before)} unmirrored), "
            f"+{overhead:.1%} time"
        ]
        parts += [f"{c.module or c.node} {c.choice}" for c in self.op_memory]
        if self.budget_bytes is not None:
            scale = self.budget_scale
            of = f" ({scale.fraction:g} on activation_memory_budget's scale)" if scale else ""
            parts.append(f"budget {_fmt(self.budget_bytes)}{of} {self._budget_state()}")
            if not self.budget_met:
                parts.append(self.floor_summary())
        return "; ".join(parts)

    def __str__(self) -> str:
        rows = [
            (kind, n.name, op_name(n), str(_shape(n)), _fmt(self.sizes[n]))
            for kind, nodes in (("stash", self._stashed()), ("mirror", self.mirrored))
            for n in nodes
            if not (kind == "mirror" and is_getitem(n))
        ]
        header = ("", "value", "op", "shape", "bytes")
        widths = [max(len(r[i]) for r in (header, *rows)) + 2 for i in range(4)]
        lines = [f"mirrorgrad plan (mode={self.mode})", ""]
        for row in (header, *rows):
            cells = "".join(f"{cell:<{w}}" for cell, w in zip(row[:4], widths))
            lines.append(f"{cells}{row[4]:>12}")
        overhead = self.added_time_s / self.step_time_s if self.step_time_s else 0.0
        lines += [
            "",
            f"stash bytes:    {_fmt(self.stash_bytes_before)} -> {_fmt(self.stash_bytes_after)}",
            f"estimated peak: {_fmt(self.peak_before)} -> {_fmt(self.peak_after)}",
            f"                ({PEAK_INCLUDES})",
            *(
                f"held outside:   {what} {_fmt(b)}: step peak {_fmt(self.step_peak)}"
                for what, b in self.held.items()
            ),
            f"added FLOPs:    {self.added_flops:,}",
            f"added time:     {self.added_time_s * 1e6:.1f} us "
            f"({overhead:.1%} of an estimated {self.step_time_s * 1e6:.1f} us step)",
        ]
        if self.budget_bytes is not None:
            lines.append(f"budget:         {_fmt(self.budget_bytes)} ({self._budget_state()})")
        if self.budget_scale is not None:
            lines.append(f"                ({self.budget_scale.describe()})")
        if self.floor is not None:
            lines.append(f"floor:          {self.floor_summary()}")
        lines += [f"op memory:      {c}" for c in self.op_memory]
        return "\n".join(lines)


def _shape(n: Node) -> list | None:
    """Shape of a tensor value (a list of shapes for a tuple), JSON-able."""

    def dims(t: object) -> list | None:
        if not hasattr(t, "shape"):
            return None
        return [d if isinstance(d, int) else str(d) for d in t.shape]

    val = n.meta.get("val")
    if isinstance(val, (tuple, list)):
        return [dims(v) for v in val]
    return dims(val)


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
    """
    facts = _partition_facts(joint, graph)
    saved, saved_sym, mirrored = set(), set(), set()
    stack = list(facts.backward_reads)
    while stack:
        v = stack.pop()
        if v in saved or v in saved_sym or v in mirrored:
            continue
        kind = facts.kind[v]
        if kind is _SYM:
            saved_sym.add(v)
            continue
        if kind is _ALIVE or kind not in mirror_units:
            if facts.tuple_valued[v]:
                raise PlanError(f"cannot save the tuple-valued node {v.name}")
            saved.add(v)
            continue
        mirrored.add(v)
        stack.extend(facts.reads[v])
    return Partition(
        saved=joint.sorted(saved),
        saved_sym=joint.sorted(saved_sym),
        mirrored=joint.sorted(mirrored),
    )


_SYM, _ALIVE = object(), object()


@dataclass(kw_only=True, slots=True)
class _PartitionFacts:
    """What ``partition_for`` asks of every forward value, computed once per graph."""

    backward_reads: list[Node]  # forward values the backward nodes read
    kind: dict[Node, object]  # _SYM, _ALIVE (primal, forward output) or its unit
    tuple_valued: dict[Node, bool]
    reads: dict[Node, list[Node]]  # what recomputing the value reads


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
    facts = _PartitionFacts(
        backward_reads=[
            a for n in joint.backward for a in n.all_input_nodes if _is_fwd_value(joint, a)
        ],
        kind=kind,
        tuple_valued={v: isinstance(v.meta.get("val"), (tuple, list)) for v in values},
        reads=reads,
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


def plan(joint: JointGraph, options: PlanOptions, *, warn: bool = True) -> Plan:
    """Decide what the forward pass stashes and what the backward pass recomputes.

    ``warn=False``: no ``MirrorgradBudgetWarning`` (a caller that compares plans warns
    once for the one it keeps)."""
    policy = options.policy if options.policy is not None else MirrorPolicy()
    rates = options.device if options.device is not None else rates_for(joint.device)
    graph = UnitGraph(joint, policy)
    planner = _Planner(joint, graph, rates, fusion=options.fusion)
    before = planner.evaluate(set())
    budget_bytes, scale = None, None
    if options.mode == "off" or not policy.enabled:
        chosen = before
    elif options.mode == "balance":
        chosen = planner.balance(options.max_overhead, before)
        cap_s = options.max_overhead * planner.step_time_s
        chosen = planner.uniform(
            chosen,
            lambda c: (
                c.added_time_s <= cap_s
                and c.peak < before.peak
                and c.peak <= chosen.peak * (1 + UNIFORM_PEAK_SLACK)
            ),
        )
    else:
        candidates, default = planner.budget_candidates(before)
        if isinstance(options.budget, float):
            scale = planner.budget_scale(options.budget, default, candidates)
            budget_bytes = scale.budget_bytes
        else:
            budget_bytes = int(options.budget)
        chosen = planner.meet_budget(budget_bytes, candidates)
        peak_cap, time_cap = max(budget_bytes, chosen.peak), chosen.added_time_s
        chosen = planner.uniform(
            chosen, lambda c: c.peak <= peak_cap and c.added_time_s <= time_cap
        )
    _check(joint, chosen.partition)
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
    )
    if met is False and warn:
        warnings.warn(budget_message(result), MirrorgradBudgetWarning, stacklevel=2)
    return result


def scale_points(candidates: list[_Candidate]) -> list[tuple[int, int, float]]:
    return [(c.stash, c.peak, c.added_time_s) for c in candidates]


def budget_points(joint: JointGraph, options: PlanOptions) -> tuple[list, int]:
    """Every budget candidate of ``joint`` as (stash, peak, added seconds), and the
    stash of the plan standing for torch.compile's default (``BudgetScale.of``)."""
    policy = options.policy if options.policy is not None else MirrorPolicy()
    rates = options.device if options.device is not None else rates_for(joint.device)
    planner = _Planner(joint, UnitGraph(joint, policy), rates, fusion=options.fusion)
    candidates, default = planner.budget_candidates(planner.evaluate(set()))
    return scale_points(candidates), default.stash


def budget_message(p: Plan) -> str:
    held = "".join(f" Held outside the graph: {what} {_fmt(b)}." for what, b in p.held.items())
    asked = f" ({p.budget_scale.describe()})" if p.budget_scale else ""
    return (
        f"mirrorgrad: the budget of {_fmt(p.budget_bytes)}{asked} is not met: the lowest "
        f"estimated peak found is {_fmt(p.peak_after)} ({p.peak_after / p.peak_before:.2f} "
        f"of the unmirrored {_fmt(p.peak_before)}). {p.floor_summary()}.{held} The peak is "
        f"of {PEAK_INCLUDES}."
    )


def _check(joint: JointGraph, partition: Partition) -> None:
    for n in partition.mirrored:
        if is_random(n):
            raise PlanError(f"random op {n.name} would be recomputed with a fresh draw")
        if n not in joint.forward_set:
            raise PlanError(f"mirrored node {n.name} is not a forward node")
    liveness.backward_schedule(joint, partition.saved + partition.saved_sym, partition.mirrored)


@dataclass(kw_only=True, slots=True)
class _Candidate:
    units: frozenset[Node]
    partition: Partition
    peak: int
    peak_index: int
    stash: int
    added_flops: int
    added_time_s: float


class _Planner:
    def __init__(
        self, joint: JointGraph, graph: UnitGraph, rates: DeviceRates, *, fusion: bool
    ) -> None:
        self.joint, self.graph, self.rates, self.fusion = joint, graph, rates, fusion
        costs = StepCost(joint, rates, fusion=fusion)
        self.index = liveness.GraphIndex(joint)
        self.step_time_s = costs.step_seconds
        self.inlined = costs.inlined  # values computed in their readers' kernels
        self.recompute = {n: costs.recomputed(n) for n in joint.forward}
        self._evaluated: dict[tuple[frozenset[Node], bool], _Candidate] = {}
        self._chain_cache: dict[Node, tuple[str, list, int]] = {}

    def added_time_s(self, partition: Partition) -> float:
        return sum(self.recompute[n].seconds for n in partition.mirrored)

    def evaluate(self, units: set[Node], *, uniform: bool = False) -> _Candidate:
        """The plan that mirrors ``units`` once its long recompute chains are cut
        (``MAX_CHAIN_READS``: its ``units`` may be fewer), simulated once per set.
        ``uniform``: a unit stashed to cut a chain is stashed in every copy of its
        repeated block too (``repeated_classes``)."""
        key = (frozenset(units), uniform)
        known = self._evaluated.get(key)
        if known is None:
            partition = partition_for(self.joint, self.graph, set(key[0]))
            cut = self._cut_long_chains(key[0], partition.mirrored, uniform=uniform)
            known = self._evaluated.get((cut, uniform))
            if known is None:
                known = self._evaluate(cut, partition if cut == key[0] else None)
                self._evaluated[(cut, uniform)] = known
            self._evaluated[key] = known
        return known

    @cached_property
    def _classes(self) -> list[frozenset[Node]]:
        """Units that are the same op in copies of a repeated block."""
        return [frozenset(c) for c in repeated_classes(self.joint, self.graph.units)]

    @cached_property
    def _class_of(self) -> dict[Node, frozenset[Node]]:
        return {u: c for c in self._classes for u in c}

    def uniform(self, chosen: _Candidate, keeps_promise) -> _Candidate:
        """``chosen`` with the same decisions in every copy of each repeated block,
        where one such plan ``keeps_promise`` (the least time of those that do), else
        ``chosen``. Each class decided both ways is all stashed or all mirrored: every
        combination for a few classes, else all stashed, all mirrored, each as most
        of its copies are, and then one class flipped at a time from the best of
        those. Chains are cut the same way in every copy."""
        units = set(chosen.units)
        mixed = self._mixed(chosen)
        if not mixed:
            return chosen
        g = self.graph
        allowed = [frozenset(u for u in c if g.mirrorable[u] or u in g.last_resort) for c in mixed]
        down = frozenset(units.difference(*mixed))

        def trial(up: tuple[bool, ...]) -> _Candidate:
            return self._settled(down.union(*(a for a, u in zip(allowed, up) if u)))

        def score(c: _Candidate) -> tuple:
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

    def _settled(self, units: frozenset[Node]) -> _Candidate:
        """The plan of ``units`` with chains cut alike in every copy, and then the
        classes still recomputed in some copies only (the backward reaches a unit
        through readers decided elsewhere) stashed in all, until none is left."""
        for _ in range(UNIFORM_SETTLE_ROUNDS):
            candidate = self.evaluate(units, uniform=True)
            mixed = self._mixed(candidate)
            if not mixed:
                break
            units = frozenset(candidate.units.difference(*mixed))
        return candidate

    def _mixed(self, candidate: _Candidate) -> list[frozenset[Node]]:
        """Classes recomputed in some copies and not in others (a unit asked for is
        recomputed only where the backward reaches it: ``partition_for``)."""
        recomputed = set(candidate.partition.mirrored)
        return [c for c in self._classes if 0 < len(recomputed & c) < len(c)]

    def _is_uniform(self, candidate: _Candidate) -> bool:
        return not self._mixed(candidate)

    def _cut_long_chains(
        self, units: frozenset[Node], recomputed: list[Node], *, uniform: bool = False
    ) -> frozenset[Node]:
        """``units`` less those whose stashing keeps every chain of recomputed
        elementwise ops computed in registers (``StepCost.inlined``: a value an extern
        kernel reads is written out and ends the chain, as a ResNet block's output
        does) within ``MAX_CHAIN_READS`` stored values of at least a quarter of the
        reading op's output (per-channel statistics and weights do not count): walking
        the recomputed nodes in order, where a chain would read more, its recomputed
        input reading the most is stashed. Stashing only shortens chains: one walk
        suffices."""
        in_plan, stashed = set(recomputed), set()
        reads: dict[Node, frozenset[Node]] = {}
        empty: frozenset[Node] = frozenset()

        def chained(a: Node, unit: Node) -> bool:  # computed in a chain's kernel
            return a in in_plan and bool(reads[a]) and unit not in stashed

        for n in recomputed:
            role, inputs, floor = self._chain_facts(n)
            if role == "end":
                reads[n] = empty
                continue
            links = [(a, unit) for a, unit, _, _ in inputs if chained(a, unit)]
            if not links:  # reads only stored values: an op inlined starts a chain
                reads[n] = (
                    frozenset(root for _, _, root, size in inputs if size >= floor)
                    if role == "inlined"
                    else empty
                )
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
                stashed |= self._class_of.get(unit, {unit}) if uniform else {unit}
            # an op not inlined is written to memory: its readers read it alone
            reads[n] = frozenset(read) if role != "written" else empty
        return units - stashed if stashed else units

    def _chain_facts(self, n: Node) -> tuple[str, list[tuple[Node, Node, Node, int]], int]:
        """Per node, once: its role in a chain ("end": an extern kernel or a reduction;
        "view": a view or getitem, part of its input's chain; "inlined"; "written"), its
        inputs as (value, unit, root, root bytes), and the smallest read that counts."""
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
            facts = self._chain_cache[n] = (role, inputs, floor)
        return facts

    def _evaluate(self, units: frozenset[Node], partition: Partition | None) -> _Candidate:
        if partition is None:
            partition = partition_for(self.joint, self.graph, set(units))
        available = partition.saved + partition.saved_sym
        try:
            sim = liveness.simulate(
                self.joint, available, partition.mirrored, fusion=self.fusion, index=self.index
            )
        except JointGraphError as e:
            raise PlanError(f"inconsistent partition: {e}") from e
        return _Candidate(
            units=units,
            partition=partition,
            peak=sim.peak,
            peak_index=sim.peak_index,
            stash=sum(stash_sizes(self.joint, self.graph, partition.saved).values()),
            added_flops=sum(self.recompute[n].flops for n in partition.mirrored),
            added_time_s=self.added_time_s(partition),
        )

    def balance(self, max_overhead: float, before: _Candidate) -> _Candidate:
        """The lowest peak within the time cap: the storage-balance plan, repaired
        and trimmed to the cap, or a state of the adding search within it."""
        cap_s = max_overhead * self.step_time_s
        chosen = self.repaired_storage_balance
        units = self._within_cap(set(chosen.units), cap_s)
        if units != chosen.units:
            chosen = self.evaluate(units)
        path = self._adding_path(before, last_resort=False, cap_s=cap_s)
        candidates = [chosen, *(c for c in path if c.added_time_s <= cap_s)]
        chosen = min(candidates, key=lambda c: (c.peak, c.added_time_s))
        return chosen if chosen.peak < before.peak else before

    @cached_property
    def repaired_storage_balance(self) -> _Candidate:
        """The storage-balance plan after the lifetime repair (budget mode's default
        plan, its trims and balance mode all start from it)."""
        return self.shorten_recompute_lifetimes(self.evaluate(storage_balance(self.graph)))

    def _within_cap(self, units: set[Node], cap_s: float) -> set[Node]:
        """Un-mirror the fewest units, costliest first, for an added time <= ``cap_s``.

        Un-mirroring never adds recomputation, so the added time falls as more of the
        ranking is dropped: a binary search finds the shortest prefix that fits.
        """
        partition = partition_for(self.joint, self.graph, units)
        if self.added_time_s(partition) <= cap_s:
            return units
        ranked = self._costliest_first(units, set(partition.mirrored))
        lo, hi = 0, len(ranked)
        while lo < hi:
            mid = (lo + hi) // 2
            kept = units - set(ranked[:mid])
            if self.added_time_s(partition_for(self.joint, self.graph, kept)) <= cap_s:
                hi = mid
            else:
                lo = mid + 1
        return units - set(ranked[:lo])

    def shorten_recompute_lifetimes(self, current: _Candidate) -> _Candidate:
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

    def _costliest_first(self, units: set[Node], recomputed: set[Node]) -> list[Node]:
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

    def budget_candidates(self, before: _Candidate) -> tuple[list[_Candidate], _Candidate]:
        """The plans budget mode chooses from (they do not depend on the budget), and
        the one standing for torch.compile's default (``BudgetScale``).

        - the default: balance's plan with a ``DEFAULT_PLAN_OVERHEAD`` cap (cheap ops).

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
        trims = self._trimmed_balance()
        path = self._adding_path(before, last_resort=True)
        # Heavy ops on top of the storage-balance plan: the low-peak end of the frontier
        # (the path from nothing spends the budget on convolutions first; the balance plan
        # reaches 0.59x of ResNet-152's peak with BatchNorm and ReLU alone).
        deeper = self._adding_path(trims[0], last_resort=True)
        default = self.balance(DEFAULT_PLAN_OVERHEAD, before)
        return [default, *path, *trims, *deeper], default

    def budget_scale(
        self, fraction: float, default: _Candidate, candidates: list[_Candidate]
    ) -> BudgetScale:
        """``fraction`` on PyTorch's scale, ``default`` standing for torch.compile's."""
        return BudgetScale.of(fraction, scale_points(candidates), default.stash)

    def meet_budget(self, budget_bytes: int, candidates: list[_Candidate]) -> _Candidate:
        """The least added time whose peak meets the budget, else the lowest peak.

        Choosing the cheapest candidate within the budget from a fixed set
        (``budget_candidates``) means a lower budget never gets a higher peak. Within
        no budget, the lowest peak wins; among equal peaks the smaller stash (the
        user asked for memory: it is headroom where the estimate errs), then the
        least time.
        """
        feasible = [c for c in candidates if c.peak <= budget_bytes]
        if feasible:
            return self._prune(min(feasible, key=lambda c: (c.added_time_s, c.peak, c.stash)))
        return min(candidates, key=lambda c: (c.peak, c.stash, c.added_time_s))

    def _prune(self, chosen: _Candidate) -> _Candidate:
        """Un-mirror units that cost time and do not lower the peak, costliest first.

        A chunk of the adding search takes in units that pay nothing at the peak
        (recomputing a LayerNorm's statistics to free 4 KiB). The peak never rises,
        so a lower budget still never gets a higher peak. Only where the budget is
        met: short of it, among equal peaks the smaller stash is the headroom.
        """
        units = set(chosen.units)
        ranked = self._costliest_first(units, set(chosen.partition.mirrored))
        for unit in ranked[:PRUNE_TRIALS]:
            trial = self.evaluate(set(chosen.units) - {unit})
            if trial.peak <= chosen.peak and trial.added_time_s < chosen.added_time_s:
                chosen = trial
        return chosen

    def _adding_path(
        self, before: _Candidate, *, last_resort: bool, cap_s: float = float("inf")
    ) -> list[_Candidate]:
        """The states of the adding search (``meet_budget``), the last one also
        after the lifetime repair. ``last_resort``: matmuls and convolutions too, and
        the prefixes of chunks that lower the peak by more than ``REFINE_DROP``.
        Added time only grows along the path: it stops once past ``cap_s``."""
        path, between = [before], []
        current, rejected, k = before, set(), 1
        max_chunk = max(MAX_CHUNK, int(len(self.graph.units) * CHUNK_SHARE))
        stalled = 0  # simulations since the peak last fell
        ranked: list[Node] | None = None  # for ``current``; a rejection only shortens it
        for _ in range(MAX_BUDGET_TRIALS):
            if current.added_time_s > cap_s or stalled >= STALL_TRIALS:
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

    def _prefixes(self, current: _Candidate, chunk: list[Node]) -> list[_Candidate]:
        """``current`` with the first half, quarter, ... of ``chunk`` added."""
        found, k = [], len(chunk) // 2
        while k >= 1:
            found.append(self.evaluate(set(current.units) | set(chunk[:k])))
            k //= 2
        return found

    def _trimmed_balance(self) -> list[_Candidate]:
        """The repaired storage-balance plan, then with its costliest 1, 2, 4, ...
        units stashed instead (each trim saves time and may cost peak)."""
        grouped = self.repaired_storage_balance
        units = set(grouped.units)
        recomputed = set(partition_for(self.joint, self.graph, units).mirrored)
        ranked = self._costliest_first(units, recomputed)
        trims, k = [grouped], 1
        while k < len(ranked):
            trims.append(self.evaluate(units - set(ranked[:k])))
            k *= 2
        return trims

    def _ranked_additions(
        self, current: _Candidate, rejected: set[Node], *, last_resort: bool
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
