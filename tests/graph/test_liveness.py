"""Liveness on a hand-built joint graph, with the peak worked out by hand."""

import sys
from pathlib import Path

import torch
from torch import fx

from mirrorgrad import _compat
from mirrorgrad.graph import liveness
from mirrorgrad.graph.joint import JointGraph
from mirrorgrad.mirror.budget_search import PlanOptions, plan

sys.path.insert(0, str(Path(__file__).parents[1] / "mirror"))
from joint_graphs import LayerNormGeluLinear, joint_of

aten = torch.ops.aten
MiB = 2**20  # a 512x512 fp32 tensor


def _hand_built() -> JointGraph:
    """y = sin(relu(x)); backward: dx = threshold_backward(dy * cos(relu(x)), relu(x))."""
    g = fx.Graph()
    val = torch.empty(512, 512, device="meta")

    def node(n, tag):
        n.meta["val"] = val
        n.meta["partitioner_tag"] = tag
        return n

    x = node(g.placeholder("primals_1"), "is_forward")
    dy = node(g.placeholder("tangents_1"), "is_backward")

    def op(target, args, name, tag):
        return node(g.create_node("call_function", target, args, name=name), tag)

    relu = op(aten.relu.default, (x,), "relu", "is_forward")
    y = op(aten.sin.default, (relu,), "sin", "is_forward")
    cos = op(aten.cos.default, (relu,), "cos", "is_backward")
    mul = op(aten.mul.Tensor, (dy, cos), "mul", "is_backward")
    dx = op(aten.threshold_backward.default, (mul, relu, 0), "threshold_backward", "is_backward")
    g.output([y, dx])
    return JointGraph.from_fx(fx.GraphModule(torch.nn.Module(), g), num_fwd_outputs=1)


def _by_name(joint, *names):
    nodes = {n.name: n for n in joint.gm.graph.nodes}
    return [nodes[n] for n in names]


def test_roles_of_the_hand_built_graph():
    joint = _hand_built()
    assert [n.name for n in joint.primals] == ["primals_1"]
    assert [n.name for n in joint.tangents] == ["tangents_1"]
    assert [n.name for n in joint.forward] == ["relu", "sin"]
    assert [n.name for n in joint.backward] == ["cos", "mul", "threshold_backward"]
    assert joint.nbytes(joint.forward[0]) == MiB


def test_roles_without_partitioner_tags():
    joint = _hand_built()
    for n in joint.gm.graph.nodes:
        n.meta.pop("partitioner_tag", None)
    untagged = JointGraph.from_fx(joint.gm, num_fwd_outputs=1)
    assert [n.name for n in untagged.forward] == ["relu", "sin"]
    assert [n.name for n in untagged.backward] == ["cos", "mul", "threshold_backward"]


def test_peak_with_relu_stashed():
    # forward: x (1) + relu (1) + sin (1) = 3 MiB at the turn (relu saved, sin returned);
    # backward: + dy = 4, + cos = 5, + mul = 6 (peak); dy and cos die -> 4; + dx = 5.
    joint = _hand_built()
    sim = liveness.simulate(joint, _by_name(joint, "relu"), [])
    assert sim.turn_bytes == 3 * MiB
    assert sim.peak == 6 * MiB
    assert (sim.peak_phase, sim.peak_node) == ("backward", "mul")
    assert [e.live_bytes // MiB for e in sim.timeline] == [2, 3, 5, 6, 5]


def test_peak_with_relu_recomputed():
    # forward frees relu after sin: turn = x + sin = 2 MiB. backward recomputes relu
    # just before its first use: + dy = 3, relu 4, cos 5, mul 6 (peak), dx 5.
    joint = _hand_built()
    (x, relu) = _by_name(joint, "primals_1", "relu")
    sim = liveness.simulate(joint, [x], [relu])
    assert sim.turn_bytes == 2 * MiB
    assert sim.peak == 6 * MiB
    assert [e.node for e in sim.timeline[2:]] == ["relu", "cos", "mul", "threshold_backward"]
    assert [e.live_bytes // MiB for e in sim.timeline] == [2, 3, 4, 5, 6, 5]


def test_fusion_keeps_pointwise_intermediates_out_of_memory():
    # Inductor computes cos and dy * cos inside threshold_backward's kernel; relu, when
    # it is not saved, inside sin's (forward) and the backward's kernels. Stashed:
    # x, relu, sin = 3 at the turn, + dy = 4 while cos and mul run in registers; that
    # kernel reads dy and writes dx: 5. Recomputed: never allocated, 1 MiB less.
    joint = _hand_built()
    (x, relu) = _by_name(joint, "primals_1", "relu")
    stashed = liveness.simulate(joint, [relu], [], fusion=True)
    assert [e.live_bytes // MiB for e in stashed.timeline] == [2, 3, 4, 4, 5]
    recomputed = liveness.simulate(joint, [x], [relu], fusion=True)
    assert [e.live_bytes // MiB for e in recomputed.timeline] == [1, 2, 3, 3, 3, 4]
    assert (stashed.peak, recomputed.peak) == (5 * MiB, 4 * MiB)


def test_backward_schedule_matches_the_autograd_engine_reordering():
    model = torch.nn.Sequential(*(LayerNormGeluLinear(64, 64) for _ in range(3)))
    joint = joint_of(model, torch.randn(256, 64))
    p = plan(joint, PlanOptions(mode="balance", max_overhead=1.0))
    assert p.mirrored
    _, bwd = _compat.extract_fwd_bwd_modules(
        joint.gm, list(p.saved), list(p.saved_sym), num_fwd_outputs=joint.num_fwd_outputs
    )
    reordered = _compat.reordering_to_mimic_autograd_engine(bwd)
    real = [n.name for n in reordered.graph.nodes if n.op == "call_function"]
    ours = liveness.backward_schedule(joint, p.saved + p.saved_sym, p.mirrored)
    assert [n.name for n in ours] == real
