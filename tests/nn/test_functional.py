"""mirrorgrad.nn.functional: the public names model code uses (ops tested in tests/ops)."""

import pytest
import torch

from mirrorgrad.nn import functional
from mirrorgrad.ops.linear_cross_entropy import reference


def test_linear_cross_entropy_is_the_op_and_validates():
    hidden = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 4, dtype=torch.float64)
    target = torch.randint(0, 5, (6,))
    loss = functional.linear_cross_entropy(hidden, weight, None, target, chunk_size=4)
    ref = reference.linear_cross_entropy(hidden, weight, None, target)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="target shape"):
        functional.linear_cross_entropy(hidden, weight, None, target[:5])
