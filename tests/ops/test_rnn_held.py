"""The RNN op's held formulas (op.py): the CUDA Graph arenas its captured loops keep
between calls (cuda_graphs.py), as the cache allocates them on CPU (conftest's stand-in
graphs) and as the H100 measured them (docs/results/peak-compare-rnn-arenas-h100/)."""

import json
from pathlib import Path

import pytest
import torch

from mirrorgrad import _compat
from mirrorgrad.formulas import held_formula, memory_formula
from mirrorgrad.ops.rnn import cuda_graphs, kernels
from mirrorgrad.ops.rnn.layer_call import LayerCall

from .test_rnn_kernels import _inputs

# Per test, not for the module: on a GPU machine (TRITON_INTERPRET=0) the CUDA test runs.
ON_CPU = pytest.mark.skipif(
    not kernels.supports("lstm", proj=False, dtype=torch.float32, device=torch.device("cpu")),
    reason="Triton kernels need TRITON_INTERPRET=1 on CPU",
)

RESULTS = Path(__file__).parents[2] / "docs/results/peak-compare-rnn-arenas-h100"
FORWARD, BACKWARD = torch.ops.mirrorgrad.rnn_forward, torch.ops.mirrorgrad.rnn_backward


def _merged(held: list[dict]) -> dict:
    """Equal keys are one buffer, as large as the largest (graph/held.py)."""
    out: dict = {}
    for buffers in held:
        for key, nbytes in buffers.items():
            out[key] = max(out.get(key, 0), nbytes)
    return out


@pytest.mark.slow
@ON_CPU
@pytest.mark.parametrize(
    ("mode", "memory"),
    [("lstm", "stash"), ("lstm", "recompute"), ("gru", "stash"), ("gru", "recompute"),
     ("rnn_tanh", "stash")],
)  # fmt: skip
def test_held_arenas_are_the_arenas_the_cache_allocates(cpu_graphs, mode, memory):
    t = _inputs(mode)
    x, h0, c0 = t["x"], t["h0"], t["c0"]
    call = LayerCall(mode, x, h0, c0, t["w_ih"], t["w_hh"], t["b_ih"], t["b_hh"], memory=memory)
    y, _, _, saved = kernels.layer_forward(call)
    kernels.layer_backward(call, saved, y, torch.ones_like(y), None, None)
    allocated = {name: a.numel() for (_, name), a in cuda_graphs._ARENAS.items()}
    T, B, _ = x.shape
    shape = (mode, memory, T, B, h0.shape[-1], x.dtype, torch.device("cuda"))
    declared = _merged(
        [
            kernels.held_arenas(*shape, has_lengths=False, has_bias=True, backward=phase)
            for phase in (False, True)
        ]
    )
    assert cpu_graphs and allocated
    assert {key[2]: n for key, n in declared.items()} == allocated


def _op_args(mode, layers, bidirectional, T, B, H, memory, device="cuda"):
    """Fake (rnn_forward args, rnn_backward args) of one op call on ``device``."""
    D, gates = 2 if bidirectional else 1, kernels.GATES[mode]
    with _compat.fake_tensors():
        x = torch.empty(T, B, H, device=device)
        weights = [torch.empty(gates * H, H, device=device) for _ in range(4 * layers * D)]
        hx = torch.empty(layers * D, B, H, device=device)
        cx = hx if mode == "lstm" else None
        seed = torch.empty((), dtype=torch.int64, device=device)
        y = torch.empty(T, B, D * H, device=device)
    config = (mode, layers, bidirectional, True, 0, 0.5, memory, None, "triton")
    fwd = (x, weights, hx, cx, None, seed, *config, True)
    bwd = (y, None, None, x, weights, hx, cx, None, seed, y, [], *config, [True] * 4)
    return fwd, bwd


def _held(calls) -> int:
    """Held bytes of a graph's RNN op calls: (mode, layers, bidirectional, T, B, H, memory)."""
    held = []
    for call in calls:
        fwd, bwd = _op_args(*call)
        held += [held_formula(FORWARD)(*fwd), held_formula(BACKWARD)(*bwd)]
    return sum(_merged(held).values())


def _measured_arenas(name: str) -> int:
    (record,) = json.loads((RESULTS / f"peak_compare-{name}+mgnn-balance.json").read_text())
    by_source = record["measured"]["by_source"]
    return sum(s["bytes"] for s in by_source if "_arena_view" in s["source"])


# The op calls of each workload's graph at the suite's shapes (bench/workloads.py), with
# the memory mode its balance plan chose on the H100 (docs/BENCHMARKS.md).
WORKLOADS = {
    "lstm-lm-medium": [("lstm", 2, False, 35, 20, 650, "stash")],
    "lstm-lm-large": [("lstm", 2, False, 35, 20, 1500, "stash")],
    "nmt-attention": [("lstm", 1, True, 50, 80, 500, "recompute")],
    "deepspeech2": [("gru", 1, True, 150, 32, 800, "recompute")]
    + [("gru", 1, True, 150, 32, 800, "stash")] * 4,
}


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_held_formula_matches_the_arenas_measured_on_the_h100(workload, monkeypatch):
    """The H100 run had the recomputing backward's gate gradients in a buffer of their own
    beside the recomputed pre-activations ("bwd.pre"), and copied dy (and a bidirectional
    layer's y) into arenas of their own: the formula with that layout gives what it
    measured, and the layout now (gate gradients written over the recomputed
    pre-activations, kernels.dg_overwrites_pre; dy and y read in place,
    kernels.READ_IN_PLACE) declares less."""
    measured = _measured_arenas(workload)
    assert measured > 0
    now = _held(WORKLOADS[workload])
    monkeypatch.setattr(kernels, "dg_overwrites_pre", lambda config, captured: False)
    # All layers here are LSTMs (no y in their backward) or bidirectional GRUs.
    monkeypatch.setattr(kernels, "READ_IN_PLACE", ("pre", "cells", "w_hh"))
    then = _held(WORKLOADS[workload])
    assert then == pytest.approx(measured, rel=0.1)
    assert now < then


def test_nothing_is_held_off_cuda_or_where_nothing_is_captured():
    fwd, bwd = _op_args("lstm", 1, False, 35, 20, 650, "stash", device="cpu")
    assert held_formula(FORWARD)(*fwd) == {} and held_formula(BACKWARD)(*bwd) == {}
    fwd, bwd = _op_args("lstm", 1, False, 35, 20, 650, "stash")
    args = (*fwd[:-2], "reference", fwd[-1])
    assert held_formula(FORWARD)(*args) == {}


@pytest.mark.parametrize("memory", ["stash", "recompute"])
def test_captured_loops_count_their_arenas_as_held_not_per_call(memory):
    """On CUDA the per-call temporaries leave out what the arenas hold: the same call on
    CPU declares the difference, at least the largest arena, as temporary."""
    per_call = {}
    for device in ("cpu", "cuda"):
        _, bwd = _op_args("lstm", 1, False, 35, 20, 650, memory, device=device)
        per_call[device] = memory_formula(BACKWARD)(*bwd)
    _, bwd = _op_args("lstm", 1, False, 35, 20, 650, memory)
    largest = max(held_formula(BACKWARD)(*bwd).values())
    assert per_call["cpu"] - per_call["cuda"] >= largest


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_op_held_formula_is_what_a_step_leaves_in_the_arenas_on_cuda(mode):
    """A real step of the op on CUDA (captured by size): the arenas left are the ones
    its forward and backward declare, as the planner sums them."""
    import mirrorgrad.nn

    cuda_graphs.clear_graphs()
    module = getattr(mirrorgrad.nn, mode.upper())
    rnn = module(64, 96, 2, bidirectional=True, memory="stash", impl="triton").cuda()
    x = torch.randn(12, 8, 64, device="cuda", requires_grad=True)
    rnn(x)[0].square().mean().backward()
    allocated = {(str(d), name): a.numel() for (d, name), a in cuda_graphs._ARENAS.items()}
    fwd, bwd = _op_args(mode, 2, True, 12, 8, 96, "stash", device="cuda")
    declared = _merged([held_formula(FORWARD)(*fwd), held_formula(BACKWARD)(*bwd)])
    cuda_graphs.clear_graphs()
    assert {key[1:]: n for key, n in declared.items()} == allocated
