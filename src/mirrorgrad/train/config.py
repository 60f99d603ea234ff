"""Configuration of `mirrorgrad train lm`: model presets and the resolved run settings."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from mirrorgrad.options import MirrorOptions

# --precision -> the autocast dtype of the forward (None: plain float32)
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Preset:
    """A model size with the training defaults that suit it."""

    embedding: int
    hidden: int
    layers: int
    dropout: float
    bptt: int
    batch_size: int
    lr: float
    clip: float
    epochs: int
    max_steps: int | None
    vocab_size: int


PRESETS = {
    # Small enough for a CPU in a few minutes: 300 steps of 32 x 35 tokens (about a
    # quarter of an epoch of the default corpus), then valid and test.
    "tiny": Preset(
        embedding=128, hidden=128, layers=1, dropout=0.1, bptt=35, batch_size=32,
        lr=20.0, clip=0.25, epochs=1, max_steps=300, vocab_size=5000,
    ),
    # Zaremba et al. (2014) medium and large sizes, with the SGD schedule of PyTorch's
    # word_language_model example (lr 20, clip 0.25, lr / 4 when valid stalls).
    "medium": Preset(
        embedding=650, hidden=650, layers=2, dropout=0.5, bptt=35, batch_size=20,
        lr=20.0, clip=0.25, epochs=39, max_steps=None, vocab_size=10000,
    ),
    "large": Preset(
        embedding=1500, hidden=1500, layers=2, dropout=0.65, bptt=35, batch_size=20,
        lr=20.0, clip=0.25, epochs=55, max_steps=None, vocab_size=10000,
    ),
}  # fmt: skip


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class TrainConfig:
    """Everything a run needs; the CLI fills it from its options and the preset."""

    data: Path | None = None  # None: the default corpus
    model: str = "tiny"
    device: str = "auto"
    mirror: MirrorOptions = dataclasses.field(default_factory=MirrorOptions)
    epochs: int = 1
    max_steps: int | None = None
    batch_size: int = 20
    eval_batch_size: int = 10
    bptt: int = 35
    lr: float | None = None  # None: the preset's, or on resume the checkpoint's
    clip: float = 0.25
    seed: int = 1234
    logdir: Path | None = Path("runs/lm")
    ckpt_dir: Path | None = None  # None: <logdir>/checkpoints
    resume: Path | None = None
    dropout: float | None = None  # None: the preset's
    tie_weights: bool = False
    char: bool = False
    vocab_size: int | None = 10000
    log_freq: int = 50
    ckpt_every: int = 1000
    precision: str = "fp32"  # a key of PRECISIONS
    step_graph: bool = True  # one GPU: the whole step as one CUDA Graph

    def __post_init__(self) -> None:
        if self.model not in PRESETS:
            raise ValueError(f"--model {self.model!r}: choose one of {', '.join(PRESETS)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device {self.device!r}: choose auto, cpu or cuda")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision {self.precision!r}: choose {' or '.join(PRECISIONS)}")
        for name in ("epochs", "batch_size", "eval_batch_size", "bptt", "log_freq", "ckpt_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError("--max-steps must be >= 1")
        if self.vocab_size is not None and self.vocab_size < 3:
            raise ValueError("--vocab-size must be >= 3 (<unk>, <eos> and one word)")
        # `not (x > 0)` is also true for NaN; inf is refused by isfinite.
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--dropout {self.dropout}: must be in [0, 1)")
        for name in ("lr", "clip"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"--{name} {value}: must be a finite number > 0")
        # torch.manual_seed takes [-2**63, 2**64); rank r seeds its dropout with seed + r.
        seed = self.seed
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ValueError(f"--seed {seed!r}: must be an integer in [0, 2**63)")

    @property
    def preset(self) -> Preset:
        preset = PRESETS[self.model]
        if self.dropout is None:
            return preset
        return dataclasses.replace(preset, dropout=self.dropout)

    @property
    def checkpoint_dir(self) -> Path | None:
        if self.ckpt_dir is not None:
            return self.ckpt_dir
        return None if self.logdir is None else self.logdir / "checkpoints"

    @classmethod
    def from_preset(cls, model: str = "tiny", **overrides) -> TrainConfig:
        """The preset's defaults, with every override that is not None applied.

        A preset's step cap applies only while the number of epochs is its own.
        """
        if model not in PRESETS:
            raise ValueError(f"--model {model!r}: choose one of {', '.join(PRESETS)}")
        p = PRESETS[model]
        # No lr: the preset's on a new run, the checkpoint's on a resume (unless given).
        values = dict(
            epochs=p.epochs, max_steps=p.max_steps, batch_size=p.batch_size, bptt=p.bptt,
            clip=p.clip, vocab_size=p.vocab_size,
        )  # fmt: skip
        overrides = {k: v for k, v in overrides.items() if v is not None}
        if "epochs" in overrides and "max_steps" not in overrides:
            values["max_steps"] = None
        values.update(overrides)
        return cls(model=model, **values)
