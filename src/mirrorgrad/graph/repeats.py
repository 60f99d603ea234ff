"""Repeated blocks: which nodes of a joint graph are the same op at the same place in
blocks that repeat (a Transformer's layers, a ResNet stage's bottlenecks).

Inductor compiles one kernel per distinct piece of generated code, and identical
blocks give identical code: a plan that recomputes the same ops in every copy of a
block keeps that reuse, one that differs from block to block multiplies the kernels
the backward compiles (docs/planner.md, "Repeated blocks"). The planner uses these
classes to make its decisions the same in every copy.

Where the graph was traced by Dynamo, a node's module path says which copy it is in:
nodes of modules whose paths differ only in their indices (``blocks.3.ln1``,
``blocks.7.ln1``) are the same op at the same place when they are the same op with the
same output at the same position among that module's nodes. This covers every copy,
the first and the last included. Other nodes (no module path, or one without an index)
are classed by Weisfeiler-Lehman refinement: a node starts from its op, its
output's shape and dtype and its constant arguments; each round adds the labels of
its inputs (in argument order) and of its readers. After ``ROUNDS`` rounds two nodes
share a label when their neighbourhoods of that radius match: nodes in the middle
copies of a block do, nodes near the graph's ends (the first block, the last) differ.
Parameters are told apart by shape only, so the copies' weights look alike.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict

import torch
from torch.fx import Node

from mirrorgrad import _compat
from mirrorgrad.graph.joint import JointGraph

# Radius of the neighbourhood that must match. A block has tens of nodes along its
# path, so three hops tell apart the ops of one block (a LayerNorm before attention
# reads the residual stream and feeds a 3d-wide matmul, the one before the MLP a 4d
# one) without letting the graph's ends reach the middle copies.
ROUNDS = 3


def _describe(value: object) -> object:
    """A hashable summary of an argument: nodes count only through their labels."""
    if isinstance(value, Node):
        return "node"
    if isinstance(value, (list, tuple)):
        return tuple(_describe(v) for v in value)
    if isinstance(value, torch.Tensor):
        return ("tensor", _tensor_label(value))
    if isinstance(value, (int, float, bool, str, type(None), torch.dtype, torch.device)):
        return value
    return type(value).__name__


def _tensor_label(t: torch.Tensor) -> tuple:
    # str: a symbolic size (SymInt) is not hashable; its expression is.
    return (tuple(str(d) for d in t.shape), str(t.dtype))


def _value_label(val: object) -> object:
    if isinstance(val, torch.Tensor):
        return _tensor_label(val)
    if isinstance(val, (list, tuple)):
        return tuple(_value_label(v) for v in val)
    return type(val).__name__


def _initial_label(node: Node) -> object:
    if node.op == "placeholder":
        return ("placeholder", _value_label(node.meta.get("val")))
    if node.target is _compat.inductor_lookup_seed_op():
        # The seed's index differs in every copy of a block: counted, it would tell
        # apart every node within reach of a dropout.
        return (node.op, str(node.target))
    args = tuple(_describe(a) for a in node.args)
    kwargs = tuple(sorted((k, _describe(v)) for k, v in node.kwargs.items()))
    return (node.op, str(node.target), _value_label(node.meta.get("val")), args, kwargs)


def repeat_labels(joint: JointGraph, rounds: int = ROUNDS) -> dict[Node, int]:
    """A label per node of ``joint``; equal labels mark the same op in repeated blocks."""
    nodes = [n for n in joint.gm.graph.nodes if n.op != "output"]
    label = {n: hash(_initial_label(n)) for n in nodes}
    for _ in range(rounds):
        label = {
            n: hash(
                (
                    label[n],
                    tuple(label.get(a, 0) for a in n.all_input_nodes),
                    tuple(sorted(label[u] for u in n.users if u in label)),
                )
            )
            for n in nodes
        }
    return label


# An index in a module path: ``.3`` (nn.Sequential, nn.ModuleList) or ``[3]``.
_INDEX = re.compile(r"\.\d+(?=\.|$)|\[\d+\]")


def module_labels(nodes: list[Node]) -> dict[Node, tuple]:
    """A label per node of ``nodes`` that lies in an indexed module (a copy of a
    repeated block): its module path with indices wildcarded, its op, its output and
    how many nodes of that op came before it in the same module."""
    seen: Counter = Counter()
    label = {}
    for n in nodes:
        stack = n.meta.get("nn_module_stack")
        if not stack:
            continue
        path = str(next(reversed(stack.values()))[0])
        pattern = _INDEX.sub(".*", path)
        if pattern == path:
            continue
        op = str(n.target)
        seen[path, op] += 1
        label[n] = (pattern, op, _value_label(n.meta.get("val")), seen[path, op])
    return label


def repeated_classes(joint: JointGraph, nodes: list[Node]) -> list[list[Node]]:
    """``nodes`` grouped by label (their module's where they have one, else their
    Weisfeiler-Lehman label), groups of two or more only, in graph order."""
    by_module = module_labels(nodes)
    label = repeat_labels(joint)
    groups: dict[object, list[Node]] = defaultdict(list)
    for n in nodes:
        groups[("module", by_module[n]) if n in by_module else label[n]].append(n)
    return [g for g in groups.values() if len(g) > 1]
