"""Triton passes over one chunk of the head's logits (``op`` runs them where Triton runs).

* ``lse_and_target_logit``: per row, the log-sum-exp (online max and sum over column
  blocks, in float32) and the target's logit, the logits read once in their own dtype;
* ``logits_to_grad_``: the logits overwritten by their gradient,
  ``exp(x - lse) * grad_lse + (col == target) * grad_target_logit``, computed in float32
  and stored once in the logits' dtype (bf16 logits give the bf16 operand of the
  gradient GEMMs directly).

One program per row, looping over the vocabulary in blocks, as Liger-Kernel's and
flash-attention's cross-entropy kernels do.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor

# The logits' dtypes the kernels take (their sums are float32).
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Columns per block: a row of 10,000 logits is read in three. The vocabulary is a
# compile-time constant (one per model), as the RNN kernels' hidden size is.
MAX_BLOCK = 4096


@triton.jit
def _lse_and_target_kernel(
    logits, row_stride, target, lse, target_logit, V: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    row_logits = logits + row * row_stride
    cols = tl.arange(0, BLOCK)
    peak = float("-inf")  # running max of the row
    total = 0.0  # running sum of exp(x - peak)
    for start in range(0, V, BLOCK):
        x = tl.load(row_logits + start + cols, mask=start + cols < V, other=float("-inf"))
        x = x.to(tl.float32)
        new_peak = tl.maximum(peak, tl.max(x, axis=0))
        total = total * tl.exp(peak - new_peak) + tl.sum(tl.exp(x - new_peak), axis=0)
        peak = new_peak
    tl.store(lse + row, peak + tl.log(total))
    t = tl.load(target + row)
    tl.store(target_logit + row, tl.load(row_logits + t).to(tl.float32))


@triton.jit
def _logits_to_grad_kernel(
    logits,
    row_stride,
    target,
    lse,
    grad_lse,
    grad_target_logit,
    V: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_logits = logits + row * row_stride
    cols = tl.arange(0, BLOCK)
    t = tl.load(target + row)
    row_lse = tl.load(lse + row)
    row_grad_lse = tl.load(grad_lse + row)
    row_grad_target = tl.load(grad_target_logit + row)
    for start in range(0, V, BLOCK):
        mask = start + cols < V
        x = tl.load(row_logits + start + cols, mask=mask).to(tl.float32)
        g = tl.exp(x - row_lse) * row_grad_lse
        g = tl.where(start + cols == t, g + row_grad_target, g)
        tl.store(row_logits + start + cols, g.to(row_logits.dtype.element_ty), mask=mask)


def _launch_config(vocab: int, block: int | None) -> tuple[int, int]:
    """(columns per block, warps)."""
    block = block or min(MAX_BLOCK, triton.next_power_of_2(vocab))
    return block, 8 if block >= 2048 else 4


def _on_device(t: Tensor):
    """Triton launches on the current CUDA device: make it ``t``'s."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def _check(logits: Tensor, target: Tensor, *rows: Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [rows, vocab] with unit column stride, got "
                         f"shape {tuple(logits.shape)} strides {logits.stride()}")  # fmt: skip
    if logits.dtype not in DTYPES:
        raise TypeError(f"the logits kernels take {DTYPES}, got {logits.dtype}")
    for t in (target, *rows):
        if t.shape != (logits.shape[0],) or not t.is_contiguous():
            raise ValueError(f"per-row tensors must be contiguous [{logits.shape[0]}], got "
                             f"shape {tuple(t.shape)}")  # fmt: skip
    if any(t.dtype != torch.float32 for t in rows):
        raise TypeError("per-row sums and gradients must be float32")


def lse_and_target_logit(
    logits: Tensor, target: Tensor, lse: Tensor, target_logit: Tensor, *, block: int | None = None
) -> None:
    """Write each row's float32 log-sum-exp into ``lse`` and its logit at ``target``
    (int64, in [0, vocab)) into ``target_logit``. ``block``: columns per block (tests)."""
    _check(logits, target, lse, target_logit)
    rows, vocab = logits.shape
    if rows == 0:
        return
    block, warps = _launch_config(vocab, block)
    with _on_device(logits):
        _lse_and_target_kernel[(rows,)](
            logits, logits.stride(0), target, lse, target_logit, vocab, BLOCK=block,
            num_warps=warps,
        )  # fmt: skip


def logits_to_grad_(
    logits: Tensor,
    target: Tensor,
    lse: Tensor,
    grad_lse: Tensor,
    grad_target_logit: Tensor,
    *,
    block: int | None = None,
) -> Tensor:
    """Overwrite ``logits`` with the gradient of
    ``sum(grad_lse * lse + grad_target_logit * logits[row, target])``; returns it."""
    _check(logits, target, lse, grad_lse, grad_target_logit)
    rows, vocab = logits.shape
    if rows == 0:
        return logits
    block, warps = _launch_config(vocab, block)
    with _on_device(logits):
        _logits_to_grad_kernel[(rows,)](
            logits, logits.stride(0), target, lse, grad_lse, grad_target_logit, vocab,
            BLOCK=block, num_warps=warps,
        )  # fmt: skip
    return logits
