"""Triton RNN kernels (interpreted on CPU in CI) against the reference layer in float64
(ops/rnn/reference.py, differentiated by autograd)."""

import pytest
import torch

from mirrorgrad.ops.rnn import kernels, reference, step_loop
from mirrorgrad.ops.rnn.cell_modes import GATES
from mirrorgrad.ops.rnn.layer_call import LayerCall
from mirrorgrad.ops.rnn.tuning import StepTuning

T, B, IN, H = 4, 3, 5, 6
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _oracle(mode, x, h0, c0, w_ih, w_hh, b_ih, b_hh, lengths, clip):
    """(y, h_n, c_n) of ops/rnn/reference.py's layer, whose plain PyTorch ops autograd
    differentiates: the reference gradients (in the inputs' dtype: float64 here)."""
    call = LayerCall(mode, x, h0, c0, w_ih, w_hh, b_ih, b_hh, lengths=lengths, state_clip=clip)
    return reference.layer_forward(call)[:3]


def _inputs(mode, *, bias=True, t=T):
    g = GATES[mode]
    scale = 0.6
    tensors = {
        "x": torch.randn(t, B, IN),
        "h0": torch.randn(B, H) * 0.5,
        "c0": torch.randn(B, H) if mode == "lstm" else None,
        "w_ih": torch.randn(g * H, IN) * scale,
        "w_hh": torch.randn(g * H, H) * scale,
        "b_ih": torch.randn(g * H) * scale if bias else None,
        "b_hh": torch.randn(g * H) * scale if bias else None,
    }
    return {k: (v.to(DEVICE) if v is not None else None) for k, v in tensors.items()}


NAMES = ("x", "h0", "c0", "w_ih", "w_hh", "b_ih", "b_hh")


def f32(v):
    return v.float() if v is not None else None


def _check_layer(
    mode,
    *,
    memory,
    lengths=None,
    clip=None,
    bias=True,
    with_grad_y=True,
    use_graph=None,
    fused=False,
    t=T,
):
    inp = _inputs(mode, bias=bias, t=t)
    if lengths is not None:
        lengths = torch.tensor(lengths, dtype=torch.int64, device=DEVICE)
    ref_in = {k: (v.double().requires_grad_() if v is not None else None) for k, v in inp.items()}
    y_ref, hn_ref, cn_ref = _oracle(mode, *ref_in.values(), lengths, clip)
    gy = torch.randn_like(y_ref) if with_grad_y else None
    ghn, gcn = torch.randn_like(hn_ref), (torch.randn_like(cn_ref) if cn_ref is not None else None)
    loss = (hn_ref * ghn).sum()
    loss = (
        loss
        + ((y_ref * gy).sum() if gy is not None else 0)
        + ((cn_ref * gcn).sum() if gcn is not None else 0)
    )
    params = [v for v in ref_in.values() if v is not None]
    ref_grads = dict(
        zip([k for k, v in ref_in.items() if v is not None], torch.autograd.grad(loss, params))
    )

    call = LayerCall(mode, *inp.values(), lengths=lengths, memory=memory, state_clip=clip)
    y, hn, cn, saved = kernels.layer_forward(call, use_graph=use_graph, fused=fused)
    torch.testing.assert_close(y.double(), y_ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(hn.double(), hn_ref, atol=1e-5, rtol=1e-4)
    if mode == "lstm":
        torch.testing.assert_close(cn.double(), cn_ref, atol=1e-5, rtol=1e-4)
    else:
        assert cn is None
    grads = kernels.layer_backward(
        call, saved, y, f32(gy), f32(ghn), f32(gcn), use_graph=use_graph, fused=fused
    )
    assert grads[7] is None
    for name, grad in zip(NAMES, grads[:7]):
        if name not in ref_grads:
            assert grad is None, name
            continue
        torch.testing.assert_close(
            grad.double(),
            ref_grads[name],
            atol=1e-4,
            rtol=1e-4,
            msg=lambda m, name=name: f"{name}: {m}",
        )


KERNELS = pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])


@KERNELS
@pytest.mark.parametrize("memory", ["stash", "recompute"])
@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh", "rnn_relu"])
def test_layer_matches_oracle(mode, memory, fused):
    _check_layer(mode, memory=memory, fused=fused)


@pytest.mark.slow
@KERNELS
@pytest.mark.parametrize("memory", ["stash", "recompute"])
@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh", "rnn_relu"])
def test_layer_with_unsorted_lengths(mode, memory, fused):
    _check_layer(mode, memory=memory, lengths=[2, 4, 1], fused=fused)


@pytest.mark.slow
@KERNELS
@pytest.mark.parametrize("memory", ["stash", "recompute"])
def test_lstm_state_clip(memory, fused):
    # Tight bounds so that some cells clip and some do not.
    _check_layer("lstm", memory=memory, clip=(-0.3, 0.4), lengths=[4, 3, 2], fused=fused)


@pytest.mark.slow
@KERNELS
@pytest.mark.parametrize("memory", ["stash", "recompute"])
@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh"])
def test_backward_in_chunks(mode, memory, fused, monkeypatch, tuning):
    # Chunks of 2, 2 and 1 steps: state gradients carried across chunk boundaries.
    tuning(StepTuning(bwd_chunk_rows=2 * B))
    assert step_loop.chunk_steps(5, B) == 2
    _check_layer(mode, memory=memory, lengths=[5, 2, 3], fused=fused, t=5)


def test_chunk_rows_bounded_whatever_t():
    for batch in (1, 20, 256):
        for steps in (1, 35, 409, 410, 411, 5000):
            chunk = step_loop.chunk_steps(steps, batch)
            assert 1 <= chunk <= steps
            assert chunk * batch <= StepTuning().bwd_chunk_rows + batch


@pytest.mark.slow
@KERNELS
@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_no_bias_no_grad_y(mode, fused):
    _check_layer(mode, memory="stash", bias=False, with_grad_y=False, fused=fused)


def test_state_clip_actually_clips():
    inp = _inputs("lstm")
    inp["c0"] = inp["c0"] * 4
    _, _, cn, _ = kernels.layer_forward(LayerCall("lstm", *inp.values(), state_clip=(-0.5, 0.5)))
    assert cn.abs().max() <= 0.5 + 1e-6
    assert (cn.abs() > 0.5 - 1e-6).any()


def test_needs_input_grad_skips_and_missing_grads():
    inp = _inputs("lstm")
    call = LayerCall("lstm", *inp.values())
    y, _, _, saved = kernels.layer_forward(call)
    gy = torch.randn_like(y)
    grads = kernels.layer_backward(
        call, saved, y, gy, None, None, needs_input_grad=(True,) + (False,) * 7
    )
    assert grads[0] is not None and all(g is None for g in grads[1:])
    none = kernels.layer_backward(call, saved, y, gy, None, None, needs_input_grad=(False,) * 8)
    assert none == (None,) * 8


@pytest.mark.parametrize("memory", ["stash", "recompute"])
@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh"])
def test_saved_layout_matches_saved(mode, memory):
    inp = _inputs(mode)
    saved = kernels.layer_forward(LayerCall(mode, *inp.values(), memory=memory))[3]
    layout = kernels.saved_layout(mode, memory, T, B, H, torch.float32)
    assert [(tuple(s.shape), s.dtype) for s in saved] == layout
    expected = {("lstm", "stash"): 2, ("lstm", "recompute"): 1, ("gru", "stash"): 1}
    assert len(saved) == expected.get((mode, memory), 0)


def test_bad_arguments():
    inp = _inputs("lstm")
    with pytest.raises(ValueError, match="memory"):
        kernels.layer_forward(LayerCall("lstm", *inp.values(), memory="none"))
    with pytest.raises(ValueError, match="mode"):
        kernels.layer_forward(LayerCall("lstmx", *inp.values()))
    with pytest.raises(NotImplementedError, match="reference"):
        kernels.layer_forward(LayerCall("lstm", *inp.values(), torch.randn(H, H)))
    with pytest.raises(ValueError, match="state_clip"):
        inp = _inputs("gru")
        kernels.layer_forward(LayerCall("gru", *inp.values(), state_clip=(-1.0, 1.0)))


def test_empty_batch_and_empty_sequence():
    inp = _inputs("lstm")
    inp.update(x=inp["x"][:, :0], h0=inp["h0"][:0], c0=inp["c0"][:0])
    call = LayerCall("lstm", *inp.values())
    y, hn, cn, saved = kernels.layer_forward(call)
    assert y.shape == (T, 0, H) and hn.shape == (0, H) and cn.shape == (0, H)
    grads = kernels.layer_backward(call, saved, y, y, None, None)
    assert grads[0].shape == (T, 0, IN)
    assert torch.equal(grads[3], torch.zeros_like(inp["w_ih"]))
    inp = _inputs("gru", t=1)
    inp["x"] = inp["x"][:0]
    with pytest.raises(RuntimeError, match="sequence length"):
        kernels.layer_forward(LayerCall("gru", *inp.values()))


def test_supports():
    assert not kernels.supports("lstm", proj=True, dtype=torch.float32, device="cuda")
    assert not kernels.supports("lstm", proj=False, dtype=torch.float64, device="cuda")
    assert kernels.supports("gru", proj=False, dtype=torch.bfloat16, device="cuda")
    assert not kernels.supports("rnn_gelu", proj=False, dtype=torch.float32, device="cuda")


@pytest.mark.slow
def test_dropout_mask_deterministic_and_scaled():
    x = torch.randn(64, 257, device=DEVICE)
    a = kernels.dropout(x, 0.3, seed=7, offset=11)
    b = kernels.dropout(x, 0.3, seed=7, offset=11)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    c = kernels.dropout(x, 0.3, seed=8, offset=11)
    assert not torch.equal(a, c)
    keep = a != 0
    assert abs(keep.float().mean().item() - 0.7) < 0.02
    torch.testing.assert_close(a[keep], x[keep] / 0.7)
    # Backward regenerates the same mask from (seed, offset).
    grad = kernels.dropout(torch.ones_like(x), 0.3, seed=7, offset=11)
    assert torch.equal(grad != 0, keep)
    with pytest.raises(ValueError, match="probability"):
        kernels.dropout(x, 1.0, seed=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@KERNELS
@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh"])
def test_graph_replay_matches_eager(mode, fused):
    for _ in range(2):  # second call replays the captured loop with new values
        _check_layer(mode, memory="stash", lengths=[2, 4, 1], use_graph=True, fused=fused)
