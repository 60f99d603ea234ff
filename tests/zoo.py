"""Small models for planner tests: one of each shape the planner must handle.

Each entry builds a model and an example batch; `loss_of` turns the model's output
into a scalar that weights every element differently (a bare `.sum()` would hide
gradients that are wrong by a constant).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


class MLP(nn.Module):
    """Linear -> GELU -> LayerNorm, twice, then a Linear head."""

    def __init__(self, d_in: int = 12, d_hidden: int = 24, d_out: int = 5) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.norm1 = nn.LayerNorm(d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.norm2 = nn.LayerNorm(d_hidden)
        self.head = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm1(nn.functional.gelu(self.fc1(x)))
        x = self.norm2(nn.functional.gelu(self.fc2(x)))
        return self.head(x)


class LSTMCellLM(nn.Module):
    """Language model: embedding, an unrolled LSTMCell with dropout, a decoder."""

    def __init__(self, vocab: int = 11, d: int = 8, hidden: int = 10, dropout: float = 0.3):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.cell = nn.LSTMCell(d, hidden)
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        emb = self.drop(self.embed(tokens))  # (B, T, d)
        h = emb.new_zeros(tokens.shape[0], self.cell.hidden_size)
        c = torch.zeros_like(h)
        outputs = []
        for t in range(tokens.shape[1]):
            h, c = self.cell(emb[:, t], (h, c))
            outputs.append(self.drop(h))
        return self.decoder(torch.stack(outputs, dim=1))  # (B, T, vocab)


class Seq2SeqAttention(nn.Module):
    """Bidirectional LSTMCell encoder, LSTMCell decoder with MLP (Bahdanau) attention."""

    def __init__(self, vocab: int = 9, d: int = 6, hidden: int = 8, attn: int = 7) -> None:
        super().__init__()
        self.src_embed = nn.Embedding(vocab, d)
        self.tgt_embed = nn.Embedding(vocab, d)
        self.enc_fwd = nn.LSTMCell(d, hidden)
        self.enc_bwd = nn.LSTMCell(d, hidden)
        self.dec = nn.LSTMCell(d + 2 * hidden, hidden)
        self.attn_enc = nn.Linear(2 * hidden, attn, bias=False)
        self.attn_dec = nn.Linear(hidden, attn)
        self.attn_v = nn.Linear(attn, 1, bias=False)
        self.out = nn.Linear(hidden + 2 * hidden, vocab)

    def _run(self, cell: nn.LSTMCell, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        h = xs[0].new_zeros(xs[0].shape[0], cell.hidden_size)
        c = torch.zeros_like(h)
        hs = []
        for x in xs:
            h, c = cell(x, (h, c))
            hs.append(h)
        return hs

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        src_emb = self.src_embed(src)
        steps = [src_emb[:, t] for t in range(src.shape[1])]
        fwd = self._run(self.enc_fwd, steps)
        bwd = self._run(self.enc_bwd, steps[::-1])[::-1]
        memory = torch.cat([torch.stack(fwd, 1), torch.stack(bwd, 1)], dim=-1)  # (B, S, 2H)
        keys = self.attn_enc(memory)  # (B, S, A)
        tgt_emb = self.tgt_embed(tgt)
        h = memory.new_zeros(src.shape[0], self.dec.hidden_size)
        c = torch.zeros_like(h)
        context = memory.new_zeros(src.shape[0], memory.shape[-1])
        logits = []
        for t in range(tgt.shape[1]):
            h, c = self.dec(torch.cat([tgt_emb[:, t], context], dim=-1), (h, c))
            # The (B, S, A) tanh is the large intermediate the planner should mirror.
            scores = self.attn_v(torch.tanh(keys + self.attn_dec(h)[:, None])).squeeze(-1)
            alpha = torch.softmax(scores, dim=-1)  # (B, S)
            context = (alpha[..., None] * memory).sum(1)
            logits.append(self.out(torch.cat([h, context], dim=-1)))
        return torch.stack(logits, 1)


class Bottleneck(nn.Module):
    """ResNet bottleneck: 1x1 -> grouped kxk -> 1x1 conv, each with BN, ReLU, residual."""

    def __init__(self, channels: int = 8, mid: int = 4, groups: int = 2, dims: int = 2) -> None:
        super().__init__()
        conv = nn.Conv2d if dims == 2 else nn.Conv3d
        norm = nn.BatchNorm2d if dims == 2 else nn.BatchNorm3d
        self.conv1, self.bn1 = conv(channels, mid, 1, bias=False), norm(mid)
        self.conv2 = conv(mid, mid, 3, padding=1, groups=groups, bias=False)
        self.bn2 = norm(mid)
        self.conv3, self.bn3 = conv(mid, channels, 1, bias=False), norm(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)))
        return torch.relu(self.bn3(self.conv3(y)) + x)


class ConvNet(nn.Module):
    """Two 2-D bottlenecks (one grouped), then a 3-D one over a stacked depth axis."""

    def __init__(self, channels: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.block1 = Bottleneck(channels, mid=4, groups=1)
        self.block2 = Bottleneck(channels, mid=4, groups=2)
        self.block3d = Bottleneck(channels, mid=4, groups=2, dims=3)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block2(self.block1(self.stem(x)))  # (B, C, H, W)
        y = self.block3d(torch.stack([y, y.flip(-1)], dim=2))  # (B, C, 2, H, W)
        return self.head(y.mean(dim=(2, 3, 4)))


class EncoderBlock(nn.Module):
    """One Transformer encoder layer (self-attention + feed-forward, pre-norm)."""

    def __init__(self, d_model: int = 16, nhead: int = 2, ff: int = 24) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            d_model, nhead, ff, dropout=0.0, batch_first=True, norm_first=True
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


@dataclass(frozen=True, kw_only=True, slots=True)
class ZooEntry:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], tuple[torch.Tensor, ...]]
    # Float64 where every op supports it; else float32 with a looser tolerance.
    dtype: torch.dtype = torch.float64


def _tokens(vocab: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, vocab, shape)


ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in [
        ZooEntry(name="mlp", build=MLP, inputs=lambda: (torch.randn(6, 12),)),
        ZooEntry(name="lstm_lm", build=LSTMCellLM, inputs=lambda: (_tokens(11, 3, 5),)),
        ZooEntry(
            name="seq2seq_attention",
            build=Seq2SeqAttention,
            inputs=lambda: (_tokens(9, 2, 5), _tokens(9, 2, 3)),
        ),
        ZooEntry(name="convnet", build=ConvNet, inputs=lambda: (torch.randn(2, 3, 6, 6),)),
        ZooEntry(name="encoder_block", build=EncoderBlock, inputs=lambda: (torch.randn(2, 5, 16),)),
    ]
}


def build(
    name: str, dtype: torch.dtype | None = None
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The zoo model `name` and an example batch, floating-point parts in `dtype`."""
    entry = ZOO[name]
    dtype = dtype or entry.dtype
    model = entry.build().to(dtype)
    inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in entry.inputs())
    return model, inputs


def loss_of(output: torch.Tensor) -> torch.Tensor:
    """A scalar that weights every output element differently."""
    weights = torch.linspace(-1.0, 2.0, output.numel(), dtype=output.dtype, device=output.device)
    weights = weights.view_as(output)
    return (output * weights).sum() + 0.1 * (output**2).mean()


class WithLoss(nn.Module):
    """``model`` with ``loss_of`` on its output: a scalar to trace a joint graph from."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return loss_of(self.model(*inputs))
