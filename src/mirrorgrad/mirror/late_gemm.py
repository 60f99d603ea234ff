"""Undo Inductor's ``add(mm(a, b), c) -> addmm(c, a, b)`` where it keeps a large input
alive: a post-grad pass on planned backward graphs.

Inductor's post-grad patterns fuse a matrix product with the add that reads it, and the
fused kernel runs where the add was: once ``c`` exists. With a tied embedding, the LM
head's weight gradient ``mm(dlogits.t(), h)`` is added to the embedding's gradient,
which the backward produces last, so the [tokens, vocab] logits gradient (1,000 MiB on
the suite's transformer) stays alive through the whole backward (measured on an
H100). The planner's liveness model runs the product where autograd does, right
after its inputs; this pass puts it there again, so the plan's estimate holds and the
step's peak drops by the input that now dies early.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from mirrorgrad.graph.joint import is_view, value_nbytes

aten = torch.ops.aten

# Output-node meta key: the graph is a planned backward (set by ``partition._split``).
PLANNED_BACKWARD = "mirrorgrad_planned_backward"


def _root(node: Node) -> Node:
    while is_view(node) and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def _readers(root: Node) -> list[Node]:
    """Non-view nodes reading ``root``'s storage (through any chain of views)."""
    found, stack = [], [root]
    while stack:
        for user in stack.pop().users:
            (stack if is_view(user) else found).append(user)
    return found


def _freed_early(addmm: Node, order: dict[Node, int]) -> tuple[int, Node | None]:
    """Bytes of the product's inputs that the fused kernel is the last to read, and the
    last node that reads them otherwise. Only values the graph computes count: an input
    of the graph may be a view of a parameter, which frees nothing."""
    freed, last = 0, None
    for arg in {_root(a) for a in addmm.args[1:3]}:
        if arg.op != "call_function":
            continue
        others = [r for r in _readers(arg) if r is not addmm]
        if any(order[r] > order[addmm] for r in others):
            continue
        freed += value_nbytes(arg.meta.get("val"))
        for r in [arg, *others]:
            if last is None or order[r] > order[last]:
                last = r
    return freed, last


def _move_before(node: Node, anchor: Node, order: dict[Node, int]) -> None:
    """Place ``node`` (a view chain) before ``anchor`` if it comes after it."""
    for arg in node.all_input_nodes:
        if is_view(arg):
            _move_before(arg, node, order)
    if order[node] > order[anchor]:
        anchor.prepend(node)
        order[node] = order[anchor] - 0.5


def split_late_addmms(graph: Graph) -> int:
    """Split every ``addmm(c, a, b)`` (no scaling) whose ``a`` or ``b`` would otherwise
    die before it, by more bytes than the product's output holds, into ``mm(a, b)``
    placed after those inputs' last other reader and ``add`` where the addmm was.
    Returns how many were split."""
    order: dict[Node, float] = {n: i for i, n in enumerate(graph.nodes)}
    split = 0
    for node in list(graph.nodes):
        if node.target is not aten.addmm.default or node.kwargs or len(node.args) != 3:
            continue
        inp, mat1, mat2 = node.args
        freed, last = _freed_early(node, order)
        if last is None or freed <= value_nbytes(node.meta.get("val")):
            continue
        if not isinstance(inp, Node) or order[_root(inp)] < order[last]:
            continue  # not waiting for ``c``: the fused kernel runs where the product would
        anchor = last.next
        for producer in {_root(mat1), _root(mat2)}:  # views of them are moved below
            if order[producer] >= order[anchor]:
                anchor = producer.next
        with graph.inserting_before(anchor):
            product = graph.call_function(aten.mm.default, (mat1, mat2))
        product.meta = {**node.meta, "val": aten.mm(mat1.meta["val"], mat2.meta["val"])}
        order[product] = order[anchor] - 0.25
        for m in (mat1, mat2):
            _move_before(m, product, order)
        with graph.inserting_before(node):
            total = graph.call_function(aten.add.Tensor, (product, inp))
        total.meta = dict(node.meta)
        order[total] = order[node]
        node.replace_all_uses_with(total)
        graph.erase_node(node)
        split += 1
    return split
