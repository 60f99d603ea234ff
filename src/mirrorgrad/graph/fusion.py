"""Which values a fusing compiler (Inductor) computes in registers, never in memory.

Inductor inlines a pointwise op into the kernels of its readers when every reader
can take it (pointwise ops, the reductions it fuses with their producers, views)
and there are at most a few of them (``realize_reads_threshold``). An extern kernel
(mm, convolution, attention) reads its inputs from memory, so a value it reads is
written there. This is a rule of thumb, not Inductor's scheduler: the liveness
simulation and the cost model both use it, so they agree with each other.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from mirrorgrad import _compat
from mirrorgrad.graph.joint import is_view, op_name

# Reductions Inductor fuses with the pointwise ops that feed them.
FUSIBLE_REDUCTIONS = frozenset(
    ("sum", "mean", "amax", "amin", "var_mean", "var", "prod", "any", "all", "logsumexp")
)
# Inductor inlines a pointwise value into its readers unless it has more than this
# many (torch._inductor.config.realize_reads_threshold).
INLINE_READERS = 4


def is_pointwise(node: Node) -> bool:
    target = node.target
    return isinstance(target, _compat.OpOverload) and torch.Tag.pointwise in target.tags


def fusible_reader(node: Node) -> bool:
    """``node`` can compute a pointwise input inside its own kernel."""
    if is_view(node):
        return True
    return is_pointwise(node) or op_name(node).split("::")[-1] in FUSIBLE_REDUCTIONS


def inlined(node: Node, readers: list[Node]) -> bool:
    """A pointwise ``node`` whose (non-view) ``readers`` all compute it in registers."""
    if not is_pointwise(node) or is_view(node):
        return False
    direct = [r for r in readers if not is_view(r)]
    return len(direct) <= INLINE_READERS and all(fusible_reader(r) for r in direct)
