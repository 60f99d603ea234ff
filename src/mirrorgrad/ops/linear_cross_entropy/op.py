"""Chunked linear + cross-entropy as two torch.library ops, with autograd and formulas.

``mirrorgrad::linear_cross_entropy_forward`` keeps one log-sum-exp and one target
logit per row, computing ``chunk_size`` rows of logits at a time;
``mirrorgrad::linear_cross_entropy_backward`` recomputes each chunk's logits and turns
them into their gradient in place. The ``[rows, vocab]`` logits never exist whole.
Where Triton runs (CUDA; CPU under ``TRITON_INTERPRET=1``) one kernel per chunk does each
of those passes (``kernels``: the logits read once in their dtype, their gradient written
over them); elsewhere (float64, CPU without the interpreter) torch's passes do, in the
accumulation dtype.
Fake kernels, autograd, FLOP, bytes and memory formulas make compilers and the planner
see (and cost) one node each way.

Where the hidden size's rows are not 16 bytes wide (650 elements, the word LM's), cuBLAS
runs the GEMMs with slow kernels; each call then decides once (`forward_pads`,
`backward_pads`) whether to pad the weight to ``[V, aligned_width(H)]`` for the call and
each chunk's rows likewise, so that every GEMM has 16-byte leading dimensions.

Ops, not an autograd.Function: torch 2.11's Dynamo traced the Function's backward
without its incoming gradient (every gradient came out zero under torch.compile).
"""

from __future__ import annotations

import contextlib
import functools
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from mirrorgrad.formulas import register_bytes_formula, register_memory_formula
from mirrorgrad.ops import aligned_mm
from mirrorgrad.ops.rnn.step_loop import interpreting

# Auto chunk size: rows whose float32 logits fit in this many bytes.
CHUNK_BYTES = 64 * 2**20
REDUCTIONS = ("mean", "sum", "none")
# The logits' dtypes whose passes run as Triton kernels where Triton runs (benchmarks and
# tests set others; () runs torch's everywhere). On an H200 at the word LM's head (vocab
# 10,000), forward+backward captured in a CUDA Graph as `train lm` runs it, the kernels
# ran 1.18x (fp32) and 1.50x (bf16) faster at 700 rows, 1.37x and 1.60x at 4,480, and
# halved bf16's peak (benchmarks/lce_fused.py --graphed). Uncaptured calls at 700 rows are
# host-bound: there fp32 ran 0.76x (Triton's launcher costs more host time than torch's
# few fp32 launches); at 4,480 rows 1.05x.
TRITON_PASSES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half-precision logits are summed in float32; float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


@functools.cache
def _triton_kernels() -> ModuleType | None:
    """``kernels``, or None where triton is not installed."""
    try:
        from mirrorgrad.ops.linear_cross_entropy import kernels
    except ImportError:
        return None
    return kernels


def kernels_for(hidden: Tensor) -> ModuleType | None:
    """The Triton passes' module where they run for logits of ``hidden``'s dtype and
    device (CUDA, or CPU under the interpreter), else None: torch's passes run."""
    device = hidden.device.type
    on_device = device == "cuda" or (device == "cpu" and interpreting())
    kernels = _triton_kernels() if hidden.dtype in TRITON_PASSES and on_device else None
    return kernels if kernels is not None and hidden.dtype in kernels.DTYPES else None


def _pays_to_pad(hidden: Tensor, weight: Tensor, gemms: int, copied_elements: int) -> bool:
    """Whether ``gemms`` products of [N, H] by [H, V] (or their transposes) run faster with
    H padded to 16 bytes, the pads copying ``copied_elements`` elements of weight's dtype."""
    n, h = hidden.shape
    flops = gemms * 2 * n * h * weight.shape[0]
    return aligned_mm.width_to_run(h, flops, copied_elements, weight.dtype, weight.device) != h


def forward_pads(hidden: Tensor, weight: Tensor) -> bool:
    """Whether the forward pads: the logits' GEMM against copies of W and hidden's rows."""
    (n, h), v = hidden.shape, weight.shape[0]
    return _pays_to_pad(hidden, weight, 1, v * h + n * h)


def backward_pads(hidden: Tensor, weight: Tensor, need_hidden: bool, need_weight: bool) -> bool:
    """Whether the backward pads: the recomputed logits and each gradient's GEMM against
    copies of W, hidden's rows and the real blocks of the padded gradients."""
    (n, h), v = hidden.shape, weight.shape[0]
    gemms = 1 + bool(need_hidden) + bool(need_weight)
    copied = v * h + n * h + n * h * bool(need_hidden) + v * h * bool(need_weight)
    return _pays_to_pad(hidden, weight, gemms, copied)


def _width(hidden: Tensor, weight: Tensor, pad: bool) -> int:
    """The row width the GEMMs see: H, or H padded to 16 bytes."""
    h = hidden.shape[1]
    return aligned_mm.aligned_width(h, weight.dtype) if pad else h


def _widened(t: Tensor, width: int) -> Tensor:
    """``t`` [R, H], zero-padded to ``width`` columns where that is wider (``t`` itself
    otherwise, whatever its alignment: the call decided not to pad)."""
    return aligned_mm.padded(t, t.shape[0], width) if width != t.shape[1] else t


@torch.library.custom_op("mirrorgrad::linear_cross_entropy_forward", mutates_args=())
def linear_cross_entropy_forward(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, chunk_size: int
) -> tuple[Tensor, Tensor]:
    """Per-row (log-sum-exp, target logit) of ``hidden @ weight.T + bias``, chunk by chunk.

    hidden [N, H]; weight [V, H]; bias [V] or None; target int64 [N] in [0, V)."""
    acc = accumulation_dtype(hidden.dtype)
    n = hidden.shape[0]
    kernels = kernels_for(hidden)
    target = target.contiguous()
    width = _width(hidden, weight, forward_pads(hidden, weight))
    # Padded for this call only: a padded W kept for the backward would add to the peak.
    weight = _widened(weight, width)
    lse = hidden.new_empty(n, dtype=acc)
    target_logit = hidden.new_empty(n, dtype=acc)
    for start in range(0, n, chunk_size):
        rows = slice(start, start + chunk_size)
        # [C, V] in hidden's dtype; the padded rows are freed before the passes run.
        logits = F.linear(_widened(hidden[rows], width), weight, bias)
        if kernels is not None:
            kernels.lse_and_target_logit(logits, target[rows], lse[rows], target_logit[rows])
        else:
            logits = logits.to(acc)
            torch.logsumexp(logits, dim=1, out=lse[rows])
            torch.gather(logits, 1, target[rows, None], out=target_logit[rows, None])
        del logits  # one chunk of logits alive at a time, not two
    return lse, target_logit


@linear_cross_entropy_forward.register_fake
def _forward_fake(hidden, weight, bias, target, chunk_size):
    acc = accumulation_dtype(hidden.dtype)
    n = hidden.shape[0]
    return hidden.new_empty(n, dtype=acc), hidden.new_empty(n, dtype=acc)


@torch.library.custom_op("mirrorgrad::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward(
    grad_lse: Tensor,
    grad_target_logit: Tensor,
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    lse: Tensor,
    chunk_size: int,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of sum(grad_lse * lse + grad_target_logit * target_logit), the logits
    recomputed per chunk.

    Unneeded gradients come back as empty tensors (an op cannot return None)."""
    acc = lse.dtype
    h_size = hidden.shape[1]
    kernels = kernels_for(hidden)
    target, lse = target.contiguous(), lse.contiguous()
    grad_lse, grad_target_logit = grad_lse.contiguous(), grad_target_logit.contiguous()
    width = _width(hidden, weight, backward_pads(hidden, weight, need_hidden, need_weight))
    padded_weight = _widened(weight, width)
    # Half-precision operands: the weight gradient's products run in their dtype on
    # tensor cores (accumulating in float32 inside, as autocast's Linear backward); a
    # float32 product here ran as a SIMT kernel, ~250 us of a 2.5 ms bf16 LM step (H200,
    # hidden 650: rows not 16-byte aligned). Chunks are summed in float32; one chunk's
    # product is the gradient itself.
    half = weight.dtype != acc
    one_chunk = hidden.shape[0] <= chunk_size
    grad_hidden = hidden.new_empty(hidden.shape if need_hidden else 0)
    grad_weight = None  # [V, width]: its real block [V, H] is the output
    if need_weight and not (half and one_chunk):
        grad_weight = weight.new_zeros(weight.shape[0], width, dtype=acc)
    grad_bias = weight.new_zeros(weight.shape[0], dtype=acc) if need_bias else None
    for start in range(0, hidden.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        h = _widened(hidden[rows], width)
        # [C, V]: the recomputed logits become their own gradient, in place; ``operand``
        # is that gradient in the weight's dtype, the GEMMs' operand.
        grad_logits = F.linear(h, padded_weight, bias)
        if kernels is not None:  # computed in float32, stored in the logits' dtype
            operand = kernels.logits_to_grad_(
                grad_logits, target[rows], lse[rows], grad_lse[rows], grad_target_logit[rows]
            )
        else:
            grad_logits = grad_logits.to(acc)
            grad_logits.sub_(lse[rows, None]).exp_().mul_(grad_lse[rows, None])
            grad_logits.scatter_add_(1, target[rows, None], grad_target_logit[rows, None])
            cast = half and (need_hidden or need_weight)
            operand = grad_logits.to(weight.dtype) if cast else grad_logits
        if need_hidden:  # [C, V] @ [V, width], its real block copied into the output
            grad_hidden[rows] = (operand @ padded_weight)[:, :h_size]
        if need_weight and not half:
            grad_weight.addmm_(operand.T, h)  # [V, C] @ [C, width]
        elif need_weight and one_chunk:
            grad_weight = operand.T @ h
        elif need_weight:
            grad_weight += operand.T @ h
        del operand
        if grad_bias is not None:
            # The column sum as a GEMV: torch's ``sum(0)`` of a [C, V] chunk staged about two
            # chunks of its own (H200, 1,677 x 10k). A half-precision chunk's sums come back
            # in its dtype (accumulated in float32 inside) and are summed in float32.
            ones = grad_logits.new_ones(grad_logits.shape[0])
            if grad_logits.dtype == acc:
                grad_bias.addmv_(grad_logits.T, ones)
            else:
                grad_bias += torch.mv(grad_logits.T, ones)
            del ones
        del grad_logits, h  # one chunk alive at a time
    # Each output its own tensor, even the empty ones: outputs of an op may not alias.
    # The real block of a padded gradient is copied out contiguous (.to of a strided view
    # in another dtype is already contiguous; in the same dtype it is the view itself).
    return (
        grad_hidden,
        grad_weight[:, :h_size].to(weight.dtype).contiguous()
        if grad_weight is not None
        else weight.new_empty(0),
        grad_bias.to(bias.dtype) if grad_bias is not None else weight.new_empty(0),
    )


@linear_cross_entropy_backward.register_fake
def _backward_fake(grad_lse, grad_target_logit, hidden, weight, bias, target, lse, chunk_size,
                   need_hidden, need_weight, need_bias):  # fmt: skip
    # new_empty, not empty_like: the real gradients are contiguous whatever the inputs'
    # strides, and Inductor asserts the strides the fake kernel gave.
    return (
        hidden.new_empty(hidden.shape if need_hidden else 0),
        weight.new_empty(weight.shape if need_weight else 0),
        bias.new_empty(bias.shape) if need_bias else weight.new_empty(0),
    )


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, bias, target, chunk_size = inputs
    ctx.save_for_backward(hidden, weight, bias, target, output[0])
    ctx.chunk_size = chunk_size


def _backward(ctx, grad_lse: Tensor, grad_target_logit: Tensor):
    hidden, weight, bias, target, lse = ctx.saved_tensors
    need_hidden, need_weight = ctx.needs_input_grad[:2]
    need_bias = bias is not None and ctx.needs_input_grad[2]
    if grad_lse is None:
        grad_lse = torch.zeros_like(lse)
    if grad_target_logit is None:
        grad_target_logit = torch.zeros_like(lse)
    grads = torch.ops.mirrorgrad.linear_cross_entropy_backward(
        grad_lse, grad_target_logit, hidden, weight, bias, target, lse, ctx.chunk_size,
        need_hidden, need_weight, need_bias,
    )  # fmt: skip
    return (
        grads[0] if need_hidden else None,
        grads[1] if need_weight else None,
        grads[2] if need_bias else None,
        None,
        None,
    )


linear_cross_entropy_forward.register_autograd(_backward, setup_context=_setup_context)


# --- formulas: FLOPs (torch's registry, shapes in place of tensors), bytes, memory ------


@register_flop_formula(torch.ops.mirrorgrad.linear_cross_entropy_forward)
def _forward_flops(hidden, weight, *args, out_shape=None, **kwargs) -> int:
    """The logits GEMM [N, H] @ [H, V]."""
    return 2 * hidden[0] * hidden[1] * weight[0]


@register_flop_formula(torch.ops.mirrorgrad.linear_cross_entropy_backward)
def _backward_flops(grad_lse, grad_target_logit, hidden, weight, bias, target, lse, chunk_size,
                    need_hidden, need_weight, *args, out_shape=None, **kwargs) -> int:  # fmt: skip
    """The logits recomputed, then one GEMM per gradient of hidden and of weight."""
    gemm = 2 * hidden[0] * hidden[1] * weight[0]
    return gemm * (1 + bool(need_hidden) + bool(need_weight))


def _sizes(hidden: Tensor, weight: Tensor, chunk_size: int):
    """(N, H, V, C, chunks, d, dw, a): rows, hidden size, vocabulary, rows per chunk,
    chunks, and the bytes per element of hidden, weight and the accumulation dtype."""
    n, h = hidden.shape
    v = weight.shape[0]
    c = min(chunk_size, n)
    chunks = -(-n // chunk_size)
    a = accumulation_dtype(hidden.dtype).itemsize
    return n, h, v, c, chunks, hidden.dtype.itemsize, weight.dtype.itemsize, a


@register_memory_formula(torch.ops.mirrorgrad.linear_cross_entropy_forward)
def _forward_temporary_bytes(hidden, weight, bias, target, chunk_size) -> int:
    """One chunk of logits [C, V]; torch's passes add its cast to the accumulation dtype
    and logsumexp's [C, V] temporary (``exp(logits - max)``), the Triton kernel nothing.
    Where the call pads, W padded [V, P] throughout and a chunk's padded rows [C, P]
    beside the GEMM's output."""
    _, h, v, c, _, d, dw, a = _sizes(hidden, weight, chunk_size)
    p = _width(hidden, weight, forward_pads(hidden, weight))
    padded_weight, padded_rows = (v * p * dw, c * p * d) if p != h else (0, 0)
    if kernels_for(hidden) is not None:
        return padded_weight + padded_rows + c * v * d
    cast = d + a if d != a else 0
    return padded_weight + max(padded_rows + c * v * d, c * v * max(cast, 2 * a))


@register_memory_formula(torch.ops.mirrorgrad.linear_cross_entropy_backward)
def _backward_temporary_bytes(grad_lse, grad_target_logit, hidden, weight, bias, target, lse,
                              chunk_size, need_hidden, need_weight, need_bias) -> int:  # fmt: skip
    """Peak during the chunk loop minus the outputs: one chunk of logit gradients [C, V]
    and what each phase adds to it, beside grad_hidden and the accumulators of the
    weight and bias gradients (the outputs themselves unless cast or cut from a padded
    block at the end); where the call pads, W padded [V, P] throughout and the chunk's
    padded rows [C, P] through the chunk. The Triton pass keeps the chunk in the logits'
    dtype (the GEMMs' operand itself); torch's passes in the accumulation dtype, cast
    down for half-precision GEMMs."""
    n, h, v, c, chunks, d, dw, a = _sizes(hidden, weight, chunk_size)
    p = _width(hidden, weight, backward_pads(hidden, weight, need_hidden, need_weight))
    pad = p != h
    db = bias.dtype.itemsize if need_bias else 0
    half = dw != a
    if kernels_for(hidden) is not None:
        chunk = recompute = c * v * d
        low, g = 0, d  # g: the chunk's dtype, the bias sum's GEMV's
    else:
        chunk, g = c * v * a, a
        recompute = c * v * (a + (d if d != a else 0))  # the GEMM's output and its cast
        low = c * v * dw * (half and (need_hidden or need_weight))  # the chunk cast to dw
    accumulated = need_weight and not (half and chunks == 1)  # a float weight accumulator
    made = v * p * dw * (need_weight and half and chunks == 1)  # one chunk's product
    # The weight gradient's output, where it is not the accumulator or the product itself.
    copied_out = v * h * dw * (need_weight and (pad or (half and accumulated)))
    outputs = n * h * d * need_hidden + v * h * dw * need_weight + v * db
    early = n * h * d * need_hidden + v * p * a * accumulated + v * a * need_bias
    early += v * p * dw * pad
    # The chunk's phases: recompute (and cast), grad_hidden's GEMM, grad_weight's, bias sum.
    loop = c * p * d * pad + max(
        recompute,
        need_hidden * (chunk + low + c * p * dw),
        need_weight * (chunk + low + v * p * dw * half),
        need_bias * (chunk + c * g + v * g * (g != a) + made),  # GEMV's ones and sums
    )
    late = made + copied_out + v * db * (need_bias and db != a)
    return max(early + loop, early + late) - outputs


def _pad_copy_bytes(rows: int, h: int, p: int, itemsize: int) -> int:
    """Bytes moved padding [rows, h] to [rows, p] (read, write with zeros), or cutting the
    real block back out (read of p, write of h: counted the same)."""
    return rows * (h + p) * itemsize if p != h else 0


@register_bytes_formula(torch.ops.mirrorgrad.linear_cross_entropy_forward)
def _forward_bytes(hidden, weight, bias, target, chunk_size) -> int:
    """Reads hidden once and weight once per chunk (padded to P where the call pads,
    after one copy of each); the logits are written once, then read once by the Triton
    kernel, or cast and read and written by logsumexp's passes (max, subtract, exp, sum)."""
    n, h, v, _, chunks, d, dw, a = _sizes(hidden, weight, chunk_size)
    p = _width(hidden, weight, forward_pads(hidden, weight))
    pads = _pad_copy_bytes(v, h, p, dw) + _pad_copy_bytes(n, h, p, d)
    gemm = pads + n * p * d + chunks * v * p * dw + n * v * d
    if kernels_for(hidden) is not None:
        return gemm + n * v * d
    cast = n * v * (d + a) if d != a else 0
    return gemm + cast + 6 * n * v * a


@register_bytes_formula(torch.ops.mirrorgrad.linear_cross_entropy_backward)
def _backward_bytes(grad_lse, grad_target_logit, hidden, weight, bias, target, lse, chunk_size,
                    need_hidden, need_weight, need_bias) -> int:  # fmt: skip
    """The forward's logits again; the Triton kernel's one read and write of them, or
    torch's cast and three in-place passes (subtract, exp, scale) and the cast down for
    half-precision GEMMs; one read per gradient GEMM or sum, and the weight (gradient)
    read (and written) per chunk; the GEMMs' operands P wide where the call pads (W and
    hidden copied padded, the gradients' real blocks copied out)."""
    n, h, v, _, chunks, d, dw, a = _sizes(hidden, weight, chunk_size)
    p = _width(hidden, weight, backward_pads(hidden, weight, need_hidden, need_weight))
    half = dw != a
    gemms = bool(need_hidden) + bool(need_weight)
    total = _pad_copy_bytes(v, h, p, dw) + _pad_copy_bytes(n, h, p, d)
    total += n * p * d + chunks * v * p * dw + n * v * d
    if kernels_for(hidden) is not None:  # the chunk in d, read by each GEMM and the sum
        total += (2 + gemms + bool(need_bias)) * n * v * d
    else:
        cast = n * v * (d + a) if d != a else 0
        # Reads of the float chunk: the bias sum's, and the GEMMs' unless they read it
        # cast down.
        reads = bool(need_bias) + (0 if half else gemms)
        total += cast + (6 + reads) * n * v * a
        if half and gemms:  # the chunk cast down, read by each GEMM
            total += n * v * (a + dw) + gemms * n * v * dw
    if need_hidden:
        total += chunks * v * p * dw + n * p * d + _pad_copy_bytes(n, h, p, d)
    if need_weight and not half:
        total += 2 * chunks * v * p * a + n * p * d
    elif need_weight:  # each chunk's product written, then summed in float32 past one
        total += chunks * v * p * dw + (2 * chunks * v * p * a if chunks > 1 else 0) + n * p * d
    accumulated = need_weight and not (half and chunks == 1)
    if need_weight and (p != h or (half and accumulated)):  # the output cut out (and cast)
        total += v * p * (a if accumulated else dw) + v * h * dw
    return total


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    chunk_size: int | None = None,
    reduction: str = "mean",
    ignore_index: int = -100,
    *,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """Cross-entropy of a linear layer's output, without materialising the logits.

    Equal in value and gradients to
    ``F.cross_entropy(F.linear(hidden, weight, bias), target, reduction=...,
    ignore_index=...)``. hidden: ``[..., H]``; weight: ``[V, H]``; bias: ``[V]`` or None;
    target: ``[...]`` class indices; rows whose target is ``ignore_index`` add nothing
    (gradient 0) and "mean" averages over the others. ``chunk_size`` rows of logits
    exist at a time (default: as many rows as fit in 64 MiB of float32 logits); the
    backward recomputes them instead of keeping them. ``dtype``: the loss's dtype;
    by default that of the logits (float32 under autocast); ``torch.float32`` gives
    the loss of logits upcast before the cross-entropy (``logits.float()``). The
    logits are summed in at least float32 either way.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"{reduction!r} is not a valid value for reduction; use one of {REDUCTIONS}"
        )
    if hidden.shape[:-1] != target.shape:
        raise ValueError(
            f"Expected input batch shape {tuple(hidden.shape[:-1])} to match target shape "
            f"{tuple(target.shape)}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise RuntimeError(
            f"weight must be [vocab, {hidden.shape[-1]}] to match hidden, got {tuple(weight.shape)}"
        )
    if target.dtype != torch.int64:
        raise RuntimeError(
            f"target must hold int64 class indices, got {target.dtype}: pass target.long()"
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise RuntimeError(
            f"bias must be [{weight.shape[0]}] (one per class), got {tuple(bias.shape)}"
        )
    if chunk_size is None:
        chunk_size = max(1, CHUNK_BYTES // (4 * weight.shape[0]))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    flat_target = target.reshape(-1)
    valid = flat_target != ignore_index
    safe_target = torch.where(valid, flat_target, torch.zeros_like(flat_target))
    out_dtype = torch.promote_types(hidden.dtype, weight.dtype) if dtype is None else dtype
    device_type = hidden.device.type
    autocast = torch.is_autocast_enabled(device_type)
    if autocast:
        # As F.linear then F.cross_entropy under autocast: the matmul in the autocast
        # dtype (fp32 weights cast, their gradients fp32 again), the loss in float32.
        low = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(low), weight.to(low)
        bias = None if bias is None else bias.to(low)
        out_dtype = torch.float32 if dtype is None else dtype
    # The op runs in the dtypes it is given: no autocast recast inside it.
    with torch.autocast(device_type, enabled=False) if autocast else contextlib.nullcontext():
        lse, target_logit = linear_cross_entropy_forward(
            hidden.reshape(-1, hidden.shape[-1]), weight, bias, safe_target, chunk_size
        )
    losses = torch.where(valid, lse - target_logit, torch.zeros_like(lse))
    if reduction == "none":
        return losses.reshape(target.shape).to(out_dtype)
    total = losses.sum()
    return (total / valid.sum() if reduction == "mean" else total).to(out_dtype)
