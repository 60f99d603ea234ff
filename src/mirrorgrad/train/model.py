"""The word-level LSTM language model (Zaremba et al. 2014; PyTorch's word_language_model)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

import mirrorgrad.nn
from mirrorgrad.nn.functional import linear_cross_entropy
from mirrorgrad.train.config import PRECISIONS, Preset

State = tuple[Tensor, Tensor]

# Outside training the decoder's logits are made in chunks of at most 4 MiB (float32): the
# final evaluation runs beside the step's CUDA Graph, which stays held, and its default
# 64 MiB chunk (one chunk of 350 x 10,000 logits at eval batch 10) and logsumexp's
# temporary lifted `train lm`'s peak ~30 MiB above its steps' (H200, medium, batch 20).
EVAL_LOGITS_BYTES = 4 << 20


class LanguageModel(nn.Module):
    """Embedding -> dropout -> LSTM -> dropout -> decoder, loss fused into the decoder.

    ``forward(tokens, targets, state)`` returns the mean cross-entropy and the final
    state; the decoder logits are never materialised (``linear_cross_entropy``).
    ``precision="bf16"`` runs the forward under bf16 autocast, as AMP does: the weights
    stay float32 (the master copy the optimizer updates), the loss and the carried
    state are float32.
    """

    def __init__(
        self,
        vocab_size: int,
        preset: Preset,
        *,
        tie_weights: bool = False,
        precision: str = "fp32",
    ) -> None:
        super().__init__()
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
        self.autocast_dtype = PRECISIONS[precision]
        if tie_weights and preset.embedding != preset.hidden:
            raise ValueError(
                f"--tie-weights needs embedding size == hidden size, got {preset.embedding} "
                f"and {preset.hidden}"
            )
        self.encoder = nn.Embedding(vocab_size, preset.embedding)
        self.drop = nn.Dropout(preset.dropout)
        # The LSTM's own dropout acts between its layers only.
        between_layers = preset.dropout if preset.layers > 1 else 0.0
        self.rnn = mirrorgrad.nn.LSTM(
            preset.embedding, preset.hidden, preset.layers, dropout=between_layers
        )
        self.decoder = nn.Linear(preset.hidden, vocab_size)
        if tie_weights:
            self.decoder.weight = self.encoder.weight
        self.layers, self.hidden = preset.layers, preset.hidden
        self._init_weights()

    def _init_weights(self) -> None:
        # Uniform(-0.1, 0.1) for embedding and decoder, as in the classic recipe.
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def initial_state(self, batch_size: int, device: torch.device | str) -> State:
        zeros = torch.zeros(self.layers, batch_size, self.hidden, device=device)
        return zeros, zeros.clone()

    def forward(self, tokens: Tensor, targets: Tensor, state: State) -> tuple[Tensor, State]:
        dtype = self.autocast_dtype
        with torch.autocast(tokens.device.type, dtype=dtype, enabled=dtype is not None):
            x = self.drop(self.encoder(tokens))  # [T, B, E]
            out, (h, c) = self.rnn(x, state)  # [T, B, H]
            out = self.drop(out)
            vocab = self.decoder.out_features
            chunk = None if self.training else max(1, EVAL_LOGITS_BYTES // (4 * vocab))
            loss = linear_cross_entropy(out, self.decoder.weight, self.decoder.bias, targets,
                                        chunk_size=chunk)  # fmt: skip
        # The carried state keeps its dtype (the LSTM returns bf16 under autocast).
        return loss, (h.to(state[0].dtype), c.to(state[1].dtype))
