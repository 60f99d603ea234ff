"""mirrorgrad's operators, each a torch.library op with a plain-PyTorch reference."""

from mirrorgrad.ops.rnn import rnn

__all__ = ["rnn"]
