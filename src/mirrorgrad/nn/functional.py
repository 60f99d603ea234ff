"""Memory-lean functional ops (issue 5).

``linear_cross_entropy`` is ``F.cross_entropy(F.linear(hidden, weight, bias), target)``
without ever holding the ``[tokens, vocab]`` logits or their gradient: the forward
keeps one log-sum-exp per row, the backward recomputes the logits chunk by chunk.
For a word-level language model the decoder logits are often the largest tensor of
the whole step (35 x 20 tokens x 10k words x 4 bytes = 28 MB, twice: value and grad).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["linear_cross_entropy"]

# Auto chunk size: rows whose float32 logits fit in this many bytes.
_CHUNK_BYTES = 64 * 2**20
_REDUCTIONS = ("mean", "sum", "none")


def _accumulation_dtype(hidden: Tensor) -> torch.dtype:
    # Half-precision logits are summed in float32; float64 stays float64.
    return torch.promote_types(hidden.dtype, torch.float32)


# Two torch.library ops, not an autograd.Function: torch 2.11's Dynamo traced the
# Function's backward without its incoming gradient (every gradient came out zero under
# torch.compile). As ops, compilers and the planner see one opaque node each way.
@torch.library.custom_op("mirrorgrad::linear_cross_entropy_forward", mutates_args=())
def _lce_forward(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, chunk_size: int
) -> tuple[Tensor, Tensor]:
    """Per-row (log-sum-exp, target logit) of ``hidden @ weight.T + bias``, chunk by chunk."""
    acc = _accumulation_dtype(hidden)
    lse, target_logit = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        logits = F.linear(hidden[rows], weight, bias).to(acc)  # [C, V]
        lse.append(torch.logsumexp(logits, dim=1))
        target_logit.append(logits.gather(1, target[rows, None]).squeeze(1))
    return torch.cat(lse), torch.cat(target_logit)


@_lce_forward.register_fake
def _(hidden, weight, bias, target, chunk_size):
    acc = _accumulation_dtype(hidden)
    n = hidden.shape[0]
    return hidden.new_empty(n, dtype=acc), hidden.new_empty(n, dtype=acc)


@torch.library.custom_op("mirrorgrad::linear_cross_entropy_backward", mutates_args=())
def _lce_backward(
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
    grad_hidden, grad_weight, grad_bias = [], None, None
    for start in range(0, hidden.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        h = hidden[rows]
        logits = F.linear(h, weight, bias).to(acc)  # [C, V], recomputed
        grad_logits = torch.exp(logits - lse[rows, None]) * grad_lse[rows, None]
        grad_logits.scatter_add_(1, target[rows, None], grad_target_logit[rows, None])
        if need_hidden:
            grad_hidden.append((grad_logits.to(weight.dtype) @ weight).to(hidden.dtype))
        if need_weight:
            part = grad_logits.T @ h.to(acc)  # [V, C] @ [C, H]
            grad_weight = part if grad_weight is None else grad_weight.add_(part)
        if need_bias:
            part = grad_logits.sum(0)
            grad_bias = part if grad_bias is None else grad_bias.add_(part)
    empty = hidden.new_empty(0)
    return (
        torch.cat(grad_hidden) if need_hidden else empty,
        grad_weight.to(weight.dtype) if need_weight else empty.to(weight.dtype),
        grad_bias.to(bias.dtype) if need_bias else empty.to(weight.dtype),
    )


@_lce_backward.register_fake
def _(grad_lse, grad_target_logit, hidden, weight, bias, target, lse, chunk_size,
      need_hidden, need_weight, need_bias):  # fmt: skip
    empty = hidden.new_empty(0)
    return (
        torch.empty_like(hidden) if need_hidden else empty,
        torch.empty_like(weight) if need_weight else empty.to(weight.dtype),
        torch.empty_like(bias) if need_bias else empty.to(weight.dtype),
    )


def _lce_setup_context(ctx, inputs, output) -> None:
    hidden, weight, bias, target, chunk_size = inputs
    ctx.save_for_backward(hidden, weight, bias, target, output[0])
    ctx.chunk_size = chunk_size


def _lce_autograd(ctx, grad_lse: Tensor, grad_target_logit: Tensor):
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


_lce_forward.register_autograd(_lce_autograd, setup_context=_lce_setup_context)


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    chunk_size: int | None = None,
    reduction: str = "mean",
    ignore_index: int = -100,
) -> Tensor:
    """Cross-entropy of a linear layer's output, without materialising the logits.

    Equal in value and gradients to
    ``F.cross_entropy(F.linear(hidden, weight, bias), target, reduction=...,
    ignore_index=...)``. hidden: ``[..., H]``; weight: ``[V, H]``; bias: ``[V]`` or None;
    target: ``[...]`` class indices. ``chunk_size`` rows of logits exist at a time
    (default: as many rows as fit in 64 MiB of float32 logits); the backward
    recomputes them instead of keeping them.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"{reduction!r} is not a valid value for reduction; use one of {_REDUCTIONS}"
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
    if chunk_size is None:
        chunk_size = max(1, _CHUNK_BYTES // (4 * weight.shape[0]))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    flat_target = target.reshape(-1)
    valid = flat_target != ignore_index
    safe_target = torch.where(valid, flat_target, torch.zeros_like(flat_target))
    lse, target_logit = _lce_forward(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, safe_target, chunk_size
    )
    losses = torch.where(valid, lse - target_logit, torch.zeros_like(lse))
    out_dtype = torch.promote_types(hidden.dtype, weight.dtype)
    if reduction == "none":
        return losses.reshape(target.shape).to(out_dtype)
    total = losses.sum()
    return (total / valid.sum() if reduction == "mean" else total).to(out_dtype)
