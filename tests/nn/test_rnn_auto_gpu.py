"""On a GPU: impl="auto" through the module (timed candidates, graphs released, the cost
rule under torch.compile). Run with ``TRITON_INTERPRET=0 python -m pytest -m gpu tests/nn``."""

import pytest
import torch

import mirrorgrad.nn as mnn
from mirrorgrad.ops.rnn import cuda_graphs, dispatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _step(model, x):
    y, _ = model(x)
    y.square().mean().backward()


@pytest.fixture
def fresh(monkeypatch):
    # Each test compiles new modules through one forward: past Dynamo's recompile limit
    # it would run them eagerly without a word, and a compiled path would go untested.
    torch.compiler.reset()
    monkeypatch.setattr(dispatch, "_AUTO_CHOICE", {})
    monkeypatch.setattr(dispatch, "AUTO_TIMES", {})
    cuda_graphs.clear_graphs()
    yield
    cuda_graphs.clear_graphs()


def test_auto_times_every_candidate_and_runs_the_fastest(fresh):
    model = mnn.LSTM(64, 96, num_layers=2).cuda()
    _step(model, torch.randn(12, 8, 64, device="cuda", requires_grad=True))
    ((key, times),) = dispatch.AUTO_TIMES.items()
    assert {"triton", "cudnn"} <= set(times)
    assert dispatch._AUTO_CHOICE[key] == min(times, key=times.__getitem__)


def test_a_shape_cudnn_wins_keeps_no_graph_buffers(fresh, monkeypatch):
    """Every candidate runs (the fused ones capture their loops), cuDNN is made to win:
    the captured loops are released."""
    real = dispatch._choose_auto

    def cudnn_wins(key, candidates, timer=None, rule=None):
        names = {step: name for name, step in candidates.items()}

        def timer(step):
            step()
            return 0.0 if names[step] == "cudnn" else 1.0

        return real(key, candidates, timer)

    monkeypatch.setattr(dispatch, "_choose_auto", cudnn_wins)
    model = mnn.LSTM(64, 96, num_layers=2).cuda()
    _step(model, torch.randn(12, 8, 64, device="cuda", requires_grad=True))
    assert set(dispatch._AUTO_CHOICE.values()) == {"cudnn"}
    assert cuda_graphs.held_bytes() == 0


@pytest.mark.parametrize("dynamic", [False, True])
def test_auto_under_compile_follows_the_rule_and_matches_eager(fresh, dynamic):
    torch.manual_seed(0)
    model = mnn.LSTM(64, 96, num_layers=2).cuda()
    # aot_eager: the choice is made while tracing; Inductor's codegen would add minutes.
    compiled = torch.compile(model, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    for T in (12, 9):
        x = torch.randn(T, 8, 64, device="cuda")
        torch.testing.assert_close(compiled(x)[0], model(x)[0], rtol=2e-3, atol=2e-3)


def test_auto_inside_dispatch_as_captured_times_replays_and_runs_captured(fresh):
    """The candidates are timed as CUDA Graph replays; the module then runs inside a
    graph of the caller's and gives the uncaptured gradients."""
    model = mnn.LSTM(64, 96, num_layers=2).cuda()
    x = torch.randn(12, 8, 64, device="cuda", requires_grad=True)
    _step(model, x)
    expected = [p.grad.clone() for p in model.parameters()]
    with mnn.dispatch_as_captured():
        model.zero_grad(set_to_none=True)
        _step(model, x)
    captured_keys = [k for k in dispatch.AUTO_TIMES if k[-1] == "captured"]
    assert len(captured_keys) == 1 and {"triton", "cudnn"} <= set(
        dispatch.AUTO_TIMES[captured_keys[0]]
    )
    graph = torch.cuda.CUDAGraph()
    model.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        _step(model, x)
    graph.replay()
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-4, atol=1e-5)


def test_warm_up_for_a_capture_runs_the_loops_plainly(fresh):
    """Inside dispatch_as_captured() (a caller's warm-up before it captures the step) the
    step loops capture nothing and keep no arena: the caller's graph will hold them."""
    model = mnn.LSTM(64, 96, num_layers=2, impl="triton").cuda()
    x = torch.randn(12, 8, 64, device="cuda", requires_grad=True)
    with mnn.dispatch_as_captured():
        for _ in range(6):
            _step(model, x)
    assert cuda_graphs.counts()["captures"] == 0
    assert cuda_graphs.held_bytes() == 0
    for _ in range(6):  # uncaptured, the loops are captured again
        _step(model, x)
    assert cuda_graphs.counts()["captures"] > 0


def test_auto_under_reduce_overhead_times_its_candidates_captured(fresh):
    """torch.compile(mode="reduce-overhead") replays its graphs as CUDA Graphs: while it
    traces, impl="auto" times the custom op's implementations captured. (A shape where
    the persistent and the split kernels are both candidates: with one, nothing is timed.)"""
    torch.manual_seed(0)
    model = mnn.LSTM(650, 650, num_layers=2).cuda()
    x = torch.randn(35, 20, 650, device="cuda")
    with torch.no_grad():
        expected = model(x)[0]
        compiled = torch.compile(model, mode="reduce-overhead")
        for _ in range(3):
            got = compiled(x)[0]
    rows = dispatch.auto_choices()
    assert any(row["compiled"] and row["captured"] for row in rows), rows
    torch.testing.assert_close(got, expected, rtol=2e-3, atol=2e-3)


def test_captured_auto_leaves_out_cudnn_with_dropout(fresh):
    """cuDNN's dropout state waits on the host, which a capture forbids: with dropout
    between layers, the captured choice is among the fused kernels only, and a whole
    step with it captures and replays."""
    from mirrorgrad._cuda_graphs import capture

    model = mnn.LSTM(512, 512, num_layers=2, dropout=0.5).cuda().train()
    x = torch.randn(35, 128, 512, device="cuda")
    with mnn.dispatch_as_captured():
        graph, _ = capture(lambda: _step(model, x))
    graph.replay()
    torch.cuda.synchronize()
    rows = [row for row in dispatch.auto_choices() if row["captured"]]
    assert rows and all("cudnn" not in row["times"] for row in rows), rows
