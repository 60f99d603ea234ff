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


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        target: Tensor,
        chunk_size: int,
        ignore_index: int,
        reduction: str,
    ) -> Tensor:
        n = hidden.shape[0]
        acc = _accumulation_dtype(hidden)
        valid = target != ignore_index
        safe_target = torch.where(valid, target, torch.zeros_like(target))
        lse = torch.empty(n, dtype=acc, device=hidden.device)
        target_logit = torch.empty(n, dtype=acc, device=hidden.device)
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            logits = F.linear(hidden[rows], weight, bias).to(acc)  # [C, V]
            lse[rows] = torch.logsumexp(logits, dim=1)
            target_logit[rows] = logits.gather(1, safe_target[rows, None]).squeeze(1)
        losses = torch.where(valid, lse - target_logit, torch.zeros_like(lse))
        count = valid.sum()
        ctx.save_for_backward(hidden, weight, bias, safe_target, valid, lse, count)
        ctx.chunk_size = chunk_size
        ctx.reduction = reduction
        out_dtype = torch.promote_types(hidden.dtype, weight.dtype)
        if reduction == "none":
            return losses.to(out_dtype)
        total = losses.sum()
        return (total / count if reduction == "mean" else total).to(out_dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        hidden, weight, bias, safe_target, valid, lse, count = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        # d loss_i / d logits_i = softmax_i - onehot(target_i), scaled per row.
        acc = lse.dtype
        row_scale = valid.to(acc) * grad_out.to(acc)
        if ctx.reduction == "mean":
            row_scale = row_scale / count
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=acc) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=acc) if need_bias else None
        n = hidden.shape[0]
        for start in range(0, n, ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            h = hidden[rows]
            logits = F.linear(h, weight, bias).to(acc)  # [C, V], recomputed
            grad_logits = torch.exp(logits - lse[rows, None])
            grad_logits.scatter_add_(1, safe_target[rows, None], -torch.ones_like(lse[rows, None]))
            grad_logits *= row_scale[rows, None]
            if need_hidden:
                grad_hidden[rows] = grad_logits.to(weight.dtype) @ weight  # [C, V] @ [V, H]
            if need_weight:
                grad_weight += grad_logits.T @ h.to(acc)  # [V, C] @ [C, H]
            if need_bias:
                grad_bias += grad_logits.sum(0)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


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
    out_shape = target.shape
    losses = _LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        bias,
        target.reshape(-1),
        chunk_size,
        ignore_index,
        reduction,
    )
    return losses.reshape(out_shape) if reduction == "none" else losses
