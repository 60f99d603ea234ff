"""Liveness on a hand-built joint graph, with the peak worked out by hand."""

import itertools
import operator
import sys
from pathlib import Path

import pytest
import torch
from torch import fx

from mirrorgrad import _compat
from mirrorgrad.formulas import register_memory_formula
from mirrorgrad.graph import liveness
from mirrorgrad.graph.joint import JointGraph
from mirrorgrad.mirror import PlanOptions, plan
from mirrorgrad.ops.linear_cross_entropy import op as lce_op

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


# --- custom ops that declare their temporaries (mirrorgrad.formulas) ---------------


@torch.library.custom_op("mirrorgrad_test::scratch_sin", mutates_args=())
def _scratch_sin(x: torch.Tensor) -> torch.Tensor:
    return x.sin()


@torch.library.custom_op("mirrorgrad_test::scratch_cos", mutates_args=())
def _scratch_cos(x: torch.Tensor) -> torch.Tensor:
    return x.cos()


@register_memory_formula(torch.ops.mirrorgrad_test.scratch_sin)
def _scratch_sin_bytes(x):
    return 2 * x.numel() * x.element_size()  # 2 MiB for 512x512 fp32


@register_memory_formula(torch.ops.mirrorgrad_test.scratch_cos)
def _scratch_cos_bytes(x):
    return 3 * x.numel() * x.element_size()  # 3 MiB


def _hand_built_with_scratch() -> JointGraph:
    """_hand_built with sin and cos as custom ops declaring 2 and 3 MiB of scratch."""
    joint = _hand_built()
    for n in joint.gm.graph.nodes:
        if n.target == aten.sin.default:
            n.target = torch.ops.mirrorgrad_test.scratch_sin.default
        elif n.target == aten.cos.default:
            n.target = torch.ops.mirrorgrad_test.scratch_cos.default
    return JointGraph.from_fx(joint.gm, num_fwd_outputs=1)


def test_declared_temporaries_add_to_the_op_that_runs():
    # test_peak_with_relu_stashed's timeline [2, 3, 5, 6, 5] MiB, with sin's 2 MiB of
    # scratch while sin runs (3 + 2) and cos's 3 while cos runs (5 + 3, the new peak).
    joint = _hand_built_with_scratch()
    sim = liveness.simulate(joint, _by_name(joint, "relu"), [])
    assert [e.live_bytes // MiB for e in sim.timeline] == [2, 5, 8, 6, 5]
    assert sim.turn_bytes == 3 * MiB  # scratch is gone once the op returns
    assert (sim.peak, sim.peak_phase, sim.peak_node) == (8 * MiB, "backward", "cos")


def test_declared_temporaries_under_fusion():
    # A custom op is never fused away: cos keeps its output and its 3 MiB of scratch.
    joint = _hand_built_with_scratch()
    sim = liveness.simulate(joint, _by_name(joint, "relu"), [], fusion=True)
    assert liveness.temporary_bytes(_by_name(joint, "cos")[0]) == 3 * MiB
    assert sim.peak >= 3 * MiB + 4 * MiB


class _LstmThenLoss(torch.nn.Module):
    """The LM pattern: mirrorgrad.nn.LSTM (reference impl on CPU) and the chunked loss."""

    def __init__(self) -> None:
        super().__init__()
        import mirrorgrad.nn as mnn

        self.rnn = mnn.LSTM(4, 6, impl="reference", memory="recompute")
        self.decoder = torch.nn.Linear(6, 10)

    def forward(self, x, target):
        from mirrorgrad.ops import linear_cross_entropy

        y, _ = self.rnn(x)
        w, b = self.decoder.weight, self.decoder.bias
        return linear_cross_entropy(y, w, b, target, chunk_size=5)


def test_rnn_and_loss_ops_declare_their_temporaries_to_the_simulation(monkeypatch):
    """T=5, B=3, I=4, H=6 float32, one LSTM layer, recompute; 15 rows of 10 classes in
    chunks of 5, the loss's passes over the logits torch's on any machine. Bytes worked
    out by hand from the ops' formulas."""
    monkeypatch.setattr(lce_op, "TRITON_PASSES", ())
    joint = joint_of(_LstmThenLoss(), torch.randn(5, 3, 4), torch.randint(0, 10, (5, 3)))
    declared = {
        str(n.target): liveness.temporary_bytes(n)
        for n in joint.gm.graph.nodes
        if "mirrorgrad." in str(n.target)
    }
    unit = 5 * 3 * 6 * 4  # [T, B, H] fp32
    assert declared == {
        # the input GEMM's [T, B, 4H] and 3 steps' [B, 4H] temporaries, 3 [B, H] states
        "mirrorgrad.rnn_forward.default": 4 * unit + 3 * 3 * 24 * 4 + 3 * 3 * 6 * 4,
        # every gate factor for all steps (14 units) and the rebuilt pre-activations (4)
        "mirrorgrad.rnn_backward.default": 18 * unit,
        # one [5, 10] chunk of logits and logsumexp's temporary
        "mirrorgrad.linear_cross_entropy_forward.default": 2 * 5 * 10 * 4,
        # one chunk of logit gradients and its [5, 6] product with the weight
        "mirrorgrad.linear_cross_entropy_backward.default": 5 * 10 * 4 + 5 * 6 * 4,
    }
    backward = set(joint.backward)
    saved = [n for n in (*joint.primals, *joint.forward) if backward.intersection(n.users)]
    sim = liveness.simulate(joint, saved, [])
    with_scratch = {e.node: e.live_bytes for e in sim.timeline}
    register = liveness.temporary_bytes
    try:
        liveness.temporary_bytes = lambda node: 0
        without = {e.node: e.live_bytes for e in liveness.simulate(joint, saved, []).timeline}
    finally:
        liveness.temporary_bytes = register
    for n in joint.gm.graph.nodes:
        if "mirrorgrad." in str(n.target):
            assert with_scratch[n.name] - without[n.name] == declared[str(n.target)]


def test_list_outputs_of_custom_ops_are_counted_once():
    """rnn_forward returns (y, h_n, c_n, [saved...]) and rnn_backward (..., [grad_w...]):
    the list's elements are allocated by the op itself, so a getitem of the list (or of
    an element) allocates nothing and the live bytes never grow at a getitem."""
    joint = joint_of(_LstmThenLoss(), torch.randn(5, 3, 4), torch.randint(0, 10, (5, 3)))
    backward = set(joint.backward)
    saved = [n for n in (*joint.primals, *joint.forward) if backward.intersection(n.users)]
    sim = liveness.simulate(joint, saved, [])
    nodes = {n.name: n for n in joint.gm.graph.nodes}
    timeline = sim.timeline
    nested = 0
    for before, event in itertools.pairwise(timeline):
        node = nodes[event.node]
        if node.target is operator.getitem:
            nested += isinstance(node.meta.get("val"), (list, tuple))
            assert event.live_bytes <= before.live_bytes, event.node
    assert nested == 2  # the forward's saved list and the backward's weight gradients


def test_the_loss_gradient_is_written_over_the_saved_log_softmax(monkeypatch):
    # Inductor writes a pointwise kernel's output over an input of the same size that
    # dies there (a saved value is donated to the backward): the log-softmax over the
    # logits, its gradient over the saved log-softmax. One [N, V] buffer at the loss,
    # not two (the suite's Transformer: 1,000 MiB; estimates were 12-14% high).
    n, vocab = 256, 4096
    model = torch.nn.Linear(64, vocab)
    joint = joint_of(
        _CrossEntropy(model), torch.randn(n, 64), torch.randint(0, vocab, (n,)), decompose=True
    )
    p = plan(joint, PlanOptions(mode="off"))
    shared = liveness.simulate(joint, p.saved + p.saved_sym, [], fusion=True).timeline
    monkeypatch.setattr(liveness._Phase, "_in_place", lambda *args: {})
    apart = liveness.simulate(joint, p.saved + p.saved_sym, [], fusion=True).timeline
    saved = {(e.phase, e.node): a.live_bytes - e.live_bytes for e, a in zip(shared, apart)}
    buffer = n * vocab * 4
    # one event in each pass: the log-softmax (forward), its gradient (backward)
    assert sorted(saved.values())[-2:] == [buffer, buffer]
    assert sum(saved.values()) == 2 * buffer
    assert {phase for (phase, _), b in saved.items() if b} == {"forward", "backward"}


class _CrossEntropy(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.model(x), target)


class _TiedLM(torch.nn.Module):
    """Embedding -> Linear -> logits with the embedding's weight: the two weight
    gradients are added, the LM head's (an mm of the logits gradient) at the end."""

    def __init__(self, vocab: int = 256, width: int = 16) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, width)
        self.mid = torch.nn.Linear(width, width)

    def forward(self, tokens, targets):
        logits = torch.nn.functional.linear(self.mid(self.tok(tokens)), self.tok.weight)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_late_addmm_runs_the_product_where_inductor_fuses_it():
    # Stock Inductor fuses add(mm(dlogits.t(), h), embedding_grad) into one addmm at the
    # add: the logits gradient (the largest value) stays alive until the end.
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (4, 33))
    joint = joint_of(_TiedLM(), tokens[:, :-1], tokens[:, 1:], decompose=True)
    saved = [*joint.primals, *joint.forward]
    early = liveness.simulate(joint, saved, [], fusion=True)
    late = liveness.simulate(joint, saved, [], fusion=True, late_addmm=True)
    names = [n.name for n in late.event_nodes]
    (add,) = [n for n in joint.backward if n.target is aten.add.Tensor and n.users == {
        joint.gm.graph.find_nodes(op="output")[0]: None}]
    head = add.args[0]  # permute(permute(mm)): the pair is the identity
    while head.target is not aten.mm.default:
        head = head.args[0]
    assert names.index(head.name) + 3 == names.index(add.name)  # mm, permute, permute, add
    assert [n.name for n in early.event_nodes].index(head.name) < names.index(head.name)
    assert late.peak >= early.peak


class _HFTiedLM(torch.nn.Module):
    """A tied-head LM with Hugging Face's causal loss: labels padded with -100 and
    shifted by one, cross-entropy over the [tokens, vocab] logits."""

    def __init__(self, vocab: int, width: int = 16) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, width)
        self.mid = torch.nn.Linear(width, width)

    def forward(self, tokens):
        logits = torch.nn.functional.linear(torch.tanh(self.mid(self.tok(tokens))), self.tok.weight)
        labels = torch.nn.functional.pad(tokens, (0, 1), value=-100)[:, 1:]
        return torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=-100
        )


@pytest.fixture
def as_on_a_gpu():
    """Captured and laid out as on a GPU: pad_mm pads the vocabulary to a multiple of 4
    for the logits matmul (N) and the dX matmul (K), not the head's weight gradient (M
    only), as on the H100; strides padded as there."""
    from mirrorgrad.graph import fusion

    with _compat.gpu_shape_padding(), fusion.strides_as_on_a_gpu():
        yield


@pytest.mark.slow
def test_the_logits_gradient_is_one_buffer_with_pad_mms_padding(as_on_a_gpu):
    # H100, GPT-2 budget 0.5 (logits recomputed in the backward): one (8192, 50260)
    # buffer at stride 50272 holds the recomputed logits, the gradient written over them
    # and the pad's three zero columns; the model counted two (+27%, 6,088 for 4,788).
    vocab, rows = 2049, 64  # rows of 2049 floats: strides padded to 2080
    from mirrorgrad.bench.frontier import capture_joint

    torch.manual_seed(0)
    joint = capture_joint(_HFTiedLM(vocab), torch.randint(0, vocab, (2, 32)))
    pads = [n for n in joint.backward if n.target is aten.constant_pad_nd.default]
    assert any(n.args[0].target is aten.sub.Tensor for n in pads), "pad_mm did not pad dX"
    big = rows * vocab * 4
    # Recompute every forward value of the logits' size; stash the rest.
    mirrored = [n for n in joint.forward if joint.nbytes(n) >= big * 0.9]
    saved = [*joint.primals, *(n for n in joint.forward if n not in mirrored)]
    ix = liveness.GraphIndex(joint)
    grad = next(n.args[0] for n in pads if n.args[0].target is aten.sub.Tensor)
    pad = next(p for p in pads if p.args[0] is grad)
    assert ix.storage[ix.ix[pad]] == ix.ix[grad]  # the pad writes into the gradient's rows
    sim = liveness.simulate(joint, saved, mirrored, fusion=True, index=ix)
    at_grad = next(
        i for i, n in enumerate(sim.event_nodes) if n is grad and i >= sim.forward_events
    )
    seen = liveness.simulate(joint, saved, mirrored, fusion=True, index=ix, live_at=at_grad)
    logits_sized = [n.name for n, b in seen.live_storages.items() if b >= big * 0.9]
    assert len(logits_sized) == 1, logits_sized
    assert sim.peak < sim.turn_bytes + 1.5 * big
