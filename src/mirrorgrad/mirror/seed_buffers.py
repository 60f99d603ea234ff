"""Each dropout seed of a planned forward graph in a buffer of its own.

Inductor's joint-graph passes give each draw its seed as
``inductor_lookup_seed(seeds, k)``, which Inductor computes inside the kernel that
draws: the index ``k`` is then a constant of that kernel's code, so the dropout
kernels of repeated blocks differ by it and none is shared (GPT-2 at batch 1, length
128 on a CPU: 57-58 distinct kernels under our plans, 38 under torch.compile, whose
forward happened to draw its stashed masks in a few early kernels). Here one extern op
splits the seeds into one 0-d tensor each, before any draw: every kernel reads its seed
from an input, and the copies of a block compile to one kernel (25 on that GPT-2).
The seeds are the same values, so the draws are too.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule

from mirrorgrad import _compat


@torch.library.custom_op("mirrorgrad::seed_scalars", mutates_args=())
def seed_scalars(seeds: torch.Tensor, count: int) -> list[torch.Tensor]:
    """The first ``count`` of ``seeds``, each a 0-d tensor of its own."""
    return [s.clone() for s in seeds[:count].unbind()]


@seed_scalars.register_fake
def _(seeds: torch.Tensor, count: int) -> list[torch.Tensor]:
    return [seeds.new_empty(()) for _ in range(count)]


def give_seeds_their_own_buffers(gm: GraphModule) -> None:
    """Replace ``gm``'s seed lookups by the outputs of one ``seed_scalars`` per seeds
    tensor, placed right after it."""
    lookup = _compat.inductor_lookup_seed_op()
    graph = gm.graph
    by_seeds: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in graph.find_nodes(op="call_function", target=lookup):
        by_seeds.setdefault(node.args[0], []).append(node)
    for seeds, lookups in by_seeds.items():
        count = max(n.args[1] for n in lookups) + 1
        with graph.inserting_after(seeds):
            split = graph.call_function(torch.ops.mirrorgrad.seed_scalars.default, (seeds, count))
        split.meta["val"] = [seeds.meta["val"].new_empty(()) for _ in range(count)]
        last = split
        for node in lookups:
            with graph.inserting_after(last):
                last = graph.call_function(operator.getitem, (split, node.args[1]))
            last.meta["val"] = node.meta["val"]
            node.replace_all_uses_with(last)
            graph.erase_node(node)
    if by_seeds:
        gm.recompile()
