"""The RNN operator family (LSTM, GRU, RNN-tanh, RNN-relu): ``rnn`` runs a whole stack.

``cells`` names the cells; ``reference`` is the plain-PyTorch layer (CPU path, test
oracle); ``kernels`` the Triton layer (GPU path) and ``graphs`` its CUDA Graph cache;
``op`` registers ``mirrorgrad::rnn_forward`` / ``rnn_backward`` with their autograd;
``dispatch`` picks the implementation (``rnn``).
"""

from mirrorgrad.ops.rnn.dispatch import IMPLS, MEMORY, rnn
from mirrorgrad.ops.rnn.op import reverse_within_lengths

__all__ = ["IMPLS", "MEMORY", "reverse_within_lengths", "rnn"]
