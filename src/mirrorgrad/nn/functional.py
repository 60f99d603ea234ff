"""Memory-lean functional ops: the public names of ``mirrorgrad.ops`` for model code.

``linear_cross_entropy`` is ``F.cross_entropy(F.linear(hidden, weight, bias), target)``
without ever holding the ``[tokens, vocab]`` logits or their gradient: the forward
keeps one log-sum-exp per row, the backward recomputes the logits chunk by chunk.
For a word-level language model the decoder logits are often the largest tensor of
the whole step (35 x 20 tokens x 10k words x 4 bytes = 28 MB, twice: value and grad).
It validates its inputs; the op lives in ``mirrorgrad.ops.linear_cross_entropy``.
"""

from __future__ import annotations

from mirrorgrad.ops.linear_cross_entropy import linear_cross_entropy

__all__ = ["linear_cross_entropy"]
