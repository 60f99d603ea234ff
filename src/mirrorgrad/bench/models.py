"""The benchmark models. Each ``forward(*batch)`` returns the scalar training loss.

The loss lives inside the model so that a compiled model's graph holds the whole
step: the logits and the loss are often the largest tensors of a language model,
and the planner can only weigh what it sees.

Time-major (T, B, ·) for the recurrent models, like ``torch.nn.LSTM``'s default.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class LstmLM(nn.Module):
    """Word-level LSTM language model (Zaremba et al. 2014, "medium" and "large")."""

    def __init__(self, *, vocab: int, hidden: int, layers: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.drop = nn.Dropout(dropout)
        self.rnn = nn.LSTM(hidden, hidden, layers, dropout=dropout)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        x = self.drop(self.embed(tokens))  # [T, B, H]
        y, _ = self.rnn(x)
        logits = self.decoder(self.drop(y))  # [T, B, V]
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class MlpAttentionDecoderStep(nn.Module):
    """One decoder step: LSTMCell with input feeding, then MLP (Bahdanau) attention."""

    def __init__(self, *, embed: int, hidden: int, context: int, attention: int) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(embed + hidden, hidden)
        self.query = nn.Linear(hidden, attention)
        self.score = nn.Linear(attention, 1, bias=False)
        self.combine = nn.Linear(hidden + context, hidden)

    def forward(
        self, emb: Tensor, h: Tensor, c: Tensor, att: Tensor, enc: Tensor, enc_proj: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        h, c = self.cell(torch.cat([emb, att], dim=-1), (h, c))
        # [S, B, A]: the large tanh intermediate the planner should mirror.
        energy = torch.tanh(enc_proj + self.query(h))
        alpha = torch.softmax(self.score(energy).squeeze(-1), dim=0)  # [S, B]
        ctx = (alpha.unsqueeze(-1) * enc).sum(dim=0)  # [B, C]
        att = torch.tanh(self.combine(torch.cat([h, ctx], dim=-1)))
        return h, c, att


class NmtAttention(nn.Module):
    """Encoder-decoder like Sockeye's "groundhog": biLSTM encoder, LSTMCell decoder.

    As in Sockeye, the encoder's hidden size is split between the two directions.
    """

    def __init__(
        self,
        *,
        src_vocab: int,
        tgt_vocab: int,
        embed: int,
        hidden: int,
        attention: int,
    ) -> None:
        super().__init__()
        self.src_embed = nn.Embedding(src_vocab, embed)
        self.tgt_embed = nn.Embedding(tgt_vocab, embed)
        self.encoder = nn.LSTM(embed, hidden // 2, bidirectional=True)
        self.enc_proj = nn.Linear(hidden, attention, bias=False)
        self.init_state = nn.Linear(hidden, hidden)
        self.step = MlpAttentionDecoderStep(
            embed=embed, hidden=hidden, context=hidden, attention=attention
        )
        self.output = nn.Linear(hidden, tgt_vocab)

    def forward(self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> Tensor:
        enc, _ = self.encoder(self.src_embed(src))  # [S, B, hidden]
        enc_proj = self.enc_proj(enc)  # [S, B, A]
        h = torch.tanh(self.init_state(enc[-1]))
        c = torch.zeros_like(h)
        att = torch.zeros_like(h)
        emb = self.tgt_embed(tgt_in)  # [T, B, E]
        outputs = []
        for t in range(emb.shape[0]):
            h, c, att = self.step(emb[t], h, c, att, enc, enc_proj)
            outputs.append(att)
        logits = self.output(torch.stack(outputs))  # [T, B, V]
        return F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten())


class Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck: 1x1, 3x3 (strided), 1x1, each with BatchNorm."""

    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int) -> None:
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.shortcut = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + self.shortcut(x))


class ResNet(nn.Module):
    """ResNet with bottleneck blocks; ``layers=(3, 4, 6, 3), width=64`` is ResNet-50."""

    def __init__(self, *, layers: tuple[int, ...], width: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        blocks: list[nn.Module] = []
        in_ch = width
        for stage, count in enumerate(layers):
            stage_width = width * 2**stage
            for i in range(count):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(Bottleneck(in_ch, stage_width, stride))
                in_ch = stage_width * Bottleneck.expansion
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(in_ch, classes)

    def forward(self, images: Tensor, labels: Tensor) -> Tensor:
        x = self.blocks(self.stem(images))
        logits = self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
        return F.cross_entropy(logits, labels)


class TransformerBlock(nn.Module):
    """Pre-LayerNorm causal self-attention block (GPT-2 style)."""

    def __init__(self, *, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, L, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, L, 3, self.heads, D // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(B, L, D)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class TransformerLM(nn.Module):
    """Decoder-only Transformer language model with tied input/output embeddings."""

    def __init__(
        self, *, vocab: int, width: int, heads: int, layers: int, length: int, dropout: float
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(length, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(
            *(TransformerBlock(width=width, heads=heads, dropout=dropout) for _ in range(layers))
        )
        self.ln = nn.LayerNorm(width)

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.tok(tokens) + self.pos(positions))
        x = self.ln(self.blocks(x))
        logits = F.linear(x, self.tok.weight)  # [B, L, V]
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class BiGRUSum(nn.Module):
    """Bidirectional GRU layer whose two directions are summed (DeepSpeech2)."""

    def __init__(self, in_features: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.rnn = nn.GRU(in_features, hidden, bidirectional=True)

    def forward(self, x: Tensor) -> Tensor:
        y, _ = self.rnn(x)
        return y[..., : self.hidden] + y[..., self.hidden :]


class DeepSpeech2(nn.Module):
    """Two 2-D convolutions over (frequency, time), bidirectional GRUs, CTC loss."""

    def __init__(self, *, features: int, hidden: int, layers: int, chars: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, 32, (41, 11), stride=(2, 2), padding=(20, 5), bias=False),
            nn.BatchNorm2d(32),
            nn.Hardtanh(0, 20, inplace=True),
            nn.Conv2d(32, 32, (21, 11), stride=(2, 1), padding=(10, 5), bias=False),
            nn.BatchNorm2d(32),
            nn.Hardtanh(0, 20, inplace=True),
        )
        freq = (features + 1) // 2
        freq = (freq + 1) // 2
        rnns = [BiGRUSum(32 * freq, hidden)]
        rnns += [BiGRUSum(hidden, hidden) for _ in range(layers - 1)]
        self.rnns = nn.Sequential(*rnns)
        self.fc = nn.Linear(hidden, chars)

    def forward(self, spectrogram: Tensor, labels: Tensor) -> Tensor:
        x = self.conv(spectrogram)  # [B, 32, F', T']
        x = x.flatten(1, 2).permute(2, 0, 1)  # [T', B, 32 F']
        x = self.rnns(x)
        # CTC has no bf16 kernel; its log-probabilities are small ([T', B, chars]).
        log_probs = F.log_softmax(self.fc(x).float(), dim=-1)
        T, B = log_probs.shape[:2]
        # Dynamo breaks the graph at CTC (data-dependent shapes): only the loss runs eager.
        input_lengths, label_lengths = [T] * B, [labels.shape[1]] * B
        return F.ctc_loss(log_probs, labels, input_lengths, label_lengths, zero_infinity=True)


class ResidualMlp(nn.Module):
    """Pre-LayerNorm residual MLP with GELU: the planner zoo's simplest model."""

    def __init__(self, *, width: int, hidden: int, layers: int, classes: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(MlpBlock(width, hidden) for _ in range(layers)))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(self.head(self.ln(self.blocks(x))), labels)


class MlpBlock(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Classifier(nn.Module):
    """An image classifier whose logits go into the cross-entropy (torchvision models)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(self.model(images), labels)


class CausalLM(nn.Module):
    """A Hugging Face causal LM given its own tokens as labels: its ``.loss`` (which
    shifts the labels by one) is the step's loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor) -> Tensor:
        return self.model(input_ids=tokens, labels=tokens).loss
