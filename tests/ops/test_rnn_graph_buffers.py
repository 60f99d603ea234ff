"""The captured-loop path of the Triton layer with CUDA Graph replay emulated on CPU: a
"replay" reruns the loop on the same static buffers, as a real graph would, so the
copies into and out of those buffers (and state gradients carried across backward
chunks through them) are checked without a GPU."""

import pytest
import torch
from tests.ops.test_rnn_kernels import KERNELS, _check_layer

from mirrorgrad.ops.rnn import graphs, kernels


@pytest.fixture
def emulated_graphs(monkeypatch):
    """graphs.captured as a cache of buffers whose replay runs the loop in Python."""
    cache, captures = {}, []

    class _Replay:
        def __init__(self, loop, buffers):
            self.replay = lambda: loop(buffers)

    def captured(key, device, make_buffers, loop):
        if key not in cache:
            buffers = make_buffers()
            cache[key] = graphs.Captured(graph=_Replay(loop, buffers), buffers=buffers)
            captures.append(key)
        return cache[key]

    monkeypatch.setattr(graphs, "use_graph", lambda device, elements, requested: True)
    monkeypatch.setattr(graphs, "captured", captured)
    return captures


@KERNELS
@pytest.mark.parametrize("memory", ["stash", "recompute"])
@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh"])
def test_replayed_loops_match_the_oracle(mode, memory, fused, emulated_graphs, monkeypatch):
    """Twice (the second call replays with new values), with backward chunks of 2, 2 and
    1 steps: the first two share one graph (the state gradient stays in its buffers), the
    last has a graph of its own."""
    monkeypatch.setattr(kernels, "BWD_CHUNK_ROWS", 2 * 3)
    for _ in range(2):
        _check_layer(mode, memory=memory, lengths=[2, 5, 1], fused=fused, t=5)
    assert len(emulated_graphs) == 3, "forward, backward chunk of 2 steps, chunk of 1 step"


def test_results_are_not_static_buffers(emulated_graphs):
    """What a call returns survives the next call (which reruns the same graphs)."""
    g = kernels.GATES["lstm"]
    x, h0, c0 = torch.randn(3, 2, 4), torch.randn(2, 5), torch.randn(2, 5)
    w = (torch.randn(g * 5, 4), torch.randn(g * 5, 5), torch.randn(g * 5), torch.randn(g * 5))

    def run(scale):
        inputs = (x * scale, h0, c0, *w, None)
        y, h_n, c_n, saved = kernels.layer_forward("lstm", *inputs, memory="recompute")
        grads = kernels.layer_backward(
            "lstm", saved, *inputs, y, torch.ones_like(y), h_n, c_n, memory="recompute"
        )
        return [t.clone() for t in (y, h_n, c_n, *grads[:7])], [y, h_n, c_n, *grads[:7]]

    first, kept = run(1.0)
    run(2.0)
    for copy, result in zip(first, kept):
        torch.testing.assert_close(result, copy)
