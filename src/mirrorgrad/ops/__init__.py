"""mirrorgrad's operators, each a torch.library op with a plain-PyTorch reference."""

from mirrorgrad.ops.linear_cross_entropy import linear_cross_entropy
from mirrorgrad.ops.rnn import rnn

__all__ = ["linear_cross_entropy", "rnn"]
