"""The recurrent cells the RNN op runs: their names (and kernel ids), gates per cell and
memory modes."""

from __future__ import annotations

MODES = ("lstm", "gru", "rnn_tanh", "rnn_relu")
# Each cell's id in the Triton kernels (their MODE constexpr).
MODE_ID = {mode: i for i, mode in enumerate(MODES)}
# Gate blocks per cell: W_ih and W_hh are [GATES[mode] * H, ·].
GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}
# What a layer keeps for its backward: pre-activations too ("stash") or not ("recompute").
MEMORY_MODES = ("stash", "recompute")
