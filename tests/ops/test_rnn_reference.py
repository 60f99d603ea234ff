"""The reference layer's explicit backward against autograd through its own forward."""

import pytest
import torch

from mirrorgrad.ops.rnn import reference
from mirrorgrad.ops.rnn.cell_modes import GATES, MEMORY_MODES, MODES
from mirrorgrad.ops.rnn.layer_call import LayerCall

DT = torch.float64


def layer_cases():
    for mode in MODES:
        for memory in MEMORY_MODES:
            for varlen in (False, True):
                extras = [("plain", False, None)]
                if mode == "lstm":
                    extras += [("proj", True, None), ("clip", False, (-0.3, 0.4)),
                               ("proj-clip", True, (-0.3, 0.4))]  # fmt: skip
                for name, proj, clip in extras:
                    ident = f"{mode}-{memory}-{'varlen' if varlen else 'full'}-{name}"
                    yield pytest.param(mode, memory, varlen, proj, clip, id=ident)


def layer_inputs(mode, proj, T=5, B=3, n_in=4, H=6):
    G = GATES[mode]
    Hr = 3 if proj else H
    x = torch.randn(T, B, n_in, dtype=DT)
    h0 = torch.randn(B, Hr, dtype=DT)
    c0 = torch.randn(B, H, dtype=DT) if mode == "lstm" else None
    weights = [torch.randn(G * H, n_in, dtype=DT), torch.randn(G * H, Hr, dtype=DT),
               torch.randn(G * H, dtype=DT), torch.randn(G * H, dtype=DT),
               torch.randn(Hr, H, dtype=DT) if proj else None]  # fmt: skip
    return [x, h0, c0, *weights]


@pytest.mark.parametrize(("mode", "memory", "varlen", "proj", "clip"), list(layer_cases()))
def test_layer_backward_matches_autograd(mode, memory, varlen, proj, clip):
    inputs = layer_inputs(mode, proj)
    leaves = [None if t is None else t.clone().requires_grad_() for t in inputs]
    lengths = torch.tensor([5, 2, 4]) if varlen else None
    kw = {"lengths": lengths, "memory": memory, "state_clip": clip}
    y, h_n, c_n, saved = reference.layer_forward(LayerCall(mode, *leaves, **kw))
    grad_y, grad_hn = torch.randn_like(y), torch.randn_like(h_n)
    grad_cn = None if c_n is None else torch.randn_like(c_n)
    loss = (y * grad_y).sum() + (h_n * grad_hn).sum()
    loss = loss + (0 if c_n is None else (c_n * grad_cn).sum())
    present = [t for t in leaves if t is not None]
    expected = iter(torch.autograd.grad(loss, present))
    with torch.no_grad():
        got = reference.layer_backward(
            LayerCall(mode, *inputs, **kw), tuple(s.detach() for s in saved), y.detach(),
            grad_y, grad_hn, grad_cn,
        )  # fmt: skip
    for name, leaf, g in zip(
        ("x", "h0", "c0", "w_ih", "w_hh", "b_ih", "b_hh", "w_hr"), leaves, got
    ):
        if leaf is None:
            assert g is None, name
        else:
            torch.testing.assert_close(g, next(expected), atol=1e-11, rtol=0, msg=name)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("memory", MEMORY_MODES)
def test_saved_layout_describes_saved(mode, memory):
    T, B, H = 4, 2, 6
    inputs = layer_inputs(mode, False, T=T, B=B, H=H)
    saved = reference.layer_forward(LayerCall(mode, *inputs, memory=memory))[3]
    layout = reference.saved_layout(mode, memory, T, B, H, DT)
    assert [(tuple(s.shape), s.dtype) for s in saved] == layout


def test_recompute_stashes_a_fifth_of_stash_for_lstm():
    inputs = layer_inputs("lstm", False)
    stash = reference.layer_forward(LayerCall("lstm", *inputs, memory="stash"))[3]
    recompute = reference.layer_forward(LayerCall("lstm", *inputs, memory="recompute"))[3]
    assert sum(s.numel() for s in recompute) * 5 == sum(s.numel() for s in stash)


def test_gradients_not_needed_are_none():
    inputs = layer_inputs("gru", False)
    call = LayerCall("gru", *inputs)
    y, _, _, saved = reference.layer_forward(call)
    needs = (False, True, False, False, True, False, True, False)
    got = reference.layer_backward(call, saved, y, torch.randn_like(y), None, None,
                                   needs_input_grad=needs)  # fmt: skip
    assert [g is not None for g in got] == list(needs)
    nothing = reference.layer_backward(call, saved, y, None, None, None,
                                       needs_input_grad=(False,) * 8)  # fmt: skip
    assert nothing == (None,) * 8


def test_lengths_keep_state_and_zero_outputs_on_padding():
    inputs = layer_inputs("lstm", False)
    lengths = torch.tensor([5, 2, 4])
    y, h_n, c_n, _ = reference.layer_forward(LayerCall("lstm", *inputs, lengths=lengths))
    full = reference.layer_forward(LayerCall("lstm", inputs[0][:2, 1:2], inputs[1][1:2],
                                             inputs[2][1:2], *inputs[3:]))  # fmt: skip
    torch.testing.assert_close(h_n[1:2], full[1])
    torch.testing.assert_close(c_n[1:2], full[2])
    assert torch.all(y[2:, 1] == 0)


def test_supports_everything_but_projection_outside_lstm():
    cpu = torch.device("cpu")
    assert all(reference.supports(m, proj=False, dtype=DT, device=cpu) for m in MODES)
    assert reference.supports("lstm", proj=True, dtype=torch.bfloat16, device=cpu)
    assert not reference.supports("gru", proj=True, dtype=DT, device=cpu)
