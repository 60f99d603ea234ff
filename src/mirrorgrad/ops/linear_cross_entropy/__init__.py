"""Linear layer + cross-entropy without the logits: ``linear_cross_entropy``.

``reference`` is plain PyTorch (the test oracle); ``op`` the chunked torch.library ops.
"""

from mirrorgrad.ops.linear_cross_entropy.op import linear_cross_entropy

__all__ = ["linear_cross_entropy"]
