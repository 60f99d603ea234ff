"""The RNN dropout seed stays on the input's device: no CPU tensor, no host sync in a graph."""

import dataclasses

import pytest
import torch
from functorch.compile import make_boxed_compiler
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import default_partition

from mirrorgrad.ops.rnn import op, rnn
from mirrorgrad.train.config import PRESETS
from mirrorgrad.train.model import LanguageModel

triton_only = pytest.mark.skipif(
    op.triton_module() is None
    or not op.triton_module().supports("lstm", proj=False, dtype=torch.float32, device="cpu"),
    reason="the Triton layer on CPU needs triton and TRITON_INTERPRET=1",
)


def _lstm_inputs(T=4, B=3, n_in=5, H=6, layers=2):
    """float32 inputs of a 2-layer LSTM stack (torch.nn's weight order), requiring grad."""
    lstm = torch.nn.LSTM(n_in, H, layers)
    weights = [w.detach().clone().requires_grad_() for w in lstm._flat_weights]
    x = torch.randn(T, B, n_in, requires_grad=True)
    hx = torch.randn(layers, B, H, requires_grad=True)
    cx = torch.randn(layers, B, H, requires_grad=True)
    return x, weights, hx, cx


def _lm_graphs():
    """(Dynamo's graph, AOTAutograd's joint graph) of a small training-mode LM step."""
    preset = dataclasses.replace(PRESETS["medium"], embedding=8, hidden=8)
    model = LanguageModel(50, preset).train()
    tokens, targets = torch.randint(0, 50, (5, 3)), torch.randint(0, 50, (5, 3))
    graphs = {}

    def partition(joint, inputs, **kwargs):
        graphs["joint"] = joint
        return default_partition(joint, inputs, **kwargs)

    aot = aot_autograd(fw_compiler=make_boxed_compiler(lambda gm, _: gm), partition_fn=partition)

    def backend(gm, example_inputs):
        graphs["dynamo"] = gm
        return aot(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    compiled(tokens, targets, model.initial_state(3, "cpu"))
    torch._dynamo.reset()
    return graphs["dynamo"], graphs["joint"]


def test_lm_step_graph_draws_the_seed_on_the_input_device_and_never_syncs():
    dynamo, joint = _lm_graphs()
    draws = [n for n in dynamo.graph.nodes if n.target is torch.randint]
    assert len(draws) == 1, "one seed per LSTM call"
    # Without device= the seed would be a CPU tensor whatever x's device (a host sync in
    # the op, CPU kernels and a CPU tensor that makes Inductor skip CUDA Graphs).
    assert draws[0].kwargs.get("device") is not None
    forward = [n for n in joint.graph.nodes if n.target is torch.ops.mirrorgrad.rnn_forward.default]
    assert len(forward) == 1
    x, seed = forward[0].args[0], forward[0].args[5]
    assert seed.meta["val"].device == x.meta["val"].device
    syncs = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default}
    assert not [n for n in joint.graph.nodes if n.target in syncs]


def test_dispatch_draws_the_seed_from_the_input_device_generator():
    """torch.manual_seed reproduces the masks; another draw gives another mask."""
    x, weights, hx, cx = _lstm_inputs()

    def run(seed):
        torch.manual_seed(seed)
        return rnn(x, weights, hx, cx, mode="lstm", num_layers=2, dropout=0.5, training=True,
                   impl="reference")[0]  # fmt: skip

    assert torch.equal(run(1), run(1))
    assert not torch.equal(run(1), run(2))


@pytest.mark.slow
@triton_only
def test_triton_path_reads_the_seed_on_the_device(monkeypatch):
    """Forward and backward with dropout through the Triton layer never call .item(), and
    the backward regenerates the forward's mask: the gradient matches a central difference
    of the loss (a mask drawn from another seed would not)."""
    x, weights, hx, cx = _lstm_inputs()
    seed = torch.tensor(123456789123, dtype=torch.int64)
    probe = torch.randn(4, 3, 6)

    def loss(x):
        y, _, _, _ = op.rnn_forward(
            x, weights, hx, cx, None, seed, "lstm", 2, False, True, 0, 0.5, "recompute", None,
            "triton", True,
        )  # fmt: skip
        return (y * probe).sum()

    def item(self):
        raise AssertionError("host sync: .item() on the Triton path")

    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "item", item)
        (grad,) = torch.autograd.grad(loss(x), x)
    direction = torch.randn_like(x)
    eps = 1e-2
    with torch.no_grad():
        numeric = (loss(x + eps * direction) - loss(x - eps * direction)) / (2 * eps)
    torch.testing.assert_close((grad * direction).sum(), numeric, rtol=2e-3, atol=2e-3)
