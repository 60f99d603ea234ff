"""Drop-in replacements for torch.nn recurrent modules and cells, and memory-lean functionals."""

from mirrorgrad.nn import functional
from mirrorgrad.nn.cells import GRUCell, LSTMCell, RNNCell
from mirrorgrad.nn.rnn import GRU, LSTM, RNN, convert
from mirrorgrad.ops.rnn.dispatch import dispatch_as_captured

__all__ = [
    "GRU", "LSTM", "RNN", "GRUCell", "LSTMCell", "RNNCell", "convert", "dispatch_as_captured",
    "functional",
]  # fmt: skip
