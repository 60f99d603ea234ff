"""Drop-in replacements for torch.nn recurrent modules, and memory-lean functionals."""

from mirrorgrad.nn import functional
from mirrorgrad.nn.rnn import GRU, LSTM, RNN, convert

__all__ = ["GRU", "LSTM", "RNN", "convert", "functional"]
