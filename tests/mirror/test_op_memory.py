"""The RNN op's memory mode chosen by the planner (mirror/op_memory.py)."""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import mirrorgrad.nn as mnn
from mirrorgrad import _compat
from mirrorgrad.graph.joint import JointGraph
from mirrorgrad.mirror.op_memory import choose_op_memory
from mirrorgrad.ops.rnn.cells import GATES

sys.path.insert(0, str(Path(__file__).parent))
from joint_graphs import joint_of_compiled

T, B, N_IN, H = 5, 3, 4, 6


class _Lm(nn.Module):
    def __init__(self, memory: str = "auto", layers: int = 2) -> None:
        super().__init__()
        self.rnn = mnn.LSTM(N_IN, H, num_layers=layers, impl="reference", memory=memory)
        self.out = nn.Linear(H, 1)

    def forward(self, x):
        return self.out(self.rnn(x)[0]).square().mean()


def _rnn_nodes(gm, name):
    return [n for n in gm.graph.nodes if n.target is getattr(torch.ops.mirrorgrad, name).default]


def test_auto_reaches_the_compiled_graph_and_explicit_memory_is_left_alone():
    joint = joint_of_compiled(_Lm(), torch.randn(T, B, N_IN))
    assert [n.args[12] for n in _rnn_nodes(joint.gm, "rnn_forward")] == ["auto"]
    explicit = joint_of_compiled(_Lm("stash"), torch.randn(T, B, N_IN))
    assert choose_op_memory(explicit.gm, mode="balance", step_seconds=1.0) == []


def _saved_shapes(gm):
    (backward,) = _rnn_nodes(gm, "rnn_backward")
    return [tuple(n.meta["val"].shape) for n in backward.args[10]]


@pytest.mark.parametrize(
    ("options", "choice"),
    [
        ({"mode": "balance", "step_seconds": 1.0}, "recompute"),  # time to spare
        ({"mode": "balance", "step_seconds": 1.0, "max_overhead": 0.0}, "stash"),
        ({"mode": "budget", "step_seconds": 1.0, "peak_bytes": 10**6, "budget_bytes": 10**5},
         "recompute"),
        ({"mode": "budget", "step_seconds": 1.0, "peak_bytes": 10**5, "budget_bytes": 10**6},
         "stash"),
        ({"mode": "off", "step_seconds": 1.0}, "stash"),
    ],
)
def test_choice_rewrites_forward_backward_and_saved_outputs(options, choice):
    joint = joint_of_compiled(_Lm(), torch.randn(T, B, N_IN))
    (decided,) = choose_op_memory(joint.gm, **options)
    assert decided.choice == choice and decided.reason == options["mode"]
    (forward,) = _rnn_nodes(joint.gm, "rnn_forward")
    (backward,) = _rnn_nodes(joint.gm, "rnn_backward")
    assert forward.args[12] == backward.args[17] == choice
    # reference layout per layer: stash (gates [T,B,4H], cells [T,B,H]), recompute (cells);
    # then layer 0's output.
    per_layer = [(T, B, GATES["lstm"] * H), (T, B, H)] if choice == "stash" else [(T, B, H)]
    assert _saved_shapes(joint.gm) == [*per_layer, (T, B, H), *per_layer]
    gates = T * B * 4 * H * 4
    assert decided.bytes_saved == (2 * gates if choice == "recompute" else 0)
    assert (decided.added_seconds > 0) == (choice == "recompute")
    JointGraph.from_fx(joint.gm, joint.num_fwd_outputs)  # still a well-formed joint graph


def test_mark_mirror_false_pins_stash():
    joint = joint_of_compiled(_Lm(), torch.randn(T, B, N_IN))
    (decided,) = choose_op_memory(joint.gm, mode="balance", step_seconds=1.0,
                                  pinned=lambda node: True)  # fmt: skip
    assert (decided.choice, decided.reason, decided.bytes_saved) == ("stash", "pinned", 0)


@pytest.mark.parametrize("mode", ["balance", "off"])
def test_gradients_do_not_depend_on_the_choice(mode):
    """A backend whose partitioner lets op_memory decide first: same loss and gradients
    as eager (recompute for balance with room, stash for off)."""
    torch.manual_seed(0)
    model = _Lm().double()
    x = torch.randn(T, B, N_IN, dtype=torch.float64)
    decided = []

    def partition(gm, joint_inputs, *, num_fwd_outputs, **kwargs):
        decided.extend(choose_op_memory(gm, mode=mode, step_seconds=1.0))
        return _compat.default_partition(gm, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                                         **kwargs)  # fmt: skip

    def backend(gm, example_inputs):
        return _compat.aot_module_simplified(gm, example_inputs, fw_compiler=_compat.boxed_nop,
                                             bw_compiler=_compat.boxed_nop,
                                             partition_fn=partition)  # fmt: skip

    torch._dynamo.reset()
    loss = torch.compile(model, backend=backend, fullgraph=True)(x)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    ref_loss = model(x)
    ref = torch.autograd.grad(ref_loss, list(model.parameters()))
    assert [d.choice for d in decided] == ["recompute" if mode == "balance" else "stash"]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
