"""GPU: the RNN op inside whole-step CUDA Graphs (Inductor's cudagraph trees, and a plain
torch.cuda.graph capture): same numbers as eager, no graph of its own, no skip."""

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

import mirrorgrad
from mirrorgrad.ops.rnn import cuda_graphs, rnn
from mirrorgrad.train.config import PRESETS
from mirrorgrad.train.model import LanguageModel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(autouse=True)
def nan_fill():
    """No poisoned buffers here (conftest's fixture of that name): Dynamo would trace the
    poisoning fill_ of a fresh buffer into the step, and Inductor's CUDA Graph trees skip a
    graph that mutates one of its inputs, which no user's step does."""
    yield


def _train(step_model, model, steps=4, batch=4):
    """Losses and final gradients of a few SGD steps, the LSTM state carried."""
    torch.manual_seed(1)
    tokens = torch.randint(0, 50, (7, batch), device="cuda")
    targets = torch.randint(0, 50, (7, batch), device="cuda")
    state = model.initial_state(batch, "cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(steps):
        torch.compiler.cudagraph_mark_step_begin()
        loss, (h, c) = step_model(tokens, targets, state)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        state = (h.detach().clone(), c.detach().clone())
        losses.append(loss.detach().clone())
    return torch.stack(losses), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("how", ["torch.compile", "mirrorgrad.compile"])
def test_lm_step_under_cudagraph_trees_matches_eager(how):
    # No dropout: eager and compiled then compute the same function.
    preset = dataclasses.replace(PRESETS["medium"], embedding=16, hidden=32, dropout=0.0)
    torch.manual_seed(0)
    eager = LanguageModel(50, preset).cuda()
    compiled_model = LanguageModel(50, preset).cuda()
    compiled_model.load_state_dict(eager.state_dict())
    for module in (eager.rnn, compiled_model.rnn):
        module.impl = "triton"  # the op (auto could pick cuDNN in eager)
    options = {"triton.cudagraphs": True}
    if how == "torch.compile":
        step = torch.compile(compiled_model, options=options)
    else:
        step = mirrorgrad.compile(compiled_model, mode="balance", options=options)
    torch._dynamo.reset()
    counters.clear()
    cuda_graphs.clear_graphs()
    expected_losses, expected_grads = _train(eager, eager)
    cuda_graphs.clear_graphs()
    losses, grads = _train(step, compiled_model)
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert not cuda_graphs.held(), "the op captured a graph of its own inside the trees"
    torch.testing.assert_close(losses, expected_losses, rtol=1e-4, atol=1e-4)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def _captured_step(dropout):
    """forward + backward of a 2-layer LSTM through rnn() captured in one CUDA Graph:
    (graph, static x, static y, static dx)."""
    torch.manual_seed(0)
    x = torch.randn(6, 3, 8, device="cuda", requires_grad=True)
    lstm = torch.nn.LSTM(8, 16, 2).cuda()
    weights, hx = list(lstm._flat_weights), torch.zeros(2, 3, 16, device="cuda")

    def step():
        y, _, _ = rnn(x, weights, hx, hx.clone(), mode="lstm", num_layers=2, dropout=dropout,
                      training=True, impl="triton")  # fmt: skip
        return y, torch.autograd.grad(y.square().sum(), [x])[0]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: compiles the kernels
    torch.cuda.current_stream().wait_stream(side)
    cuda_graphs.clear_graphs()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, dx = step()
    assert not cuda_graphs.held(), "the op captured a graph of its own inside a capture"
    return graph, x, y, dx, step


def test_op_inside_a_plain_cuda_graph_capture():
    """A replay with new inputs gives eager's output and gradient."""
    graph, x, y, dx, step = _captured_step(dropout=0.0)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    expected_y, expected_dx = step()
    torch.testing.assert_close(y, expected_y, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dx, expected_dx, rtol=1e-4, atol=1e-5)


def test_replays_draw_fresh_dropout_masks():
    """The seed is drawn inside the graph and read on the device: each replay has its own
    mask (a seed read on the host would have been frozen into the graph)."""
    graph, _, y, _, _ = _captured_step(dropout=0.5)
    graph.replay()
    first = y.clone()
    graph.replay()
    assert not torch.equal(first, y)
