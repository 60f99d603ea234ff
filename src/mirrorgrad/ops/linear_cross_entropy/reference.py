"""Plain-PyTorch linear + cross-entropy: the test oracle of the chunked op."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    reduction: str = "mean",
    ignore_index: int = -100,
) -> Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias), target)`` over any batch dims:
    hidden ``[..., H]``, target ``[...]``; ``reduction="none"`` keeps target's shape."""
    logits = F.linear(hidden, weight, bias).reshape(-1, weight.shape[0])
    loss = F.cross_entropy(
        logits, target.reshape(-1), reduction=reduction, ignore_index=ignore_index
    )
    return loss.reshape(target.shape) if reduction == "none" else loss
