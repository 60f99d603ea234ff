"""The word-level LSTM language model (Zaremba et al. 2014; PyTorch's word_language_model)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import mirrorgrad.nn
from mirrorgrad.nn.functional import linear_cross_entropy
from mirrorgrad.ops import aligned_mm
from mirrorgrad.train.config import PRECISIONS, Preset

State = tuple[Tensor, Tensor]

# Outside training the decoder's logits are made in chunks of at most 4 MiB (float32): the
# final evaluation runs beside the step's CUDA Graph, which stays held, and its default
# 64 MiB chunk (one chunk of 350 x 10,000 logits at eval batch 10) and logsumexp's
# temporary lifted `train lm`'s peak ~30 MiB above its steps' (H200, medium, batch 20).
EVAL_LOGITS_BYTES = 4 << 20


def stored_width(size: int) -> int:
    """The width a row of ``size`` elements is stored at: a multiple of 8 elements, 16
    bytes in bf16 and 32 in float32, so that cuBLAS runs its fast kernels in both (650 ->
    656). The same in every precision: a checkpoint fits either."""
    return aligned_mm.aligned_width(size, torch.bfloat16)


class LanguageModel(nn.Module):
    """Embedding -> dropout -> LSTM -> dropout -> decoder, loss fused into the decoder.

    ``forward(tokens, targets, state)`` returns the mean cross-entropy and the final
    state; the decoder logits are never materialised (``linear_cross_entropy``).
    ``precision="bf16"`` runs the forward under bf16 autocast, as AMP does: the weights
    stay float32 (the master copy the optimizer updates), the loss and the carried
    state are float32.

    Rows of a misaligned width (``stored_width``: the medium preset's 650) are stored
    16-byte aligned, with zeros past the real width: the embedding ``[V, E']``, the
    LSTM's first input weight ``[4H, E']`` and the decoder ``[V, H']``; the LSTM's output
    is zero-padded to ``H'`` before the decoder. Every pad column of every gradient is
    exactly zero, so the pads stay zero and the model computes what the unpadded one
    does, with cuBLAS's fast kernels (2.5x on an H200). ``aligned_rows=False`` stores
    the real widths. A state_dict of the real widths (an older checkpoint, PyTorch's
    word_language_model) loads: its tensors are zero-padded on the way in.
    """

    def __init__(
        self,
        vocab_size: int,
        preset: Preset,
        *,
        tie_weights: bool = False,
        precision: str = "fp32",
        aligned_rows: bool = True,
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
        embedding = stored_width(preset.embedding) if aligned_rows else preset.embedding
        head = stored_width(preset.hidden) if aligned_rows else preset.hidden
        self.encoder = nn.Embedding(vocab_size, embedding)
        self.drop = nn.Dropout(preset.dropout)
        # The LSTM's own dropout acts between its layers only.
        between_layers = preset.dropout if preset.layers > 1 else 0.0
        self.rnn = mirrorgrad.nn.LSTM(
            embedding, preset.hidden, preset.layers, dropout=between_layers
        )
        self.decoder = nn.Linear(head, vocab_size)
        if tie_weights:
            self.decoder.weight = self.encoder.weight
        self.layers, self.hidden = preset.layers, preset.hidden
        # The padded weights: name -> real width (zeros past it). Empty where aligned.
        real = {"encoder.weight": preset.embedding, "rnn.weight_ih_l0": preset.embedding,
                "decoder.weight": preset.hidden}  # fmt: skip
        self.real_widths = {k: w for k, w in real.items() if self.get_parameter(k).shape[1] != w}
        self._init_weights()
        self.register_load_state_dict_pre_hook(_pad_real_width_tensors)

    def _init_weights(self) -> None:
        # Uniform(-0.1, 0.1) for embedding and decoder, as in the classic recipe.
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        with torch.no_grad():
            for name, width in self.real_widths.items():
                self.get_parameter(name)[:, width:].zero_()

    def parameter_count(self) -> int:
        """The model's parameters, the pad columns (storage, always zero) not counted."""
        return sum(
            p.shape[0] * self.real_widths[name] if name in self.real_widths else p.numel()
            for name, p in self.named_parameters()
        )

    def initial_state(self, batch_size: int, device: torch.device | str) -> State:
        zeros = torch.zeros(self.layers, batch_size, self.hidden, device=device)
        return zeros, zeros.clone()

    def forward(self, tokens: Tensor, targets: Tensor, state: State) -> tuple[Tensor, State]:
        dtype = self.autocast_dtype
        with torch.autocast(tokens.device.type, dtype=dtype, enabled=dtype is not None):
            x = self.drop(self.encoder(tokens))  # [T, B, E]
            out, (h, c) = self.rnn(x, state)  # [T, B, H]
            out = self.drop(out)
            head = self.decoder.in_features
            if head != self.hidden:  # the decoder's pad columns meet zeros
                out = F.pad(out, (0, head - self.hidden))  # [T, B, H']
            vocab = self.decoder.out_features
            chunk = None if self.training else max(1, EVAL_LOGITS_BYTES // (4 * vocab))
            loss = linear_cross_entropy(out, self.decoder.weight, self.decoder.bias, targets,
                                        chunk_size=chunk)  # fmt: skip
        # The carried state keeps its dtype (the LSTM returns bf16 under autocast).
        return loss, (h.to(state[0].dtype), c.to(state[1].dtype))


def _pad_real_width_tensors(model: LanguageModel, state_dict, prefix: str, *_) -> None:
    """Load-state-dict pre-hook: a padded weight given at its real width (a checkpoint
    written before rows were stored aligned) is zero-padded to the stored width."""
    for name, width in model.real_widths.items():
        key = prefix + name
        t = state_dict.get(key)
        stored = model.get_parameter(name).shape[1]
        if t is not None and t.dim() == 2 and t.shape[1] == width:
            state_dict[key] = F.pad(t, (0, stored - width))
