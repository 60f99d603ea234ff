"""The chunked linear + cross-entropy op against its plain-PyTorch reference (float64)."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from mirrorgrad import formulas
from mirrorgrad.ops.linear_cross_entropy import linear_cross_entropy, op, reference

from .memory_tracker import PeakTracker

DT = torch.float64


def _inputs(n: int, h: int, v: int, *, bias: bool = True, dtype=DT):
    hidden = torch.randn(n, h, dtype=dtype, requires_grad=True)
    weight = torch.randn(v, h, dtype=dtype, requires_grad=True)
    b = torch.randn(v, dtype=dtype, requires_grad=True) if bias else None
    target = torch.randint(0, v, (n,))
    return hidden, weight, b, target


def _grads(loss, tensors):
    """Gradients of a non-trivial scalar: rows weighted unequally for reduction="none"."""
    if loss.dim() > 0:
        weights = torch.linspace(0.5, 2.0, loss.numel(), dtype=loss.dtype).view(loss.shape)
        loss = (loss * weights).sum()
    return torch.autograd.grad(loss * 1.7, [t for t in tensors if t is not None])


def _assert_matches(ours, ref, tensors, tol=1e-12):
    torch.testing.assert_close(ours, ref, rtol=tol, atol=tol)
    for g, r in zip(_grads(ours, tensors), _grads(ref, tensors)):
        assert r.abs().max() > 0
        torch.testing.assert_close(g, r, rtol=tol, atol=tol)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk_size", [1, 7, 29, 64], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_matches_reference_float64(reduction, chunk_size, bias):
    """Odd sizes (29 rows, 6 features, 11 classes), chunks that do and do not divide
    the rows, ignored rows."""
    hidden, weight, b, target = _inputs(29, 6, 11, bias=bias)
    target[3] = target[17] = -100
    ours = linear_cross_entropy(hidden, weight, b, target, chunk_size, reduction)
    ref = reference.linear_cross_entropy(hidden, weight, b, target, reduction)
    _assert_matches(ours, ref, (hidden, weight, b))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_custom_ignore_index_and_batch_dims(reduction):
    hidden = torch.randn(5, 3, 4, dtype=DT, requires_grad=True)
    weight = torch.randn(9, 4, dtype=DT, requires_grad=True)
    target = torch.randint(0, 9, (5, 3))
    target[0, 1] = 2
    ours = linear_cross_entropy(hidden, weight, None, target, 4, reduction, ignore_index=2)
    ref = reference.linear_cross_entropy(hidden, weight, None, target, reduction, 2)
    assert ours.shape == ref.shape
    _assert_matches(ours, ref, (hidden, weight))


def test_reference_is_torch_cross_entropy():
    hidden, weight, b, target = _inputs(7, 3, 5)
    ref = F.cross_entropy(F.linear(hidden, weight, b), target, reduction="sum")
    ours = reference.linear_cross_entropy(hidden, weight, b, target, "sum")
    torch.testing.assert_close(ours, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_is_as_close_to_float64_as_torch(dtype):
    """|ours - ref64| <= 2 |torch in dtype - ref64| + atol, value and gradients."""
    hidden, weight, b, target = _inputs(40, 8, 13)
    low = [t.detach().to(dtype).requires_grad_() for t in (hidden, weight, b)]
    ours = linear_cross_entropy(*low[:2], low[2], target, chunk_size=9)
    same = reference.linear_cross_entropy(*low[:2], low[2], target)
    ref = reference.linear_cross_entropy(hidden, weight, b, target)
    assert ours.dtype == dtype
    atol = 1e-6 if dtype == torch.float32 else 1e-2
    pairs = [(ours, same, ref)]
    pairs += zip(_grads(ours, low), _grads(same, low), _grads(ref, (hidden, weight, b)))
    for o, s, r in pairs:
        err, base = (o.double() - r).abs().max(), (s.double() - r).abs().max()
        assert err <= 2 * base + atol * r.abs().max().clamp(min=1)


def test_frozen_weight_and_bias_get_no_gradient():
    hidden, weight, b, target = _inputs(10, 4, 5)
    weight.requires_grad_(False)
    b.requires_grad_(False)
    loss = linear_cross_entropy(hidden, weight, b, target, chunk_size=3)
    loss.backward()
    assert weight.grad is None and b.grad is None
    ref_h = hidden.detach().clone().requires_grad_()
    reference.linear_cross_entropy(ref_h, weight, b, target).backward()
    torch.testing.assert_close(hidden.grad, ref_h.grad, rtol=1e-12, atol=1e-12)


def test_only_weight_needs_gradient():
    hidden, weight, _, target = _inputs(10, 4, 5, bias=False)
    hidden.requires_grad_(False)
    (grad,) = torch.autograd.grad(linear_cross_entropy(hidden, weight, None, target, 4), weight)
    ref = reference.linear_cross_entropy(hidden, weight, None, target)
    (ref,) = torch.autograd.grad(ref, weight)
    torch.testing.assert_close(grad, ref, rtol=1e-12, atol=1e-12)


def test_bad_inputs_raise_like_cross_entropy():
    hidden, weight, b, target = _inputs(6, 4, 5)
    with pytest.raises(ValueError, match="target shape"):
        linear_cross_entropy(hidden, weight, b, target[:5])
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(hidden, weight, b, target, reduction="avg")
    with pytest.raises(RuntimeError, match="weight must be"):
        linear_cross_entropy(hidden, weight[:, :3], b, target)
    with pytest.raises(RuntimeError, match="bias must be"):
        linear_cross_entropy(hidden, weight, b[:4], target)
    with pytest.raises(RuntimeError, match="long"):
        linear_cross_entropy(hidden, weight, b, target.int())
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


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "mirrorgrad-eager"])
def test_compiled_gradients_equal_eager(backend):
    # Regression: as an autograd.Function, torch 2.11's Dynamo traced the backward
    # without its incoming gradient and every gradient came out zero.
    import mirrorgrad

    hidden, weight, b, target = _inputs(13, 5, 7)
    target[2] = -100

    def loss_fn(hidden, weight, b, target):
        return linear_cross_entropy(torch.tanh(hidden), weight, b, target, chunk_size=4)

    torch.compiler.reset()
    if backend == "aot_eager":
        compiled = torch.compile(loss_fn, backend="aot_eager", fullgraph=True)
    else:
        compiled = mirrorgrad.compile(loss_fn, backend="eager", fullgraph=True)
    _assert_matches(compiled(hidden, weight, b, target), loss_fn(hidden, weight, b, target),
                    (hidden, weight, b))  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_ops_pass_opcheck(bias):
    hidden, weight, b, target = _inputs(9, 4, 6, bias=bias)
    torch.library.opcheck(op.linear_cross_entropy_forward, (hidden, weight, b, target, 4))
    lse, _ = op.linear_cross_entropy_forward(hidden, weight, b, target, 4)
    b = None if b is None else b.detach()
    args = (torch.randn_like(lse), torch.randn_like(lse), hidden.detach(), weight.detach(), b,
            target, lse.detach(), 4, True, True, bias)  # fmt: skip
    torch.library.opcheck(torch.ops.mirrorgrad.linear_cross_entropy_backward, args)


def test_flop_formulas():
    n, h, v = 12, 5, 7
    hidden, weight, b, target = _inputs(n, h, v)
    with FlopCounterMode(display=False) as counter:
        linear_cross_entropy(hidden, weight, b, target, chunk_size=5).backward()
    flops = counter.get_flop_counts()["Global"]
    gemm = 2 * n * h * v
    assert flops[torch.ops.mirrorgrad.linear_cross_entropy_forward] == gemm
    assert flops[torch.ops.mirrorgrad.linear_cross_entropy_backward] == 3 * gemm


def _call_args(dtype, n=100, h=16, v=300, needs=(True, True, True)):
    hidden, weight, b, target = (t.detach() if t.dtype != torch.int64 else t
                                 for t in _inputs(n, h, v, dtype=dtype))  # fmt: skip
    lse = torch.randn(n, dtype=op.accumulation_dtype(dtype))
    return (hidden, weight, b, target), (lse, torch.randn_like(lse), hidden, weight, b, target,
                                         lse), needs  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("needs", [(True, True, True), (True, False, False), (False, True, True)])
@pytest.mark.parametrize("chunk", [32, 100])  # four chunks of 100 rows, or one
def test_memory_formulas_cover_what_the_op_allocates(dtype, needs, chunk):
    """The declared temporaries against the allocations the op makes through ATen:
    backward exactly (all its temporaries are ATen results), forward at least (plus
    logsumexp's internal [C, V], which the tracker cannot see)."""
    fwd_args, bwd_args, _ = _call_args(dtype)
    with PeakTracker(*fwd_args) as tracker:
        out = op.linear_cross_entropy_forward._init_fn(*fwd_args, chunk)
    declared = formulas.memory_formula(torch.ops.mirrorgrad.linear_cross_entropy_forward)
    seen = tracker.peak - sum(o.nbytes for o in out)
    v, a = 300, op.accumulation_dtype(dtype).itemsize
    assert declared(*fwd_args, chunk) == max(seen, 2 * chunk * v * a)
    with PeakTracker(*bwd_args) as tracker:
        out = op.linear_cross_entropy_backward._init_fn(*bwd_args, chunk, *needs)
    declared = formulas.memory_formula(torch.ops.mirrorgrad.linear_cross_entropy_backward)
    assert declared(*bwd_args, chunk, *needs) == tracker.peak - sum(o.nbytes for o in out)


def test_bytes_formulas_count_the_logits_passes():
    """float32, no casts: forward 1 write + 6 logsumexp passes over [N, V]; backward 1
    write + 6 in-place + 3 reads, plus hidden and the weight (gradient) per chunk."""
    (hidden, weight, b, target), bwd_args, needs = _call_args(torch.float32, n=10, h=3, v=7)
    chunks = 4  # chunk_size 3 over 10 rows
    fwd = formulas.bytes_formula(torch.ops.mirrorgrad.linear_cross_entropy_forward)
    assert fwd(hidden, weight, b, target, 3) == 4 * (10 * 3 + chunks * 7 * 3 + 7 * 10 * 7)
    bwd = formulas.bytes_formula(torch.ops.mirrorgrad.linear_cross_entropy_backward)
    expected = 10 * 3 + chunks * 7 * 3 + 10 * 7 * 10 + (chunks * 7 * 3 + 10 * 3)
    expected += 2 * chunks * 7 * 3 + 10 * 3
    assert bwd(*bwd_args, 3, *needs) == 4 * expected


def test_public_name_in_nn_functional():
    import mirrorgrad.nn.functional as mf

    assert mf.linear_cross_entropy is linear_cross_entropy


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("hidden_dtype", [torch.float32, torch.bfloat16])
def test_autocast_matches_linear_then_cross_entropy_under_autocast(bias, hidden_dtype):
    """Under bf16 autocast it computes what F.linear + F.cross_entropy do there: the
    matmul in bf16 from fp32 weights, a float32 loss, gradients in the leaves' dtypes
    (an LSTM under autocast hands it bf16 hidden states, the decoder is fp32)."""
    torch.manual_seed(0)
    hidden = torch.randn(6, 5, 16, dtype=hidden_dtype, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    b = torch.randn(40, requires_grad=True) if bias else None
    target = torch.randint(0, 40, (6, 5))
    leaves = [hidden, weight] + ([b] if bias else [])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = linear_cross_entropy(hidden, weight, b, target, chunk_size=7)
        theirs = F.cross_entropy(F.linear(hidden, weight, b).flatten(0, 1), target.flatten())
    assert ours.dtype == theirs.dtype == torch.float32
    ours_grads = torch.autograd.grad(ours, leaves)
    theirs_grads = torch.autograd.grad(theirs, leaves)
    torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-3)
    for leaf, mine, torchs in zip(leaves, ours_grads, theirs_grads):
        assert mine.dtype == leaf.dtype
        torch.testing.assert_close(mine, torchs, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_dtype_float32_is_the_loss_of_upcast_logits(reduction):
    """bfloat16 operands, dtype=torch.float32: F.cross_entropy(F.linear(...).float()), as
    transformers computes an LM's loss; the loss in float32, the gradients in bfloat16."""
    hidden, weight, b, target = _inputs(24, 8, 13, dtype=torch.bfloat16)
    target[[3, 9]] = -100
    ours = linear_cross_entropy(
        hidden, weight, b, target, chunk_size=5, reduction=reduction, dtype=torch.float32
    )
    ref = F.cross_entropy(F.linear(hidden, weight, b).float(), target, reduction=reduction)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(_grads(ours, (hidden, weight, b)), _grads(ref, (hidden, weight, b))):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g, r, rtol=2e-2, atol=2e-2)
