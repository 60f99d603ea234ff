"""The chunked linear + cross-entropy op against its plain-PyTorch reference (float64),
through both of its passes over the logits: the Triton kernels (fp32 and bf16; the
interpreter on CPU) and torch's (float64, or ``op.TRITON_PASSES`` off)."""

import gc

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from mirrorgrad import formulas
from mirrorgrad.ops import aligned_mm
from mirrorgrad.ops.linear_cross_entropy import kernels, linear_cross_entropy, op, reference
from mirrorgrad.ops.rnn.step_loop import interpreting

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


@pytest.fixture
def padding(monkeypatch):
    """Every call pads (where H is misaligned), on the CPU too; returns the list of the
    [rows, cols] each tensor the op pads is padded to."""
    shapes = []
    real = aligned_mm.padded

    def spy(t, rows, cols):
        shapes.append((rows, cols))
        return real(t, rows, cols)

    monkeypatch.setattr(aligned_mm, "pays_to_pad", lambda *args: True)
    monkeypatch.setattr(aligned_mm, "padded", spy)
    return shapes


@pytest.fixture
def launches(monkeypatch):
    """The names of the Triton passes the op launches, in order.

    A garbage collection follows each launch: the interpreter holds its arguments'
    storages in a reference cycle until the next one (a GPU launch copies nothing), which
    would keep each chunk of logits alive past the op's ``del``. The heap is frozen so
    that each collection walks only the test's own objects."""
    names = []

    def counted(name, real):
        def launch(*args, **kwargs):
            names.append(name)
            out = real(*args, **kwargs)
            gc.collect()
            return out

        return launch

    for name in ("lse_and_target_logit", "logits_to_grad_"):
        monkeypatch.setattr(kernels, name, counted(name, getattr(kernels, name)))
    gc.collect()
    gc.freeze()
    yield names
    gc.unfreeze()


# The Triton kernels run CPU tensors in the interpreter only (tests/conftest.py sets it
# where there is no GPU).
INTERPRETED = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1")


def _passes(monkeypatch, triton: bool) -> None:
    """The Triton passes where they run (fp32, bf16), or torch's everywhere."""
    if triton and not interpreting():
        pytest.skip("the Triton passes run CPU tensors under TRITON_INTERPRET=1 only")
    monkeypatch.setattr(op, "TRITON_PASSES", kernels.DTYPES if triton else ())


TRITON_OR_TORCH = pytest.mark.parametrize("triton", [True, False], ids=["triton", "torch"])


# hidden sizes whose rows are not 16 bytes wide, and their padded widths
MISALIGNED = {torch.float64: (7, 8), torch.float32: (18, 20), torch.bfloat16: (20, 24)}


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


@TRITON_OR_TORCH
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_is_as_close_to_float64_as_torch(monkeypatch, launches, dtype, triton):
    """|ours - ref64| <= 2 |torch in dtype - ref64| + atol, value and gradients, through
    the Triton passes (one launch per chunk each way) and torch's."""
    _passes(monkeypatch, triton)
    hidden, weight, b, target = _inputs(40, 8, 13)
    target[0], target[-1] = 0, 12  # the first and the last column
    low = [t.detach().to(dtype).requires_grad_() for t in (hidden, weight, b)]
    ours = linear_cross_entropy(*low[:2], low[2], target, chunk_size=9)
    same = reference.linear_cross_entropy(*low[:2], low[2], target)
    ref = reference.linear_cross_entropy(hidden, weight, b, target)
    assert ours.dtype == dtype
    atol = 1e-6 if dtype == torch.float32 else 1e-2
    pairs = [(ours, same, ref)]
    pairs += zip(_grads(ours, low), _grads(same, low), _grads(ref, (hidden, weight, b)))
    chunks = 5  # of 9 rows in 40
    assert launches == (chunks * ["lse_and_target_logit"] + chunks * ["logits_to_grad_"]
                        if triton else [])  # fmt: skip
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
@pytest.mark.parametrize("padded", [False, True], ids=["", "padded"])
@pytest.mark.parametrize("backend", ["aot_eager", "mirrorgrad-eager"])
def test_compiled_gradients_equal_eager(request, backend, padded):
    # Regression: as an autograd.Function, torch 2.11's Dynamo traced the backward
    # without its incoming gradient and every gradient came out zero. Padded: the planner
    # evaluates the padded path's formulas on fake tensors.
    import mirrorgrad

    pads = request.getfixturevalue("padding") if padded else []
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
    assert (pads != []) == padded


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["torch", "triton"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_ops_pass_opcheck(monkeypatch, launches, bias, dtype):
    """float64 runs torch's passes over the logits, float32 the Triton kernels."""
    _passes(monkeypatch, triton=dtype == torch.float32)
    _opcheck_both_ops(hidden_size=4, bias=bias, dtype=dtype)
    assert (launches != []) == (dtype == torch.float32)


def _opcheck_both_ops(hidden_size: int, bias: bool, dtype=DT) -> None:
    """torch.library.opcheck of the forward op and of the backward op (chunks of 4 rows)."""
    hidden, weight, b, target = _inputs(9, hidden_size, 6, bias=bias, dtype=dtype)
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


@TRITON_OR_TORCH
@pytest.mark.parametrize("padded", [False, True], ids=["", "padded"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("needs", [(True, True, True), (True, False, False), (False, True, True)])
@pytest.mark.parametrize("chunk", [32, 100])  # four chunks of 100 rows, or one
def test_memory_formulas_cover_what_the_op_allocates(request, monkeypatch, launches, dtype,
                                                     needs, chunk, padded, triton):  # fmt: skip
    """The declared temporaries against the allocations the op makes through ATen:
    backward exactly (all its temporaries are ATen results), forward exactly through
    the Triton kernel (which allocates nothing) and at least through torch's passes
    (plus logsumexp's internal [C, V], which the tracker cannot see, beside the padded
    W). Padded: H misaligned and the pads made to pay, so that W [V, P] and each chunk's
    rows [C, P] are padded on the CPU as on a GPU."""
    if dtype == torch.float64 and triton:
        pytest.skip("float64 runs torch's passes either way")
    _passes(monkeypatch, triton)
    h, width = MISALIGNED[dtype] if padded else (16, 16)
    pads = request.getfixturevalue("padding") if padded else []
    fwd_args, bwd_args, _ = _call_args(dtype, h=h)
    with PeakTracker(*fwd_args) as tracker:
        out = op.linear_cross_entropy_forward._init_fn(*fwd_args, chunk)
    assert (pads != []) == padded
    assert (launches != []) == triton
    declared = formulas.memory_formula(torch.ops.mirrorgrad.linear_cross_entropy_forward)
    seen = tracker.peak - sum(o.nbytes for o in out)
    v, a = 300, op.accumulation_dtype(dtype).itemsize
    padded_weight = v * width * dtype.itemsize if padded else 0
    hidden_by_logsumexp = 0 if triton else padded_weight + 2 * chunk * v * a
    assert declared(*fwd_args, chunk) == max(seen, hidden_by_logsumexp)
    pads.clear()
    with PeakTracker(*bwd_args) as tracker:
        out = op.linear_cross_entropy_backward._init_fn(*bwd_args, chunk, *needs)
    assert (pads != []) == padded
    declared = formulas.memory_formula(torch.ops.mirrorgrad.linear_cross_entropy_backward)
    assert declared(*bwd_args, chunk, *needs) == tracker.peak - sum(o.nbytes for o in out)
    assert all(o.is_contiguous() for o in out)


# Passes over the [N, V] logits: forward, the GEMM's write and the Triton kernel's read
# or torch's 6 logsumexp passes; backward, the GEMM's write, the kernel's read and write
# or torch's 6 in-place passes, and 3 reads (two GEMMs, the bias sum).
LOGITS_PASSES = {True: (1 + 1, 1 + 2 + 3), False: (1 + 6, 1 + 6 + 3)}


@TRITON_OR_TORCH
def test_bytes_formulas_count_the_logits_passes(monkeypatch, triton):
    """float32, no casts: the logits' passes (LOGITS_PASSES), plus hidden and the weight
    (gradient) per chunk."""
    _passes(monkeypatch, triton)
    (hidden, weight, b, target), bwd_args, needs = _call_args(torch.float32, n=10, h=3, v=7)
    chunks = 4  # chunk_size 3 over 10 rows
    fwd_passes, bwd_passes = LOGITS_PASSES[triton]
    fwd = formulas.bytes_formula(torch.ops.mirrorgrad.linear_cross_entropy_forward)
    expected = 10 * 3 + chunks * 7 * 3 + fwd_passes * 10 * 7
    assert fwd(hidden, weight, b, target, 3) == 4 * expected
    bwd = formulas.bytes_formula(torch.ops.mirrorgrad.linear_cross_entropy_backward)
    expected = 10 * 3 + chunks * 7 * 3 + bwd_passes * 10 * 7 + (chunks * 7 * 3 + 10 * 3)
    expected += 2 * chunks * 7 * 3 + 10 * 3
    assert bwd(*bwd_args, 3, *needs) == 4 * expected


@TRITON_OR_TORCH
def test_bytes_formulas_count_the_pads(monkeypatch, padding, triton):
    """As above with H 3 padded to P 4: W and hidden copied once each (read 3 wide, written
    4 wide), every GEMM operand 4 wide, and the gradients' real blocks cut out (read 4,
    written 3)."""
    _passes(monkeypatch, triton)
    n, h, p, v, chunks = 10, 3, 4, 7, 4
    fwd_passes, bwd_passes = LOGITS_PASSES[triton]
    (hidden, weight, b, target), bwd_args, needs = _call_args(torch.float32, n=n, h=h, v=v)
    pads = v * (h + p) + n * (h + p)
    fwd = formulas.bytes_formula(torch.ops.mirrorgrad.linear_cross_entropy_forward)
    expected = pads + n * p + chunks * v * p + fwd_passes * n * v
    assert fwd(hidden, weight, b, target, 3) == 4 * expected
    bwd = formulas.bytes_formula(torch.ops.mirrorgrad.linear_cross_entropy_backward)
    expected = pads + n * p + chunks * v * p + bwd_passes * n * v
    expected += chunks * v * p + n * p + n * (p + h)  # grad_hidden: W read, written, cut out
    expected += 2 * chunks * v * p + n * p + v * (p + h)  # grad_weight: accumulated, cut out
    assert bwd(*bwd_args, 3, *needs) == 4 * expected


# --- the Triton passes over one chunk of logits ------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize(("vocab", "block"), [(37, 16), (300, None), (5000, None)],
                         ids=["3_blocks", "1_block", "2_blocks"])  # fmt: skip
@INTERPRETED
def test_kernels_match_float64(dtype, rows, vocab, block):
    """Per-row log-sum-exp and target logit, then the gradient written over the logits,
    against float64 torch: vocabularies not a multiple of the block, targets in the
    first and the last column, zero incoming gradients in some rows."""
    logits = (4 * torch.randn(rows, vocab)).to(dtype)
    target = torch.randint(0, vocab, (rows,))
    target[0], target[-1] = vocab - 1, 0
    lse, target_logit = torch.full((rows,), torch.nan), torch.full((rows,), torch.nan)
    kernels.lse_and_target_logit(logits, target, lse, target_logit, block=block)
    x = logits.double()
    ref_lse = x.logsumexp(dim=1)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)
    assert torch.equal(target_logit, x.gather(1, target[:, None])[:, 0].float())

    grad_lse, grad_target = torch.randn(rows), torch.randn(rows)
    grad_lse[1::3] = 0
    grad_target[2::3] = 0
    expected = (x - ref_lse[:, None]).exp() * grad_lse[:, None].double()
    expected.scatter_add_(1, target[:, None], grad_target[:, None].double())
    out = kernels.logits_to_grad_(logits, target, lse, grad_lse, grad_target, block=block)
    assert out is logits and out.dtype == dtype
    # bf16: one step, as Triton's interpreter truncates float32 to bf16 (a GPU rounds to
    # nearest: half a step, test_kernels_round_like_torch_on_a_gpu); fp16: half a step.
    rtol = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-11 + 1e-5}[dtype]
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=1e-7)


def test_kernels_reject_what_they_cannot_run():
    logits, target, row = torch.randn(3, 5), torch.zeros(3, dtype=torch.int64), torch.empty(3)
    with pytest.raises(TypeError, match="take"):
        kernels.lse_and_target_logit(logits.double(), target, row, row)
    with pytest.raises(ValueError, match="unit column stride"):
        kernels.lse_and_target_logit(logits.T, target, row, row)
    with pytest.raises(ValueError, match=r"contiguous \[3\]"):
        kernels.logits_to_grad_(logits, target, row, row[:2], row)
    with pytest.raises(TypeError, match="float32"):
        kernels.logits_to_grad_(logits, target, row, row.double(), row)


def test_triton_passes_run_where_triton_runs(monkeypatch):
    """CUDA, or CPU under the interpreter, for the dtypes ``op.TRITON_PASSES`` names; not
    float64, not meta tensors, not with ``op.TRITON_PASSES`` empty, not without triton."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(op, "TRITON_PASSES", (torch.bfloat16, torch.float16))
    runs = [torch.empty(2, 3, dtype=dtype) for dtype in (torch.bfloat16, torch.float16)]
    assert all(op.kernels_for(t) is kernels for t in runs)
    assert op.kernels_for(torch.empty(2, 3)) is None
    with monkeypatch.context() as m:
        m.setattr(op, "TRITON_PASSES", kernels.DTYPES)
        assert op.kernels_for(torch.empty(2, 3)) is kernels
    assert op.kernels_for(torch.empty(2, 3, dtype=torch.float64)) is None
    assert op.kernels_for(torch.empty(2, 3, device="meta")) is None
    with monkeypatch.context() as m:
        m.setattr(op, "TRITON_PASSES", ())
        assert op.kernels_for(runs[0]) is None
    with monkeypatch.context() as m:
        m.setattr(op, "_triton_kernels", lambda: None)
        assert op.kernels_for(runs[0]) is None
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert op.kernels_for(runs[0]) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_kernel_dtype_runs_the_triton_passes_on_a_gpu_by_default():
    assert all(op.kernels_for(torch.empty(2, 3, dtype=d, device="cuda")) is kernels
               for d in kernels.DTYPES)  # fmt: skip


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


# --- the padded path: hidden rows not 16 bytes wide, padded where the copies pay ---------


# (bias, gradients asked for of hidden, weight, bias)
NEEDS = [(bias, needs) for bias in (True, False)
         for needs in [(True, True, True), (True, False, False), (False, True, True),
                       (False, False, True), (True, True, False)]
         if bias or needs[:2] != (False, False)]  # fmt: skip


def _needs_id(case) -> str:
    bias, needs = case
    asked = "".join(name for name, need in zip("hwb", needs) if need)
    return ("bias" if bias else "nobias") + "-needs-" + asked


@pytest.mark.parametrize("chunk_size", [7, 64], ids=["chunked", "one_chunk"])
@pytest.mark.parametrize("case", NEEDS, ids=_needs_id)
def test_padded_path_matches_reference_float64(padding, case, chunk_size):
    """W [V, 8] and each chunk's rows [C, 8] padded from H = 7; the gradients asked for
    equal the reference's to float64 rounding and come out contiguous [.., 7]."""
    bias, needs = case
    n, (h, width), v = 29, MISALIGNED[DT], 11
    hidden, weight, b, target = _inputs(n, h, v, bias=bias)
    target[3] = -100
    leaves = [t for t, need in zip((hidden, weight, b), needs) if t is not None and need]
    for t, need in zip((hidden, weight, b), needs):
        if t is not None:
            t.requires_grad_(need)
    ours = linear_cross_entropy(hidden, weight, b, target, chunk_size, "none")
    pads = [(v, width)] + [(min(chunk_size, n - s), width) for s in range(0, n, chunk_size)]
    assert padding == pads  # forward: W, then each chunk's rows
    ref = reference.linear_cross_entropy(hidden, weight, b, target, "none")
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    padding.clear()
    grads = _grads(ours, leaves)
    assert padding == pads  # backward
    for leaf, g, r in zip(leaves, grads, _grads(ref, leaves)):
        assert g.shape == leaf.shape and g.is_contiguous()
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


@TRITON_OR_TORCH
@pytest.mark.parametrize("chunk_size", [9, 64], ids=["chunked", "one_chunk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_path_low_precision_is_as_close_to_float64_as_torch(monkeypatch, padding, dtype,
                                                                   chunk_size, triton):  # fmt: skip
    """|ours - ref64| <= 2 |torch in dtype - ref64| + atol, value and gradients, with H
    18 (fp32) or 20 (bf16) padded to 16 bytes, through either passes."""
    _passes(monkeypatch, triton)
    h, width = MISALIGNED[dtype]
    hidden, weight, b, target = _inputs(40, h, 13)
    low = [t.detach().to(dtype).requires_grad_() for t in (hidden, weight, b)]
    ours = linear_cross_entropy(*low[:2], low[2], target, chunk_size=chunk_size)
    assert padding and all(cols == width for _, cols in padding)
    same = reference.linear_cross_entropy(*low[:2], low[2], target)
    ref = reference.linear_cross_entropy(hidden, weight, b, target)
    atol = 1e-6 if dtype == torch.float32 else 1e-2
    ours_grads = _grads(ours, low)
    pairs = [(ours, same, ref)]
    pairs += zip(ours_grads, _grads(same, low), _grads(ref, (hidden, weight, b)))
    for o, s, r in pairs:
        err, base = (o.double() - r).abs().max(), (s.double() - r).abs().max()
        assert err <= 2 * base + atol * r.abs().max().clamp(min=1)
    for leaf, g in zip(low, ours_grads):
        assert g.dtype == dtype and g.shape == leaf.shape and g.is_contiguous()


def test_pads_only_a_misaligned_hidden_size(padding):
    hidden, weight, b, target = _inputs(10, 8, 5, dtype=torch.float32)  # 32-byte rows
    linear_cross_entropy(hidden, weight, b, target, chunk_size=4).backward()
    assert padding == []


@pytest.mark.slow
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_padded_ops_pass_opcheck(padding, bias):
    _opcheck_both_ops(hidden_size=7, bias=bias)
    assert padding


def test_the_medium_lm_head_pads_at_batch_128_not_20_and_in_fp32_only(monkeypatch):
    """H 650, V 10,000, rows batch x bptt 35: in fp32 (TF32) the copies pay at 4,480 rows,
    not at 700 (the training step's calls: every gradient asked for); in bf16 the padded
    call ran slower (H200), so it never pads. The rule reads only shapes, dtype and
    device: meta tensors that say they are on CUDA."""
    weight = torch.empty(10000, 650, device="meta")
    small, large = (torch.empty(n, 650, device="meta") for n in (700, 4480))
    aligned = torch.empty(4480, 656, device="meta"), weight.new_empty(10000, 656)
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda")))
    matmul = torch.backends.cuda.matmul  # a module object: monkeypatch cannot undo it
    was = matmul.allow_tf32
    try:
        matmul.allow_tf32 = True
        assert op.forward_pads(large, weight) and not op.forward_pads(small, weight)
        for needs in [(True, True), (True, False), (False, True)]:
            assert op.backward_pads(large, weight, *needs)
        assert not op.backward_pads(small, weight, True, True)
        assert not op.forward_pads(*aligned)
        assert not op.forward_pads(large.bfloat16(), weight.bfloat16())
        assert not op.backward_pads(large.bfloat16(), weight.bfloat16(), True, True)
        matmul.allow_tf32 = False
        # fp32 without TF32 runs SIMT kernels, which have no 16-byte rule
        assert not op.forward_pads(large, weight)
    finally:
        matmul.allow_tf32 = was


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_medium_lm_head_pads_on_a_gpu_as_close_as_unpadded(monkeypatch, dtype):
    """H 650, V 10,000, 4,480 rows (batch 128 x bptt 35), fp32 with TF32 or bf16: the op
    made to pad W and each chunk's rows (forward and backward) and its loss and gradients are
    as close to float64 as the unpadded op's: |padded - ref64| <= 2 |unpadded - ref64|."""
    n, h, v = 4480, 650, 10000
    width = aligned_mm.aligned_width(h, dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", dtype=torch.float64, generator=g)
    weight = torch.randn(v, h, device="cuda", dtype=torch.float64, generator=g) / h**0.5
    bias = 0.1 * torch.randn(v, device="cuda", dtype=torch.float64, generator=g)
    target = torch.randint(0, v, (n,), device="cuda", generator=g)

    def loss_and_grads(tensors, pads):
        shapes = []
        with monkeypatch.context() as m:
            real = aligned_mm.padded
            m.setattr(aligned_mm, "padded", lambda t, r, c: shapes.append((r, c)) or real(t, r, c))
            # Forced both ways: the rule pads fp32 at this size, not bf16.
            m.setattr(aligned_mm, "pays_to_pad", lambda *args: pads)
            leaves = [t.detach().to(dtype).requires_grad_() for t in tensors]
            loss = linear_cross_entropy(*leaves, target)
            return [loss, *torch.autograd.grad(loss, leaves)], shapes

    matmul = torch.backends.cuda.matmul  # a module object: monkeypatch cannot undo it
    was = matmul.allow_tf32
    try:
        matmul.allow_tf32 = True
        padded, shapes = loss_and_grads((hidden, weight, bias), pads=True)
        unpadded, none = loss_and_grads((hidden, weight, bias), pads=False)
    finally:
        matmul.allow_tf32 = was
    chunk = op.CHUNK_BYTES // (4 * v)
    rows = [(min(chunk, n - s), width) for s in range(0, n, chunk)]
    assert shapes == 2 * [(v, width), *rows] and none == []
    leaves = [t.requires_grad_() for t in (hidden, weight, bias)]
    ref = reference.linear_cross_entropy(*leaves, target)
    for p, u, r in zip(padded, unpadded, [ref, *torch.autograd.grad(ref, leaves)]):
        assert p.shape == r.shape and p.dtype == dtype and p.is_contiguous()
        err, base = (p.double() - r).abs().max(), (u.double() - r).abs().max()
        assert err <= 2 * base + 1e-6 * r.abs().max()


# --- the Triton passes on a GPU at the medium word LM's head ------------------------------

HIDDEN, VOCAB = 650, 10000  # rows: batch 20 or 128 x bptt 35, 700 or 4,480
NEEDS_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@NEEDS_GPU
@pytest.mark.parametrize("rows", [700, 4480])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_round_like_torch_on_a_gpu(rows, dtype):
    """The head's logits as one chunk: log-sum-exp to float32 rounding, the target logit
    exactly, the gradient within half a step of its dtype of the float64 one (rounded to
    nearest, as torch's ``.to``)."""
    logits = (3 * torch.randn(rows, VOCAB, device="cuda")).to(dtype)
    target = torch.randint(0, VOCAB, (rows,), device="cuda")
    target[0], target[-1] = 0, VOCAB - 1
    lse, target_logit = torch.empty(rows, device="cuda"), torch.empty(rows, device="cuda")
    kernels.lse_and_target_logit(logits, target, lse, target_logit)
    x = logits.double()
    ref_lse = x.logsumexp(dim=1)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=2e-6, atol=2e-6)
    assert torch.equal(target_logit, x.gather(1, target[:, None])[:, 0].float())
    grad_lse, grad_target = torch.randn(rows, device="cuda"), torch.randn(rows, device="cuda")
    grad_lse[1::3] = 0
    expected = (x - ref_lse[:, None]).exp() * grad_lse[:, None].double()
    expected.scatter_add_(1, target[:, None], grad_target[:, None].double())
    kernels.logits_to_grad_(logits, target, lse, grad_lse, grad_target)
    rtol = 1e-5 if dtype == torch.float32 else 2**-8 + 1e-5
    torch.testing.assert_close(logits.double(), expected, rtol=rtol, atol=1e-7)


def _head_step(leaves, target, triton: bool):
    """(loss and gradients, peak bytes beyond what existed before) of the op's forward
    and backward through the Triton passes or torch's."""
    was = op.TRITON_PASSES
    op.TRITON_PASSES = kernels.DTYPES if triton else ()
    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss = linear_cross_entropy(*leaves, target)
        results = [loss, *torch.autograd.grad(loss, leaves)]
        torch.cuda.synchronize()
        return results, torch.cuda.max_memory_allocated() - before
    finally:
        op.TRITON_PASSES = was


@pytest.mark.gpu
@NEEDS_GPU
@pytest.mark.parametrize("rows", [700, 4480])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_medium_lm_head_triton_passes_as_close_as_torch_passes(rows, dtype):
    """H 650, V 10,000, fp32 (TF32 as the rule and the LM allow) or bf16: the loss and
    every gradient through the Triton passes as close to float64 as through torch's,
    |triton - ref64| <= 2 |torch - ref64| + 1e-6 max|ref64|; in bf16 the peak lower (no
    float32 copies)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    full = [torch.randn(rows, HIDDEN, device="cuda", dtype=torch.float64, generator=g),
            torch.randn(VOCAB, HIDDEN, device="cuda", dtype=torch.float64, generator=g)
            / HIDDEN**0.5,
            0.1 * torch.randn(VOCAB, device="cuda", dtype=torch.float64, generator=g)]  # fmt: skip
    target = torch.randint(0, VOCAB, (rows,), device="cuda", generator=g)
    leaves = [t.detach().to(dtype).requires_grad_() for t in full]
    matmul = torch.backends.cuda.matmul  # a module object: monkeypatch cannot undo it
    was = matmul.allow_tf32
    try:
        matmul.allow_tf32 = True
        _head_step(leaves, target, triton=True)  # compiles the kernels, fills cuBLAS' caches
        fused, fused_peak = _head_step(leaves, target, triton=True)
        eager, eager_peak = _head_step(leaves, target, triton=False)
    finally:
        matmul.allow_tf32 = was
    full = [t.requires_grad_() for t in full]
    ref = reference.linear_cross_entropy(*full, target)
    for f, e, r in zip(fused, eager, [ref, *torch.autograd.grad(ref, full)]):
        assert f.shape == r.shape and f.dtype == dtype
        err, base = (f.double() - r).abs().max(), (e.double() - r).abs().max()
        assert err <= 2 * base + 1e-6 * r.abs().max()
    if dtype == torch.bfloat16:  # fp32 runs torch's passes by default: no peak claimed
        assert fused_peak < eager_peak


@pytest.mark.gpu
@NEEDS_GPU
@pytest.mark.parametrize("rows", [700, 4480])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_formulas_match_a_gpu(rows, dtype):
    """The Triton path's declared temporaries against the CUDA allocator's peak, every
    gradient asked for, one chunk (700 rows) and three (4,480): within 1% and 2 MiB
    (blocks rounded to 512 bytes), where a [C, V] chunk is 33-67 MB."""
    (hidden, weight, b, target), bwd_args, needs = _call_args(dtype, n=rows, h=HIDDEN, v=VOCAB)
    fwd_args = [t.cuda() for t in (hidden, weight, b, target)]
    bwd_args = [t.cuda() for t in bwd_args]
    chunk = op.CHUNK_BYTES // (4 * VOCAB)
    forward = op.linear_cross_entropy_forward._init_fn
    backward = op.linear_cross_entropy_backward._init_fn
    for run, args, formula in [
        (forward, (*fwd_args, chunk), torch.ops.mirrorgrad.linear_cross_entropy_forward),
        (backward, (*bwd_args, chunk, *needs), torch.ops.mirrorgrad.linear_cross_entropy_backward),
    ]:
        run(*args)  # compiles the kernels, allocates cuBLAS' workspace
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = run(*args)
        torch.cuda.synchronize()
        seen = torch.cuda.max_memory_allocated() - before - sum(o.nbytes for o in out)
        declared = formulas.memory_formula(formula)(*args)
        assert abs(declared - seen) <= 2 * 2**20 + 0.01 * declared, (declared, seen)
