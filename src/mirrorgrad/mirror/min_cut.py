"""torch.compile's own partition of a joint graph (min-cut, ``activation_memory_budget``)
and its peak by our liveness model: what balance's target and the frontier bench
compare our plans with, judged as ours are.

Running min-cut costs seconds on a 10k-node graph, so ``compile`` never does:
``explain``'s diagnosis of balance (``balance_target.py``) and the frontier bench do.
"""

from __future__ import annotations

import copy

from torch.fx import Node

from mirrorgrad import _compat
from mirrorgrad.graph import liveness
from mirrorgrad.graph.joint import JointGraph


def min_cut_partition(joint: JointGraph, fraction: float = 1.0) -> tuple[set, set]:
    """(saved, recomputed) forward values of min-cut's partition at ``fraction`` (1.0:
    torch.compile's default)."""
    with _compat.activation_memory_budget(fraction):
        fwd, _ = _compat.min_cut_rematerialization_partition(
            copy.deepcopy(joint.gm), None, num_fwd_outputs=joint.num_fwd_outputs
        )
    by_name = {n.name: n for n in joint.gm.graph.nodes}
    outputs = next(n for n in fwd.graph.nodes if n.op == "output").args[0]
    saved = {
        v
        for a in outputs[joint.num_fwd_outputs :]
        if a is not None
        for v in _forward_values(joint, by_name[a.name])
    }
    # What the backward reads and min-cut did not save, it recomputes.
    recomputed, stack = set(), [a for n in joint.backward for a in n.all_input_nodes]
    while stack:
        v = stack.pop()
        if v.op == "placeholder" and v not in joint.tangents:
            saved.add(v)
        if v in saved or v in recomputed or v not in joint.forward_set:
            continue
        recomputed.add(v)
        stack.extend(v.all_input_nodes)
    return saved, recomputed


def min_cut_peak(
    joint: JointGraph,
    fraction: float = 1.0,
    *,
    fusion: bool = True,
    index: liveness.GraphIndex | None = None,
) -> int:
    """Min-cut's partition at ``fraction`` simulated (``partition_peak``)."""
    return partition_peak(joint, *min_cut_partition(joint, fraction), fusion=fusion, index=index)


def partition_peak(
    joint: JointGraph,
    saved: set,
    recomputed: set,
    *,
    fusion: bool = True,
    index: liveness.GraphIndex | None = None,
) -> int:
    """The peak of a min-cut partition by the liveness model our plans are judged by
    (``fusion``, ``index`` as theirs), its backward as stock Inductor runs it (late
    ``addmm``s fused: our plans split them, min-cut's do not)."""
    sim = liveness.simulate(joint, saved, recomputed, fusion=fusion, index=index, late_addmm=True)
    return sim.peak


def _forward_values(joint: JointGraph, value: Node) -> set[Node]:
    """The forward values (or primals) that a value min-cut saves stands for.

    Min-cut may save a value the joint graph puts in its backward but that reads no
    tangent: its forward module computes it. Most are views (``permute(probs)``, the
    transposed operand of a gradient matmul), whose storage is the forward value's;
    judged as the backward's, such a view would leave the forward value unsaved and its
    whole chain, matmuls included, recomputed. The liveness model runs no backward node
    in the forward, so a non-view one (``ne(target, ignore_index)``) stands for the
    forward values it reads: its bytes are taken for theirs."""
    found, stack = set(), [value]
    while stack:
        v = stack.pop()
        if v.op == "placeholder" or v in joint.forward_set:
            found.add(v)
        else:
            stack.extend(v.all_input_nodes)
    return found
