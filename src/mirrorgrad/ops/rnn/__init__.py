"""The RNN operator family (LSTM, GRU, RNN-tanh, RNN-relu): ``rnn`` runs a whole stack.

``reference`` is the plain-PyTorch layer (CPU path, test oracle); ``rnn_triton`` the
fused GPU layer; ``op`` registers ``mirrorgrad::rnn_forward`` / ``rnn_backward``.
"""

from mirrorgrad.ops.rnn.op import IMPLS, MEMORY, reverse_within_lengths, rnn

__all__ = ["IMPLS", "MEMORY", "reverse_within_lengths", "rnn"]
