"""On a GPU: the CUDA Graph cache of the RNN step loops holds no second copy of anything
(graphs.py). Run with ``TRITON_INTERPRET=0 python -m pytest -m gpu tests/ops``."""

import pytest
import torch

import mirrorgrad.nn as mnn
from mirrorgrad.ops.rnn import graphs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _step(model, x):
    y, (h, _) = model(x)
    (y.square().mean() + h.mean()).backward()


def _requested() -> int:
    """Bytes requested from the caching allocator and not freed: exact sizes, whereas
    memory_allocated counts whole blocks (a reused block is not always split, so a
    buffer may be charged more than its size: window 3 of 2026-11-23 failed on that)."""
    return torch.cuda.memory_stats()["requested_bytes.all.current"]


def _nbytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def _retained_after_step(model, x) -> int:
    before = _requested()
    _step(model, x)
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return _requested() - before


def _small_blocks(snapshot: dict, held: list[int]) -> list[str]:
    """Live blocks allocated while the history was recorded (the others have no frames)
    whose requested size is not one the cache holds, with the frames that allocated them
    (what a mismatch is made of)."""
    out = []
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] != "active_allocated" or not block.get("frames"):
                continue
            if block["requested_size"] in held:
                continue
            frames = [f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}"
                      for f in block.get("frames", [])[:8]]  # fmt: skip
            out.append(f"{block['requested_size']} B: {' < '.join(frames)}")
    return out[:20]


@pytest.mark.parametrize("memory", ["stash", "recompute"])
def test_what_stays_after_a_step_is_the_cache_and_it_does_not_grow(memory):
    torch.manual_seed(0)
    model = mnn.LSTM(64, 96, num_layers=2, impl="triton", memory=memory).cuda()
    x = torch.randn(12, 8, 64, device="cuda")
    _step(model, x)  # warm: kernels compiled, cuBLAS workspaces of both streams made
    model.zero_grad(set_to_none=True)
    graphs.clear_graphs()
    torch.cuda.synchronize()
    baseline = _requested()
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        retained = _retained_after_step(model, x)
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    held = sorted(t.untyped_storage().nbytes() for t in graphs.held())
    # Nothing else is kept: no clone, no W_hh copy.
    assert retained == sum(held), (retained, sum(held), _small_blocks(snapshot, held))
    again = _retained_after_step(model, x)
    assert again == 0, (again, graphs.held_bytes())  # the same entries replay: steady state
    graphs.clear_graphs()
    torch.cuda.synchronize()
    assert _requested() == baseline


def test_held_bytes_are_one_stash_and_one_workspace_per_layer_config():
    """2 layers of one config, stash: each layer's entry hands out y, the pre-activation
    stash and fp32 cells; shared: the h ping-pong and backward's dy, dh, dc, dG."""
    T, B, H = 12, 8, 96
    model = mnn.LSTM(H, H, num_layers=2, impl="triton", memory="stash").cuda()
    graphs.clear_graphs()
    _step(model, torch.randn(T, B, H, device="cuda"))
    handed_out = 2 * (T * B * H * 4 + T * B * 4 * H * 4 + (T + 1) * B * H * 4)
    workspace = 2 * B * H * 4 + T * B * H * 4 + 2 * B * H * 4 + T * B * 4 * H * 4
    assert graphs.held_bytes() == handed_out + workspace


def test_graphs_raise_the_peak_by_their_workspace_at_most(monkeypatch):
    torch.manual_seed(0)
    model = mnn.LSTM(64, 96, num_layers=2, impl="triton", memory="recompute").cuda()
    x = torch.randn(12, 8, 64, device="cuda")

    def peak() -> int:
        _step(model, x)  # warm (captures on the graph path)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        _step(model, x)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start

    graphs.clear_graphs()
    monkeypatch.setattr(graphs, "GRAPH_MAX_ELEMENTS", 0)
    uncaptured = peak()
    monkeypatch.setattr(graphs, "GRAPH_MAX_ELEMENTS", 1 << 27)
    captured = peak()
    workspace = sum(a.untyped_storage().nbytes() for a in graphs._ARENAS.values())
    assert captured <= uncaptured + workspace
    graphs.clear_graphs()
