"""The captured-loop path of the Triton layer on CPU (conftest's ``cpu_graphs``: a replay
reruns the loop on the same buffers, as a real graph would): the state gradients that
start in, and are carried across backward chunks through, the loops' shared buffers,
and the recompute written straight into them."""

import pytest
import torch
from tests.ops.test_rnn_kernels import KERNELS, _check_layer

from mirrorgrad.ops.rnn import cuda_graphs, kernels
from mirrorgrad.ops.rnn.layer_call import LayerCall
from mirrorgrad.ops.rnn.tuning import StepTuning

pytestmark = pytest.mark.slow  # every test runs the loops in Triton's interpreter, several times


@KERNELS
@pytest.mark.parametrize("memory", ["stash", "recompute"])
# The buffers of one state (h) and of two (h, c); rnn_tanh carries its state as the GRU
# does, and its captured loops are checked in test_rnn_graphs.py.
@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_replayed_loops_match_the_oracle(mode, memory, fused, cpu_graphs, monkeypatch, tuning):
    """Twice (the second call replays with new values), with backward chunks of 2, 2 and
    1 steps: the first two share one config (the state gradient stays in its buffers),
    the last has buffers of its own."""
    tuning(StepTuning(bwd_chunk_rows=2 * 3))
    for _ in range(2):
        _check_layer(mode, memory=memory, lengths=[2, 5, 1], fused=fused, t=5)
    assert cpu_graphs, "the loops ran captured"


def test_results_are_not_static_buffers(cpu_graphs):
    """What a call returns survives the next call (which reruns the same graphs)."""
    g = kernels.GATES["lstm"]
    x, h0, c0 = torch.randn(3, 2, 4), torch.randn(2, 5), torch.randn(2, 5)
    w = (torch.randn(g * 5, 4), torch.randn(g * 5, 5), torch.randn(g * 5), torch.randn(g * 5))

    def run(scale):
        call = LayerCall("lstm", x * scale, h0, c0, *w, memory="recompute")
        y, h_n, c_n, saved = kernels.layer_forward(call)
        grads = kernels.layer_backward(call, saved, y, torch.ones_like(y), h_n, c_n)
        return [t.clone() for t in (y, h_n, c_n, *grads[:7])], [y, h_n, c_n, *grads[:7]]

    first, kept = run(1.0)
    run(2.0)
    for copy, result in zip(first, kept):
        torch.testing.assert_close(result, copy)


def test_compiled_steps_replay_the_entries_of_the_first(cpu_graphs, reused_blocks):
    """Under torch.compile (AOTAutograd) the forwards of the third and later steps replay
    the entries the first two captured, as eager steps do: the saved stash AOTAutograd
    keeps is the op's own output, freed with the step, so its block comes back. (On CPU
    only the kernels' own outputs come back at the same addresses, reused_blocks, and
    not in the first compiled call, which runs under a dispatch mode; the backward's dy
    is autograd's and moves, so backward entries are not counted here.)"""
    import mirrorgrad.nn

    torch.manual_seed(0)
    rnn = mirrorgrad.nn.LSTM(4, 5, impl="triton")
    loss = torch.compile(lambda x: rnn(x)[0].square().mean(), backend="aot_eager")
    counts = []
    for _ in range(5):
        loss(torch.randn(3, 2, 4)).backward()
        entries = cuda_graphs._ENTRIES.items()
        counts.append(sum(len(k.entries) for key, k in entries if key[1] == "fwd"))
    assert counts[0] > 0 and counts[2:] == [counts[1]] * 3, counts
