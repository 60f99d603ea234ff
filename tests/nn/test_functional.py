import pytest
import torch
import torch.nn.functional as F

from mirrorgrad.nn.functional import linear_cross_entropy


def _inputs(n: int, h: int, v: int, *, bias: bool = True):
    hidden = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64, requires_grad=True)
    b = torch.randn(v, dtype=torch.float64, requires_grad=True) if bias else None
    target = torch.randint(0, v, (n,))
    return hidden, weight, b, target


def _grads(loss, tensors):
    # A non-trivial upstream gradient for reduction="none".
    if loss.dim() > 0:
        loss = (loss * torch.linspace(0.5, 2.0, loss.numel(), dtype=loss.dtype)).sum()
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk_size", [1, 7, 64], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_matches_reference_float64(reduction, chunk_size, bias):
    hidden, weight, b, target = _inputs(29, 6, 11, bias=bias)
    target[3] = -100
    target[17] = -100
    ours = linear_cross_entropy(
        hidden, weight, b, target, chunk_size=chunk_size, reduction=reduction
    )
    ref = F.cross_entropy(F.linear(hidden, weight, b), target, reduction=reduction)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    for g, r in zip(_grads(ours, (hidden, weight, b)), _grads(ref, (hidden, weight, b))):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


def test_custom_ignore_index_and_batch_dims():
    hidden = torch.randn(5, 3, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 9, (5, 3))
    target[0, 1] = 2
    ours = linear_cross_entropy(hidden, weight, None, target, chunk_size=4, ignore_index=2)
    ref = F.cross_entropy(
        F.linear(hidden, weight).reshape(-1, 9), target.reshape(-1), ignore_index=2
    )
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    for g, r in zip(_grads(ours, (hidden, weight)), _grads(ref, (hidden, weight))):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


def test_float32_close_to_float64_reference():
    hidden, weight, b, target = _inputs(40, 8, 13)
    ours = linear_cross_entropy(hidden.float(), weight.float(), b.float(), target, chunk_size=9)
    ref = F.cross_entropy(F.linear(hidden, weight, b), target)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-6)


def test_frozen_weight_gets_no_gradient():
    hidden, weight, b, target = _inputs(10, 4, 5)
    weight.requires_grad_(False)
    loss = linear_cross_entropy(hidden, weight, b, target, chunk_size=3)
    loss.backward()
    assert weight.grad is None
    ref_h = hidden.detach().clone().requires_grad_()
    F.cross_entropy(F.linear(ref_h, weight, b), target).backward()
    torch.testing.assert_close(hidden.grad, ref_h.grad, rtol=1e-12, atol=1e-12)


def test_bad_inputs_raise_like_cross_entropy():
    hidden, weight, b, target = _inputs(6, 4, 5)
    with pytest.raises(ValueError, match="target shape"):
        linear_cross_entropy(hidden, weight, b, target[:5])
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(hidden, weight, b, target, reduction="avg")
    with pytest.raises(RuntimeError, match="weight must be"):
        linear_cross_entropy(hidden, weight[:, :3], b, target)
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(hidden, weight, b, target, chunk_size=0)


def test_saves_no_logits_for_backward():
    n, h, v = 64, 8, 1000
    hidden, weight, b, target = _inputs(n, h, v)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = linear_cross_entropy(hidden, weight, b, target, chunk_size=16)
    assert max(saved) < n * v  # nothing of logits size: inputs and one value per row
    loss.backward()
    assert hidden.grad.shape == (n, h)


@pytest.mark.parametrize("backend", ["aot_eager", "mirrorgrad-eager"])
def test_compiled_gradients_equal_eager(backend):
    # Regression: as an autograd.Function, torch 2.11's Dynamo traced the backward
    # without its incoming gradient and every gradient came out zero.
    import mirrorgrad

    hidden, weight, b, target = _inputs(13, 5, 7)
    target[2] = -100

    def loss_fn(hidden, weight, b, target):
        return linear_cross_entropy(torch.tanh(hidden), weight, b, target, chunk_size=4)

    torch._dynamo.reset()
    if backend == "aot_eager":
        compiled = torch.compile(loss_fn, backend="aot_eager", fullgraph=True)
    else:
        compiled = mirrorgrad.compile(loss_fn, backend="eager", fullgraph=True)
    ours = compiled(hidden, weight, b, target)
    ref = loss_fn(hidden, weight, b, target)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    for g, r in zip(_grads(ours, (hidden, weight, b)), _grads(ref, (hidden, weight, b))):
        assert r.abs().max() > 0
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


def test_ops_pass_opcheck():
    from mirrorgrad.nn.functional import _lce_forward

    hidden, weight, b, target = _inputs(9, 4, 6)
    torch.library.opcheck(_lce_forward, (hidden, weight, b, target, 4))
