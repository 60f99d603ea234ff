"""The storage-balance algorithm (MXNet's backward mirroring, seed 003, in our words).

It decides, per forward op (a *unit*: one op node with all its outputs; views are
not units, they follow the op they alias), whether the op runs only in the forward
pass with its outputs stashed ("stash") or is recomputed in the backward pass
("mirror"):

1. A worklist starts at the forward outputs. For each undecided mirrorable unit,
   grow a subgraph backwards through mirrorable producers; the others are
   boundaries and become new worklist heads.
2. Close the subgraph: when a value it reads is also read by forward ops outside
   it, pull those branches in (they share the decision about that value).
3. The frontier is the undecided units whose inputs are all boundaries or stashed.
   Frontier units that share inputs form a group. *allocated* = bytes of the
   group's outputs that anything reads, plus its inputs that something outside the
   group still reads; *released* = bytes of its inputs only the group reads.
   Readers include backward nodes. If released >= allocated, stashing the group's
   outputs costs no more than stashing its inputs: the group is stashed.
4. Whatever stays undecided is mirrored.
5. A heavy op (never mirrored) whose gradient reads only its inputs (Linear:
   dX = dY W, dW = dY^T X) takes those inputs from the mirror path: the backward
   recomputes them when their producers are mirrored. In a joint graph this is
   what the partition does by itself once the producers are mirrored.

Values that are alive anyway (primals, forward outputs) cost nothing to keep.
"""

from __future__ import annotations

from collections import deque
from functools import cached_property

from torch.fx import Node

from mirrorgrad.graph.joint import JointGraph, is_getitem, is_sym, is_view
from mirrorgrad.mirror.policy import MirrorPolicy

STASH = "stash"
MIRROR = "mirror"


class UnitGraph:
    """Forward ops as units, with their values seen through views."""

    def __init__(self, joint: JointGraph, policy: MirrorPolicy) -> None:
        self.joint = joint
        self._roots: dict[Node, Node] = {}  # the planner asks for roots very often
        self.units = [n for n in joint.forward if not is_getitem(n) and not is_view(n)]
        self.unit_set = frozenset(self.units)
        self.fwd_outputs = frozenset(joint.fwd_outputs)
        self.mirrorable = {u: self._may_mirror(u, policy) for u in self.units}
        # Not mirrorable, but budget mode may recompute them when nothing else meets it.
        self.last_resort = frozenset(
            u
            for u in self.units
            if not self.mirrorable[u] and policy.may_mirror_heavy(u) and self._holds_memory(u)
        )

    def _may_mirror(self, unit: Node, policy: MirrorPolicy) -> bool:
        return not is_sym(unit) and policy.may_mirror(unit) and self._holds_memory(unit)

    def _holds_memory(self, unit: Node) -> bool:
        """Some output of ``unit`` is not alive anyway: mirroring it can free bytes."""
        return not all(self.is_free(v) for v in self.outputs(unit))

    def root(self, value: Node) -> Node:
        """The value whose storage ``value`` aliases (itself unless it is a view)."""
        root = self._roots.get(value)
        if root is None:
            root = value
            while is_view(root) and root.args and isinstance(root.args[0], Node):
                root = root.args[0]
            self._roots[value] = root
        return root

    def producer(self, value: Node) -> Node | None:
        """The unit computing root value ``value`` (None for primals)."""
        if is_getitem(value):
            value = value.args[0]
        return value if value in self.unit_set else None

    def outputs(self, unit: Node) -> list[Node]:
        if isinstance(unit.meta.get("val"), (tuple, list)):
            return [u for u in unit.users if is_getitem(u)]
        return [unit]

    @cached_property
    def _readers(self) -> dict[Node, list[Node]]:
        """Root value -> nodes reading it or an alias of it (views see through)."""
        readers: dict[Node, list[Node]] = {}
        for n in self.joint.gm.graph.nodes:
            if n.op == "placeholder" or is_getitem(n) or is_view(n):
                continue
            for a in n.all_input_nodes:
                if a.op == "placeholder" or a in self.joint.forward_set:
                    readers.setdefault(self.root(a), []).append(n)
        for v in self.fwd_outputs:
            readers.setdefault(self.root(v), []).append(self._output_node)
        return {k: list(dict.fromkeys(v)) for k, v in readers.items()}

    @cached_property
    def _output_node(self) -> Node:
        return next(n for n in self.joint.gm.graph.nodes if n.op == "output")

    def readers(self, root: Node) -> list[Node]:
        return self._readers.get(root, [])

    def inputs(self, unit: Node) -> list[Node]:
        """Root values ``unit`` reads, in argument order, without duplicates."""
        return list(dict.fromkeys(self.root(a) for a in unit.all_input_nodes))

    def input_units(self, unit: Node) -> list[Node]:
        return [p for p in (self.producer(r) for r in self.inputs(unit)) if p is not None]

    def is_free(self, value: Node) -> bool:
        """Alive anyway for the whole step: a primal or a forward output (or an alias)."""
        root = self.root(value)
        return root.op == "placeholder" or root in self.fwd_outputs or value in self.fwd_outputs

    def cost(self, value: Node) -> int:
        return 0 if self.is_free(value) else self.joint.nbytes(value)


def storage_balance(graph: UnitGraph) -> set[Node]:
    """The units the storage-balance algorithm mirrors."""
    return _StorageBalance(graph).run()


class _StorageBalance:
    def __init__(self, graph: UnitGraph) -> None:
        self.g = graph
        self.decided: dict[Node, str] = {u: STASH for u in graph.units if not graph.mirrorable[u]}

    def run(self) -> set[Node]:
        g = self.g
        heads = [g.producer(g.root(v)) for v in g.joint.fwd_outputs]
        worklist = deque(h for h in heads if h is not None)
        # Forward ops no forward output needs (read by backward only) start later.
        rest = iter(reversed(g.units))
        visited: set[Node] = set()
        while True:
            if not worklist:
                item = next((u for u in rest if u not in visited), None)
                if item is None:
                    break
                worklist.append(item)
            item = worklist.popleft()
            if item in visited:
                continue
            visited.add(item)
            if item in self.decided:
                worklist.extend(g.input_units(item))
                continue
            subgraph = self._grow([item], worklist, {})
            self._close(subgraph, worklist)
            self._decide_frontier(subgraph)
            for u in subgraph:
                self.decided.setdefault(u, MIRROR)
                visited.add(u)
        return {u for u, d in self.decided.items() if d == MIRROR}

    def _grow(self, start: list[Node], worklist: deque, subgraph: dict[Node, None]) -> dict:
        """Add ``start`` and its mirrorable undecided producers to ``subgraph``."""
        stack = list(start)
        expanded: set[Node] = set()
        while stack:
            u = stack.pop()
            if u in expanded:
                continue
            expanded.add(u)
            if u not in self.decided:
                subgraph[u] = None
            for p in self.g.input_units(u):
                if p in self.decided:
                    worklist.append(p)
                elif p not in subgraph:
                    stack.append(p)
        return subgraph

    def _close(self, subgraph: dict[Node, None], worklist: deque) -> None:
        """Pull in forward branches that read values the subgraph reads."""
        g = self.g
        changed = True
        while changed:
            changed = False
            for u in list(subgraph):
                for value in g.inputs(u):
                    for reader in g.readers(value):
                        if (
                            reader in g.unit_set
                            and reader not in subgraph
                            and reader not in self.decided
                        ):
                            self._grow(self._branch(reader), worklist, subgraph)
                            changed = True
                    if changed:
                        break
                if changed:
                    break

    def _branch(self, start: Node) -> list[Node]:
        """The forward branch from ``start`` through undecided mirrorable ops, up to
        and including its heads (decided ops and producers of forward outputs)."""
        g = self.g
        heads, seen, queue = [], set(), deque([start])
        while queue:
            u = queue.popleft()
            if u in seen:
                continue
            seen.add(u)
            heads.append(u)
            if u in self.decided or any(v in g.fwd_outputs for v in g.outputs(u)):
                continue
            for v in g.outputs(u):
                queue.extend(r for r in g.readers(g.root(v)) if r in g.unit_set)
        return heads

    def _decide_frontier(self, subgraph: dict[Node, None]) -> None:
        g = self.g
        while True:
            frontier = [
                u
                for u in subgraph
                if u not in self.decided
                and all(self.decided.get(p) == STASH for p in g.input_units(u))
            ]
            frontier_set = set(frontier)
            grouped: set[Node] = set()
            stashed_any = False
            for f in frontier:
                if f in grouped:
                    continue
                group = self._group(f, frontier_set)
                grouped |= group
                if self._released(group) >= self._allocated(group):
                    for u in group:
                        self.decided[u] = STASH
                    stashed_any = True
                    break
            if not stashed_any:
                return

    def _group(self, start: Node, frontier: set[Node]) -> set[Node]:
        """Frontier units sharing inputs with ``start``, transitively."""
        g = self.g
        group, queue = {start}, deque([start])
        while queue:
            u = queue.popleft()
            for value in g.inputs(u):
                for r in g.readers(value):
                    if r in frontier and r not in group:
                        group.add(r)
                        queue.append(r)
        return group

    def _group_inputs(self, group: set[Node]) -> list[Node]:
        return list(dict.fromkeys(v for u in self.g.joint.sorted(group) for v in self.g.inputs(u)))

    def _allocated(self, group: set[Node]) -> int:
        g = self.g
        total = 0
        for u in group:
            total += sum(g.cost(v) for v in g.outputs(u) if g.readers(v))
        for v in self._group_inputs(group):
            if any(r not in group for r in g.readers(v)):
                total += g.cost(v)
        return total

    def _released(self, group: set[Node]) -> int:
        g = self.g
        return sum(
            g.cost(v) for v in self._group_inputs(group) if all(r in group for r in g.readers(v))
        )
