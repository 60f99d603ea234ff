"""Registry of named benchmark workloads: a model, a synthetic batch, its blocks.

Synthetic tokens and images: the shapes are what matter for memory and time.
``quick=True`` builds the same architecture at tiny sizes for CPU tests.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mirrorgrad.bench import models


@dataclass(kw_only=True, slots=True)
class Built:
    """A workload instance: ``model(*make_batch())`` is the scalar loss of one step."""

    model: nn.Module
    make_batch: Callable[[], tuple[Tensor, ...]]
    # Qualified names of the submodules `checkpoint` wraps (resolved after RNN swaps).
    blocks: tuple[str, ...]
    batch: int
    # Model FLOPs of one step, where the workload knows them (TFLOP/s in the tables).
    flops: float | None = None


# (batch, quick) -> (model, sample(generator) -> batch tensors, block names)
Builder = Callable[
    [int, bool],
    tuple[nn.Module, Callable[[torch.Generator], tuple[Tensor, ...]], tuple[str, ...]],
]


@dataclass(kw_only=True, slots=True, frozen=True)
class Workload:
    name: str
    description: str
    batch: int
    quick_batch: int
    # Has torch.nn RNN modules that `+mgnn` methods swap for mirrorgrad.nn ones.
    recurrent: bool
    # Rough relative cost of one cold compile: `--precompile-jobs` starts costly ones first.
    compile_weight: int
    builder: Builder
    # The step: SGD at ``lr`` after clipping the gradient norm to ``clip``; ``update=False``
    # measures forward and backward alone (the RNN kernel suite).
    lr: float = 1e-4
    clip: float | None = None
    update: bool = True
    # quick -> tokens per sample (language models: tokens/s in the tables).
    tokens_per_sample: Callable[[bool], int] | None = None
    # (batch, quick) -> model FLOPs of one step.
    flops: Callable[[int, bool], float] | None = None
    # The method whose first-step gradients the others' are compared with (dropout off).
    grad_reference: str | None = None
    # Modules the builder imports; a workload whose packages are missing is skipped.
    packages: tuple[str, ...] = ()
    # In the CPU slice of its suite (what `--quick` runs).
    cpu_slice: bool = True

    def missing_packages(self) -> list[str]:
        return [name for name in self.packages if importlib.util.find_spec(name) is None]

    def build(
        self,
        *,
        batch: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        quick: bool = False,
        seed: int = 0,
    ) -> Built:
        """Build the model (seeded) and a batch factory on ``device`` in ``dtype``."""
        batch = batch or (self.quick_batch if quick else self.batch)
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        torch.manual_seed(seed)
        model, sample, blocks = self.builder(batch, quick)
        model = model.to(device=device, dtype=dtype)

        def make_batch() -> tuple[Tensor, ...]:
            generator = torch.Generator().manual_seed(seed + 1)
            return tuple(
                t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
                for t in sample(generator)
            )

        flops = None if self.flops is None else self.flops(batch, quick)
        return Built(
            model=model, make_batch=make_batch, blocks=tuple(blocks), batch=batch, flops=flops
        )


def token_pairs(vocab: int, length: int, batch: int, *, batch_first: bool = False):
    """A sampler of (tokens, next tokens), each ``length`` long: [length, batch] (time-major)
    or [batch, length]."""

    def sample(g: torch.Generator) -> tuple[Tensor, Tensor]:
        shape = (batch, length + 1) if batch_first else (length + 1, batch)
        tokens = torch.randint(0, vocab, shape, generator=g)
        return (tokens[:, :-1], tokens[:, 1:]) if batch_first else (tokens[:-1], tokens[1:])

    return sample


def _labelled_images(batch: int, size: int, classes: int):
    def sample(g: torch.Generator) -> tuple[Tensor, Tensor]:
        images = torch.randn(batch, 3, size, size, generator=g)
        return images, torch.randint(0, classes, (batch,), generator=g)

    return sample


def _lstm_lm(hidden: int, dropout: float):
    def builder(batch: int, quick: bool):
        vocab, hidden_, bptt = (50, 16, 5) if quick else (10_000, hidden, 35)
        model = models.LstmLM(vocab=vocab, hidden=hidden_, layers=2, dropout=dropout)
        return model, token_pairs(vocab, bptt, batch), ("rnn",)

    return builder


def _nmt(batch: int, quick: bool):
    if quick:
        src_vocab, tgt_vocab, embed, hidden, attention, src_len, tgt_len = 40, 30, 8, 8, 8, 6, 4
    else:
        src_vocab, tgt_vocab, embed, hidden, attention = 17191, 7709, 500, 1000, 512
        src_len, tgt_len = 50, 30
    model = models.NmtAttention(
        src_vocab=src_vocab, tgt_vocab=tgt_vocab, embed=embed, hidden=hidden, attention=attention
    )

    def sample(g: torch.Generator):
        src = torch.randint(0, src_vocab, (src_len, batch), generator=g)
        tgt = torch.randint(0, tgt_vocab, (tgt_len + 1, batch), generator=g)
        return src, tgt[:-1], tgt[1:]

    return model, sample, ("encoder", "step")


def _resnet50(batch: int, quick: bool):
    layers, width, classes, size = (
        ((1, 1, 1, 1), 4, 10, 32) if quick else ((3, 4, 6, 3), 64, 1000, 224)
    )
    model = models.ResNet(layers=layers, width=width, classes=classes)
    blocks = tuple(f"blocks.{i}" for i in range(sum(layers)))
    return model, _labelled_images(batch, size, classes), blocks


def _transformer(batch: int, quick: bool):
    vocab, width, heads, layers, length = (
        (64, 16, 2, 2, 8) if quick else (32_000, 768, 12, 12, 1024)
    )
    model = models.TransformerLM(
        vocab=vocab, width=width, heads=heads, layers=layers, length=length, dropout=0.1
    )
    sample = token_pairs(vocab, length, batch, batch_first=True)
    return model, sample, tuple(f"blocks.{i}" for i in range(layers))


def _resnet152(batch: int, quick: bool):
    """torchvision's ResNet-152, no weights; quick: its bottleneck at one block a stage."""
    from torchvision.models import resnet152
    from torchvision.models.resnet import Bottleneck, ResNet

    classes, size = (10, 32) if quick else (1000, 224)
    net = ResNet(Bottleneck, [1, 1, 1, 1], num_classes=classes) if quick else resnet152()
    depths = [len(getattr(net, f"layer{i}")) for i in range(1, 5)]
    blocks = tuple(f"model.layer{i + 1}.{j}" for i, d in enumerate(depths) for j in range(d))
    return models.Classifier(net), _labelled_images(batch, size, classes), blocks


def _gpt2(batch: int, quick: bool):
    """transformers' GPT-2 small config (12x768, 12 heads, vocab 50257, dropout 0.1,
    SDPA attention), no weights; quick: 2x32."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tiny = dict(n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=16)
    tiny |= dict(bos_token_id=0, eos_token_id=0)
    config = GPT2Config(use_cache=False, **(tiny if quick else {}))
    length = config.n_positions
    gpt2 = GPT2LMHeadModel(config)
    # Named: with none set, the model logs a warning on its first call (a graph break).
    gpt2.loss_type = "ForCausalLM"
    model = models.CausalLM(gpt2)

    def sample(g: torch.Generator):
        return (torch.randint(0, config.vocab_size, (batch, length), generator=g),)

    return model, sample, tuple(f"model.transformer.h.{i}" for i in range(config.n_layer))


def _deepspeech2(batch: int, quick: bool):
    features, frames, hidden, layers, label_len = (
        (9, 8, 8, 2, 3) if quick else (161, 300, 800, 5, 60)
    )
    chars = 29
    model = models.DeepSpeech2(features=features, hidden=hidden, layers=layers, chars=chars)

    def sample(g: torch.Generator):
        spectrogram = torch.randn(batch, 1, features, frames, generator=g)
        return spectrogram, torch.randint(1, chars, (batch, label_len), generator=g)

    return model, sample, ("conv", *(f"rnns.{i}" for i in range(layers)))


def _mlp(batch: int, quick: bool):
    width, hidden, layers, classes = (16, 32, 2, 10) if quick else (1024, 4096, 8, 1000)
    model = models.ResidualMlp(width=width, hidden=hidden, layers=layers, classes=classes)

    def sample(g: torch.Generator):
        x = torch.randn(batch, width, generator=g)
        return x, torch.randint(0, classes, (batch,), generator=g)

    return model, sample, tuple(f"blocks.{i}" for i in range(layers))


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            name="lstm-lm-medium",
            description="LSTM LM 2x650, vocab 10k, BPTT 35, dropout 0.5 (Zaremba medium)",
            batch=20,
            quick_batch=3,
            recurrent=True,
            compile_weight=1,
            builder=_lstm_lm(650, 0.5),
        ),
        Workload(
            name="lstm-lm-large",
            description="LSTM LM 2x1500, vocab 10k, BPTT 35, dropout 0.65 (Zaremba large)",
            batch=20,
            quick_batch=3,
            recurrent=True,
            compile_weight=1,
            builder=_lstm_lm(1500, 0.65),
        ),
        Workload(
            name="nmt-attention",
            description="Sockeye groundhog: src 50 / tgt 30, embed 500, biLSTM 1000, "
            "LSTMCell decoder 1000, MLP attention 512, vocab 17191/7709",
            batch=80,
            quick_batch=3,
            recurrent=True,
            compile_weight=5,
            builder=_nmt,
        ),
        Workload(
            name="resnet50",
            description="ResNet-50 (bottleneck [3,4,6,3]), 224x224, 1000 classes",
            batch=64,
            quick_batch=2,
            recurrent=False,
            compile_weight=4,
            builder=_resnet50,
        ),
        Workload(
            name="transformer",
            description="decoder-only Transformer 12x768, 12 heads, length 1024, vocab 32k, SDPA",
            batch=8,
            quick_batch=2,
            recurrent=False,
            compile_weight=4,
            builder=_transformer,
        ),
        Workload(
            name="resnet152",
            description="torchvision ResNet-152 (no weights), 224x224, 1000 classes",
            batch=32,
            quick_batch=2,
            recurrent=False,
            compile_weight=8,
            builder=_resnet152,
            packages=("torchvision",),
            cpu_slice=False,
        ),
        Workload(
            name="gpt2",
            description="transformers GPT-2 small config (12x768, vocab 50257, dropout 0.1), "
            "length 1024",
            batch=8,
            quick_batch=2,
            recurrent=False,
            compile_weight=4,
            builder=_gpt2,
            packages=("transformers",),
            cpu_slice=False,
        ),
        Workload(
            name="deepspeech2",
            description="DeepSpeech2: 2 conv2d, 5 biGRU 800, 300 frames x 161 features, CTC",
            batch=32,
            quick_batch=2,
            recurrent=True,
            compile_weight=2,
            builder=_deepspeech2,
        ),
        Workload(
            name="mlp",
            description="residual MLP 8x(1024->4096->1024), GELU + LayerNorm",
            batch=2048,
            quick_batch=4,
            recurrent=False,
            compile_weight=1,
            builder=_mlp,
        ),
    )
}
