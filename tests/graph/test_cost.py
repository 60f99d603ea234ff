import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from torch import fx, nn

from mirrorgrad.bench import models
from mirrorgrad.graph.cost import H100, H200, DeviceRates, OpCost, StepCost, op_cost, rates_for
from mirrorgrad.graph.joint import op_name

sys.path.insert(0, str(Path(__file__).parents[1] / "mirror"))
from joint_graphs import joint_of, joint_of_compiled

aten = torch.ops.aten
RATES = DeviceRates(matmul_flops_per_s=1e12, vector_flops_per_s=1e11, bytes_per_s=1e11)


def _node(target, *arg_shapes, out_shape, **kwargs):
    g = fx.Graph()
    args = []
    for i, shape in enumerate(arg_shapes):
        if isinstance(shape, tuple):
            p = g.placeholder(f"a{i}")
            p.meta["val"] = torch.empty(shape, device="meta")
            args.append(p)
        else:
            args.append(shape)
    n = g.call_function(target, tuple(args), kwargs)
    n.meta["val"] = torch.empty(out_shape, device="meta")
    return n


def test_mm_flops_and_time():
    n = _node(aten.mm.default, (512, 512), (512, 512), out_shape=(512, 512))
    cost = op_cost(n, RATES)
    assert cost.flops == 2 * 512**3  # one normalised matmul unit, twice (multiply-add)
    assert cost.bytes == 3 * 2**20
    assert cost.seconds == pytest.approx(2 * 512**3 / 1e12)


def test_convolution_flops():
    # 2 * batch * C_out * C_in * kH * kW * H_out * W_out
    n = _node(
        aten.convolution.default,
        (2, 3, 8, 8),
        (4, 3, 3, 3),
        None,
        [1, 1],
        [1, 1],
        [1, 1],
        False,
        [0, 0],
        1,
        out_shape=(2, 4, 8, 8),
    )
    assert op_cost(n, RATES).flops == 2 * 2 * 4 * 3 * 3 * 3 * 8 * 8
    # at the convolution rate, not the matmul rate
    slow = DeviceRates(matmul_flops_per_s=1e12, conv_flops_per_s=1e9, bytes_per_s=1e15)
    assert op_cost(n, slow).seconds == pytest.approx(2 * 2 * 4 * 3 * 3 * 3 * 8 * 8 / 1e9)


def test_pointwise_is_memory_bound():
    n = _node(aten.gelu.default, (512, 512), out_shape=(512, 512))
    cost = op_cost(n, RATES)
    assert cost.flops == 512 * 512
    assert cost.seconds == pytest.approx(2 * 2**20 / 1e11)


def _by_op(joint, packet):
    return [n for n in joint.forward if getattr(n.target, "__name__", "").startswith(packet)]


def test_fused_cost_of_an_inlined_op_is_its_arithmetic():
    # x -> mm -> mul -> relu -> mm: mul's output is read by relu alone, forward and
    # backward (relu's backward reads relu's output), so Inductor computes it inside
    # relu's kernel; relu's output feeds a matmul and is written, reading mm's output.
    model = nn.Sequential(nn.Linear(64, 64, bias=False), _Scale(), nn.ReLU(), nn.Linear(64, 8))
    joint = joint_of(model, torch.randn(32, 64))
    costs = StepCost(joint, RATES, fusion=True)
    (mul,) = _by_op(joint, "mul")
    (relu,) = _by_op(joint, "relu")
    assert mul in costs.inlined and relu not in costs.inlined
    assert costs.run(mul) == OpCost(flops=32 * 64, bytes=0, seconds=32 * 64 / 1e11)
    fp32 = 4
    assert costs.run(relu).bytes == 2 * 32 * 64 * fp32  # reads mm's output, writes its own
    unfused = StepCost(joint, RATES, fusion=False)
    assert not unfused.inlined and unfused.run(mul) == op_cost(mul, RATES)
    assert costs.step_seconds < unfused.step_seconds


class _Scale(nn.Module):
    def forward(self, x):
        return x * 2.0


def test_views_cost_nothing():
    n = _node(aten.t.default, (512, 256), out_shape=(256, 512))
    assert op_cost(n, RATES).seconds == 0.0


def test_rates_must_be_positive():
    with pytest.raises(ValueError, match="bytes_per_s"):
        DeviceRates(bytes_per_s=0)


def test_rates_follow_the_device():
    cpu = rates_for(torch.device("cpu"))  # an H100's rates, no kernel launches
    assert cpu.launch_s == 0 and H100.launch_s > 0
    assert dataclasses.replace(cpu, launch_s=H100.launch_s) == H100
    assert H200.bytes_per_s > H100.bytes_per_s
    assert H200.matmul_flops_per_s == H100.matmul_flops_per_s


class _LinearCrossEntropy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.decoder = nn.Linear(8, 50)

    def forward(self, hidden, target):
        from mirrorgrad.ops import linear_cross_entropy

        return linear_cross_entropy(hidden, self.decoder.weight, self.decoder.bias, target, 6)


def test_custom_op_bytes_come_from_its_declared_formula():
    """The chunked loss op moves its [rows, vocab] logits several times though it reads
    and writes only [rows]-sized tensors: op_cost and StepCost take its bytes formula."""
    from mirrorgrad import formulas

    joint = joint_of(_LinearCrossEntropy(), torch.randn(20, 8), torch.randint(0, 50, (20,)))
    nodes = [n for n in joint.gm.graph.nodes if "linear_cross_entropy" in str(n.target)]
    assert len(nodes) == 2  # forward and backward
    for n in nodes:
        declared = formulas.bytes_formula(n.target)(*[_meta(a) for a in n.args])
        assert declared > 20 * 50 * 4  # at least the logits once
        assert op_cost(n, RATES).bytes == declared
        assert StepCost(joint, RATES, fusion=True).run(n).bytes == declared
    assert op_cost(nodes[0], RATES).flops == 2 * 20 * 8 * 50


def _meta(a):
    if isinstance(a, fx.Node):
        return a.meta["val"]
    if isinstance(a, (list, tuple)):
        return type(a)(_meta(x) for x in a)
    return a


class _HeadCrossEntropy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(64, 1000)

    def forward(self, x, target):
        return nn.functional.cross_entropy(self.head(x), target)


def test_inductor_lowerings_that_are_pointwise_are_inlined():
    # The loss's backward scatters -1 onto a zero-filled [N, V] buffer: Inductor's
    # scatter_upon_const_tensor computes both inside the log-softmax backward kernel,
    # and the target's gather inside the loss reduction: none is written to memory.
    joint = joint_of(
        _HeadCrossEntropy(), torch.randn(32, 64), torch.randint(0, 1000, (32,)), decompose=True
    )
    inlined_ops = {n.target.overloadpacket.__name__ for n in StepCost(joint, fusion=True).inlined}
    assert {"full", "scatter", "gather"} <= inlined_ops
    # The logits and their gradient feed matmuls: they are written.
    assert "mm" not in inlined_ops and "addmm" not in inlined_ops


class _PaddedHead(nn.Module):
    """A pointwise value padded for a matmul, as Inductor's pad_mm pads the logits
    gradient of a vocabulary that is no multiple of 4 (GPT-2's 50,257)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(67, 16))

    def forward(self, x):
        return nn.functional.pad(torch.tanh(x) * 2, (0, 3)) @ self.weight


def test_a_padded_pointwise_value_is_computed_inside_the_pad():
    joint = joint_of(_PaddedHead(), torch.randn(8, 64), decompose=True)
    inlined = StepCost(joint, fusion=True).inlined
    pads = [n for n in joint.gm.graph.nodes if op_name(n).endswith("constant_pad_nd")]
    assert pads
    for pad in pads:
        producer = pad.args[0]
        assert producer in inlined  # written once, padded, by the pad's kernel
        assert pad not in inlined  # the matmul reads it from memory


class _PointwiseChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        h = self.a(x)
        return self.b(torch.tanh(h * 2 + 1) * torch.sigmoid(h)).sum()


def test_a_recomputed_op_written_to_memory_costs_at_least_a_launch():
    joint = joint_of(_PointwiseChain(), torch.randn(8, 16), decompose=True)
    cost = StepCost(joint, H100, fusion=True)
    floored = inline = 0
    for n in joint.forward:
        run, again = cost.run(n).seconds, cost.recomputed(n).seconds
        if n in cost.inlined or run == 0:
            assert again == run
            inline += n in cost.inlined
        else:
            assert again == max(run, H100.launch_s)
            floored += run < H100.launch_s
    assert floored and inline  # tiny ops: both kinds occur
    on_cpu = StepCost(joint, rates_for(torch.device("cpu")), fusion=True)
    assert all(on_cpu.recomputed(n) == on_cpu.run(n) for n in joint.forward)


def test_a_recomputed_layer_norm_reads_a_written_out_chain_in_every_block():
    # The residual stream is inlined add after add; priced through the whole chain, the
    # last block's LayerNorm read every earlier block's values when recomputed, and
    # balance recomputed the first blocks' LayerNorms only (a kernel variant per half).
    torch.manual_seed(0)
    blocks = 6
    model = models.TransformerLM(vocab=64, width=32, heads=2, layers=blocks, length=16, dropout=0)
    tokens = torch.randint(0, 64, (2, 17))
    joint = joint_of_compiled(model, tokens[:, :-1], tokens[:, 1:], decompose=True)
    cost = StepCost(joint, RATES, fusion=True)  # no launch floor: bytes set the price
    outputs = {}  # block -> its first LayerNorm's output, the last node of ln1
    for n in joint.forward:
        path = str(list((n.meta.get("nn_module_stack") or {None: ("",)}).values())[-1][0])
        if path.endswith(".ln1") and n.op == "call_function":
            outputs[int(path.split(".")[-2])] = n
    assert sorted(outputs) == list(range(blocks))
    assert all(n not in cost.inlined for n in outputs.values())  # the qkv matmul reads it
    seconds = [cost.recomputed(outputs[b]).seconds for b in range(blocks)]
    # The first blocks are within reach of the graph's start: fewer values to read.
    assert seconds[3:] == pytest.approx([seconds[3]] * (blocks - 3), rel=1e-9)
    # In the forward the chain is priced as it runs there.
    assert cost.run(outputs[blocks - 1]).seconds > cost.run(outputs[0]).seconds
