"""The zoo sweep: public model families as installed, plus small models of ours, through
every planner mode (a study of where the planner falls back, crashes or is wrong).

    python benchmarks/zoo_sweep.py --out DIR [mirrorgrad bench's options, e.g. --jobs 12]

torchvision (classification, detection, segmentation, video), Hugging Face
``transformers`` (encoders, decoders, encoder-decoders, vision and speech, each built
from a small config: no weights are downloaded) and torchaudio models, each wrapped so
that ``model(*batch)`` is the scalar loss of one training step. Dropout (and stochastic
depth) is off, so every method's first-step gradients can be compared with
``torch.compile``'s. A family that is not installed is skipped with a note.

``--quick`` (the CPU slice CI runs) keeps the workloads marked ``cpu``: our small
models and a few ``transformers`` architectures, at tiny sizes.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mirrorgrad.bench.command import run_script_suite
from mirrorgrad.bench.suite_tables import methods_of, x_ratio
from mirrorgrad.bench.suites import Suite
from mirrorgrad.bench.workloads import Workload

Sample = Callable[[torch.Generator], tuple[Tensor, ...]]


def dropout_off(model: nn.Module) -> nn.Module:
    """Set every dropout, drop-path and stochastic-depth probability to 0, in place."""
    for m in model.modules():
        kind = type(m).__name__
        if any(k in kind for k in ("Dropout", "DropPath", "StochasticDepth", "Dropblock")):
            for attr in ("p", "drop_prob"):
                if isinstance(getattr(m, attr, None), float):
                    setattr(m, attr, 0.0)
    return model


def _frame_targets(classes: int, *shape: int, device: torch.device) -> Tensor:
    """Fixed targets of a given shape: a loss that weights every output differently
    without a target tensor whose shape the caller would have to know in advance."""
    n = math.prod(shape)
    return (torch.arange(n, device=device) * 7 % classes).reshape(shape)


class _Classify(nn.Module):
    """``model(x)`` logits (or ``.logits``) -> cross-entropy against labels."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor, labels: Tensor) -> Tensor:
        out = self.model(x)
        out = out["out"] if isinstance(out, dict) else getattr(out, "logits", out)
        return nn.functional.cross_entropy(out.float(), labels)


def _images(batch: int, size: int, classes: int, frames: int | None = None) -> Sample:
    def sample(g: torch.Generator) -> tuple[Tensor, ...]:
        shape = (batch, 3, size, size) if frames is None else (batch, 3, frames, size, size)
        return torch.randn(*shape, generator=g), torch.randint(0, classes, (batch,), generator=g)

    return sample


# ---- our small models (no extra package): the CPU slice's core -----------------------


class _Mlp(nn.Module):
    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.LayerNorm(4 * width),
            nn.Linear(4 * width, width), nn.Tanh(), nn.Linear(width, classes),
        )  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class _ConvNet(nn.Module):
    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for out in (width, 2 * width, 4 * width):
            layers += [nn.Conv2d(channels, out, 3, padding=1), nn.BatchNorm2d(out), nn.ReLU()]
            layers.append(nn.MaxPool2d(2))
            channels = out
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x).mean((2, 3)))


class _Recurrent(nn.Module):
    """torch.nn.LSTM or GRU over embedded tokens, a classifier on every step."""

    def __init__(self, cls: type[nn.RNNBase], vocab: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.rnn = cls(width, width, 2, bidirectional=cls is nn.GRU)
        self.head = nn.Linear(width * (2 if cls is nn.GRU else 1), vocab)

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        out, _ = self.rnn(self.embed(tokens))
        return nn.functional.cross_entropy(self.head(out).flatten(0, 1), targets.flatten())


class _ConformerBlock(nn.Module):
    """A conv-augmented attention block (the shape of speech encoders)."""

    def __init__(self, E: int, heads: int) -> None:
        super().__init__()

        def ff() -> nn.Module:
            return nn.Sequential(nn.LayerNorm(E), nn.Linear(E, 4 * E), nn.SiLU(),
                                 nn.Linear(4 * E, E))  # fmt: skip

        self.ff1, self.ff2 = ff(), ff()
        self.ln_att, self.att = nn.LayerNorm(E), nn.MultiheadAttention(E, heads)
        self.ln_conv = nn.LayerNorm(E)
        self.pw1, self.dw = nn.Conv1d(E, 2 * E, 1), nn.Conv1d(E, E, 31, padding=15, groups=E)
        self.bn, self.pw2, self.ln_out = nn.BatchNorm1d(E), nn.Conv1d(E, E, 1), nn.LayerNorm(E)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:  # x: (T, B, E)
        x = x + 0.5 * self.ff1(x)
        y = self.ln_att(x)
        x = x + self.att(y, y, y, key_padding_mask=mask, need_weights=False)[0]
        c = self.ln_conv(x).permute(1, 2, 0)
        c = nn.functional.glu(self.pw1(c), dim=1)
        c = self.pw2(nn.functional.silu(self.bn(self.dw(c))))
        x = x + c.permute(2, 0, 1)
        return self.ln_out(x + 0.5 * self.ff2(x))


class _Conformer(nn.Module):
    def __init__(self, E: int, heads: int, layers: int, classes: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_ConformerBlock(E, heads) for _ in range(layers))
        self.head = nn.Linear(E, classes)

    def forward(self, features: Tensor, labels: Tensor) -> Tensor:  # features: (B, T, E)
        mask = torch.zeros(features.shape[:2], dtype=torch.bool, device=features.device)
        x = features.transpose(0, 1)
        for block in self.blocks:
            x = block(x, mask)
        logits = self.head(x.transpose(0, 1))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _ours(name: str, quick: bool, batch: int) -> tuple[nn.Module, Sample]:
    w, size, T, vocab = (8, 16, 12, 50) if quick else (64, 64, 128, 1000)
    if name in ("mlp", "convnet"):
        body = _Mlp(w, 10) if name == "mlp" else _ConvNet(w, 10)
        x_shape = (batch, w) if name == "mlp" else (batch, 3, size, size)
        return _Classify(body), lambda g: (
            torch.randn(*x_shape, generator=g),
            torch.randint(0, 10, (batch,), generator=g),
        )
    if name in ("lstm", "gru"):
        model = _Recurrent(nn.LSTM if name == "lstm" else nn.GRU, vocab, w)
        return model, lambda g: tuple(torch.randint(0, vocab, (2, T, batch), generator=g))
    if name == "transformer-encoder":
        layer = nn.TransformerEncoderLayer(w, 4, 4 * w, dropout=0.0, batch_first=True,
                                           norm_first=True)  # fmt: skip
        body = nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                             nn.Flatten(1), nn.Linear(T * w, 10))  # fmt: skip
        return _Classify(body), lambda g: (
            torch.randn(batch, T, w, generator=g),
            torch.randint(0, 10, (batch,), generator=g),
        )
    if name == "conformer":
        E = 16 if quick else 144
        model = _Conformer(E, 4, 2, 32)
        return model, lambda g: (
            torch.randn(batch, T, E, generator=g),
            torch.randint(0, 32, (batch, T), generator=g),
        )
    raise KeyError(name)


# ---- Hugging Face transformers, from small configs -----------------------------------

# Sizes set on every config that has the key (attribute maps included: gpt2's n_embd,
# t5's d_model answer to hidden_size). Quick (CPU) sizes, then GPU sizes.
_HF_SIZES = {
    "quick": dict(hidden=32, layers=1, heads=4, ffn=64, vocab=128, seq=16),
    "gpu": dict(hidden=256, layers=2, heads=4, ffn=1024, vocab=4096, seq=128),
}


def _hf_config(model_type: str, quick: bool, sized: bool, **extra: object) -> object:
    """A small config of ``model_type``: widths, depths and heads set by their usual names
    (unless ``sized`` is False: the model's sizes are lists, given in ``extra``), special
    token ids inside the small vocabulary, every dropout 0."""
    from transformers import AutoConfig

    s = _HF_SIZES["quick" if quick else "gpu"]
    default = AutoConfig.for_model(model_type)
    names = set(default.to_dict()) | set(getattr(default, "attribute_map", {}))
    wanted: dict[str, object] = {"vocab_size": s["vocab"], "use_cache": False}
    if sized:
        wanted |= _sizes(s)
    for key, value in default.to_dict().items():
        if key.endswith("_token_id") and isinstance(value, int) and value >= s["vocab"]:
            wanted[key] = 0 if "pad" in key else 1  # special tokens inside the small vocabulary
        if ("dropout" in key or key.endswith("_pdrop") or key == "layerdrop") and isinstance(
            value, float
        ):
            wanted[key] = 0.0
    kwargs = {k: v for k, v in wanted.items() if k in names} | extra
    return AutoConfig.for_model(model_type, **kwargs)


def _sizes(s: dict[str, int]) -> dict[str, object]:
    """The small sizes under every name configs give them (gpt2's n_embd, t5's d_ff, ...)."""
    wanted: dict[str, object] = {}
    for key in ("hidden_size", "d_model", "n_embd", "embed_dim"):
        wanted[key] = s["hidden"]
    for key in ("num_hidden_layers", "num_layers", "encoder_layers", "decoder_layers",
                "num_decoder_layers", "n_layer"):  # fmt: skip
        wanted[key] = s["layers"]
    for key in ("num_attention_heads", "num_heads", "encoder_attention_heads",
                "decoder_attention_heads", "num_key_value_heads", "n_head"):  # fmt: skip
        wanted[key] = s["heads"]
    for key in ("intermediate_size", "d_ff", "encoder_ffn_dim", "decoder_ffn_dim",
                "ffn_dim", "n_inner", "hidden_dim"):  # fmt: skip
        wanted[key] = s["ffn"]
    for key in ("head_dim", "d_kv"):
        wanted[key] = s["hidden"] // s["heads"]
    for key in ("max_position_embeddings", "n_positions", "max_source_positions",
                "max_target_positions"):  # fmt: skip
        wanted[key] = max(512, 4 * s["seq"])
    return wanted


class _HfLoss(nn.Module):
    """A transformers model with labels: its ``.loss`` is the step's loss."""

    def __init__(self, model: nn.Module, input_name: str) -> None:
        super().__init__()
        self.model, self.input_name = model, input_name

    def forward(self, inputs: Tensor, labels: Tensor) -> Tensor:
        return self.model(**{self.input_name: inputs}, labels=labels).loss


@dataclass(kw_only=True, slots=True, frozen=True)
class _Hf:
    model_type: str
    task: str  # "masked" | "causal" | "seq2seq" | "image" | "speech-ctc"
    cpu: bool = False
    extra: tuple[tuple[str, object], ...] = ()
    sized: bool = True  # False: sizes are lists (convnext, swin), all given in ``extra``


def _hf(spec: _Hf, quick: bool, batch: int) -> tuple[nn.Module, Sample]:
    import transformers as tf

    config = _hf_config(spec.model_type, quick, spec.sized, **dict(spec.extra))
    for key in ("decoder_start_token_id", "pad_token_id"):  # seq2seq labels are shifted
        if spec.task == "seq2seq" and getattr(config, key, None) is None:
            setattr(config, key, 0)
    s = _HF_SIZES["quick" if quick else "gpu"]
    vocab, seq = s["vocab"], s["seq"]
    if spec.task in ("masked", "causal", "seq2seq"):
        auto = {"masked": tf.AutoModelForMaskedLM, "causal": tf.AutoModelForCausalLM,
                "seq2seq": tf.AutoModelForSeq2SeqLM}[spec.task]  # fmt: skip
        model = _HfLoss(auto.from_config(config), "input_ids")
        return model, lambda g: tuple(torch.randint(3, vocab, (2, batch, seq), generator=g))
    if spec.task == "image":
        size = getattr(config, "image_size", 64)
        size = size if isinstance(size, int) and size <= 64 else 64
        model = _HfLoss(tf.AutoModelForImageClassification.from_config(config), "pixel_values")
        return model, _images(batch, size, config.num_labels)
    if spec.task == "speech-ctc":
        model = _HfLoss(tf.AutoModelForCTC.from_config(config), "input_values")
        samples = 4000 if quick else 16000
        return model, lambda g: (
            torch.randn(batch, samples, generator=g),
            torch.randint(1, config.vocab_size, (batch, 8), generator=g),
        )
    raise ValueError(f"unknown task {spec.task!r}")


_VISION = (("image_size", 64), ("num_labels", 10))
_STAGES = (("depths", [1, 1, 2, 1]), ("hidden_sizes", [32, 64, 128, 256]))
# 64 px in patches of 4: the last stage is 2x2, so windows of 2.
_SWIN = (("embed_dim", 32), ("depths", [1, 1, 2, 1]), ("num_heads", [1, 2, 4, 8]),
         ("window_size", 2))  # fmt: skip
_HF_MODELS = (
    _Hf(model_type="bert", task="masked", cpu=True),
    _Hf(model_type="roberta", task="masked"),
    _Hf(model_type="distilbert", task="masked", cpu=True),
    _Hf(model_type="albert", task="masked"),
    _Hf(model_type="electra", task="masked"),
    _Hf(model_type="deberta-v2", task="masked"),
    _Hf(model_type="xlm-roberta", task="masked"),
    _Hf(model_type="mobilebert", task="masked", extra=(("embedding_size", 64),)),
    _Hf(model_type="mpnet", task="masked"),
    _Hf(model_type="convbert", task="masked"),
    _Hf(model_type="gpt2", task="causal", cpu=True),
    _Hf(model_type="gpt_neo", task="causal", extra=(("attention_types", [[["global"], 2]]),)),
    _Hf(model_type="gptj", task="causal", extra=(("rotary_dim", 16),)),
    _Hf(model_type="gpt_neox", task="causal"),
    _Hf(model_type="opt", task="causal", extra=(("word_embed_proj_dim", 256),)),
    _Hf(model_type="llama", task="causal", cpu=True),
    _Hf(model_type="mistral", task="causal"),
    _Hf(model_type="qwen2", task="causal"),
    _Hf(model_type="qwen3", task="causal"),
    _Hf(model_type="gemma", task="causal"),
    _Hf(model_type="phi", task="causal"),
    _Hf(model_type="phi3", task="causal"),
    _Hf(model_type="falcon", task="causal"),
    _Hf(model_type="bloom", task="causal"),
    _Hf(model_type="codegen", task="causal", extra=(("rotary_dim", 16),)),
    _Hf(model_type="stablelm", task="causal"),
    _Hf(model_type="olmo", task="causal"),
    _Hf(model_type="t5", task="seq2seq", cpu=True),
    _Hf(model_type="bart", task="seq2seq", cpu=True),
    _Hf(model_type="mbart", task="seq2seq"),
    _Hf(model_type="pegasus", task="seq2seq"),
    _Hf(model_type="marian", task="seq2seq", extra=(("decoder_vocab_size", 4096),)),
    _Hf(model_type="blenderbot", task="seq2seq"),
    _Hf(model_type="vit", task="image", extra=_VISION),
    _Hf(model_type="dinov2", task="image", extra=_VISION),
    _Hf(model_type="beit", task="image", extra=_VISION),
    _Hf(model_type="convnext", task="image", sized=False, extra=(*_VISION, *_STAGES)),
    _Hf(model_type="swin", task="image", sized=False, extra=(*_VISION, *_SWIN)),
    _Hf(model_type="wav2vec2", task="speech-ctc", extra=(("vocab_size", 32),)),
)


# ---- torchvision and torchaudio ------------------------------------------------------


class _Detect(nn.Module):
    """A torchvision detector in training mode: the sum of its losses."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: Tensor, boxes: Tensor, labels: Tensor) -> Tensor:
        targets = [{"boxes": b, "labels": c} for b, c in zip(boxes, labels)]
        if "maskrcnn" in type(self.model).__name__.lower():
            H, W = images.shape[-2:]
            for t in targets:
                t["masks"] = torch.zeros(len(t["boxes"]), H, W, dtype=torch.uint8,
                                         device=images.device)  # fmt: skip
                x0, y0, x1, y1 = t["boxes"][0].int().tolist()
                t["masks"][:, y0:y1, x0:x1] = 1
        losses = self.model(list(images), targets)
        return sum(losses.values())


def _detection_sample(batch: int, size: int) -> Sample:
    def sample(g: torch.Generator) -> tuple[Tensor, ...]:
        corner = torch.rand(batch, 2, 2, generator=g) * size / 2
        extent = size / 8 + torch.rand(batch, 2, 2, generator=g) * size / 3
        boxes = torch.cat([corner, corner + extent], -1)  # [B, 2 boxes, x0 y0 x1 y1]
        labels = torch.randint(1, 3, (batch, 2), generator=g)
        return torch.rand(batch, 3, size, size, generator=g), boxes, labels

    return sample


_TV_CLASSIFY = (
    "resnet18", "resnet50", "resnext50_32x4d", "wide_resnet50_2", "mobilenet_v2",
    "mobilenet_v3_small", "mobilenet_v3_large", "efficientnet_b0", "efficientnet_v2_s",
    "densenet121", "vgg11_bn", "alexnet", "squeezenet1_1", "shufflenet_v2_x1_0",
    "mnasnet1_0", "regnet_y_400mf", "regnet_x_400mf", "convnext_tiny", "vit_b_16",
    "swin_t", "swin_v2_t", "googlenet", "inception_v3",
)  # fmt: skip
_TV_DETECT = (
    "fasterrcnn_mobilenet_v3_large_320_fpn", "fasterrcnn_resnet50_fpn", "retinanet_resnet50_fpn",
    "fcos_resnet50_fpn", "ssdlite320_mobilenet_v3_large", "maskrcnn_resnet50_fpn",
)  # fmt: skip
_TV_SEGMENT = ("fcn_resnet50", "deeplabv3_mobilenet_v3_large", "lraspp_mobilenet_v3_large")
_TV_VIDEO = ("r3d_18", "mc3_18", "r2plus1d_18")


def _torchvision(name: str, batch: int) -> tuple[nn.Module, Sample]:
    import torchvision.models as tvm
    from torchvision.models import detection, segmentation, video

    if name in _TV_CLASSIFY:
        kwargs: dict[str, object] = {"weights": None, "num_classes": 10}
        size = {"inception_v3": 128, "googlenet": 128}.get(name, 64)
        if name in ("googlenet", "inception_v3"):
            kwargs |= {"aux_logits": False, "init_weights": True}
        if name == "vit_b_16":
            kwargs["image_size"] = size
        return _Classify(getattr(tvm, name)(**kwargs)), _images(batch, size, 10)
    if name in _TV_DETECT:
        kwargs = {"weights": None, "weights_backbone": None, "num_classes": 3}
        if "rcnn" in name or name in ("retinanet_resnet50_fpn", "fcos_resnet50_fpn"):
            kwargs |= {"min_size": 128, "max_size": 128}
        size = 320 if name.startswith("ssd") else 128
        return _Detect(getattr(detection, name)(**kwargs)), _detection_sample(batch, size)
    if name in _TV_SEGMENT:
        model = getattr(segmentation, name)(weights=None, weights_backbone=None, num_classes=5)

        def sample(g: torch.Generator) -> tuple[Tensor, ...]:
            x = torch.randn(batch, 3, 64, 64, generator=g)
            return x, torch.randint(0, 5, (batch, 64, 64), generator=g)

        return _Classify(model), sample
    if name in _TV_VIDEO:
        return _Classify(getattr(video, name)(weights=None, num_classes=10)), _images(
            batch, 64, 10, frames=8
        )
    raise KeyError(name)


class _AudioHead(nn.Module):
    """An audio model's frame features -> a fixed-target cross-entropy (or MSE)."""

    def __init__(self, model: nn.Module, classes: int, channels_first: bool) -> None:
        super().__init__()
        self.model, self.classes, self.channels_first = model, classes, channels_first

    def forward(self, *inputs: Tensor) -> Tensor:
        out = self.model(*inputs)
        out = out[0] if isinstance(out, tuple) else out
        if self.classes == 0:  # waveform out (source separation): regression
            return out.float().square().mean()
        logits = out.transpose(1, 2) if self.channels_first else out  # -> (B, T, C)
        targets = _frame_targets(self.classes, *logits.shape[:2], device=logits.device)
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _torchaudio(name: str, batch: int) -> tuple[nn.Module, Sample]:
    import torchaudio.models as tam

    T = 128

    def lengths(g: torch.Generator) -> Tensor:
        return torch.full((batch,), T, dtype=torch.long)

    if name == "conformer":
        body = tam.Conformer(input_dim=80, num_heads=4, ffn_dim=256, num_layers=2,
                             depthwise_conv_kernel_size=31, dropout=0.0)  # fmt: skip
        model = _AudioHead(_WithLengths(body), 80, channels_first=False)
        return model, lambda g: (torch.randn(batch, T, 80, generator=g), lengths(g))
    if name == "emformer":
        body = tam.Emformer(input_dim=80, num_heads=4, ffn_dim=256, num_layers=2,
                            segment_length=16, dropout=0.0)  # fmt: skip
        model = _AudioHead(_WithLengths(body), 80, channels_first=False)
        return model, lambda g: (torch.randn(batch, T, 80, generator=g), lengths(g))
    if name == "wav2letter":
        model = _AudioHead(tam.Wav2Letter(num_classes=40, input_type="mfcc", num_features=40),
                           40, channels_first=True)  # fmt: skip
        return model, lambda g: (torch.randn(batch, 40, T, generator=g),)
    if name == "deepspeech":
        model = _AudioHead(tam.DeepSpeech(n_feature=40, n_hidden=256, n_class=30, dropout=0.0),
                           30, channels_first=False)  # fmt: skip
        return model, lambda g: (torch.randn(batch, 1, T, 40, generator=g),)
    if name == "wav2vec2":
        body = tam.wav2vec2_model(
            extractor_mode="group_norm", extractor_conv_layer_config=None,
            extractor_conv_bias=False, encoder_embed_dim=128, encoder_projection_dropout=0.0,
            encoder_pos_conv_kernel=32, encoder_pos_conv_groups=4, encoder_num_layers=2,
            encoder_num_heads=4, encoder_attention_dropout=0.0, encoder_ff_interm_features=256,
            encoder_ff_interm_dropout=0.0, encoder_dropout=0.0, encoder_layer_norm_first=False,
            encoder_layer_drop=0.0, aux_num_out=32,
        )  # fmt: skip
        return _AudioHead(body, 32, channels_first=False), lambda g: (
            torch.randn(batch, 16000, generator=g),
        )
    if name == "conv_tasnet":
        body = tam.ConvTasNet(num_sources=2, enc_kernel_size=16, enc_num_feats=64,
                              msk_kernel_size=3, msk_num_feats=32, msk_num_hidden_feats=64,
                              msk_num_layers=4, msk_num_stacks=2)  # fmt: skip
        return _AudioHead(body, 0, channels_first=True), lambda g: (
            torch.randn(batch, 1, 8000, generator=g),
        )
    raise KeyError(name)


class _WithLengths(nn.Module):
    """``model(x, lengths) -> (y, lengths)``: keep ``y``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        return self.model(x, lengths)[0]


_TA_MODELS = ("conformer", "emformer", "wav2letter", "deepspeech", "wav2vec2", "conv_tasnet")
_OURS = ("mlp", "convnet", "lstm", "gru", "transformer-encoder", "conformer")


def _workload(
    name: str,
    description: str,
    packages: tuple[str, ...],
    cpu: bool,
    build: Callable,
    batch: int = 8,
) -> Workload:
    def builder(batch: int, quick: bool):
        model, sample = build(quick, batch)
        return dropout_off(model), sample, ()

    return Workload(
        name=name,
        description=description,
        batch=batch,
        quick_batch=2,
        recurrent=False,
        compile_weight=1,
        builder=builder,
        grad_reference="compile",
        packages=packages,
        cpu_slice=cpu,
    )


def _all() -> list[Workload]:
    found = [
        _workload(f"ours-{n}", f"mirrorgrad's small {n}", (), True,
                  lambda quick, batch, n=n: _ours(n, quick, batch))
        for n in _OURS
    ]  # fmt: skip
    found += [
        _workload(f"hf-{s.model_type}", f"transformers {s.model_type} ({s.task}), small config",
                  ("transformers",), s.cpu, lambda quick, batch, s=s: _hf(s, quick, batch))
        for s in _HF_MODELS
    ]  # fmt: skip
    found += [
        _workload(f"tv-{n}", f"torchvision {n}, no weights", ("torchvision",), False,
                  lambda quick, batch, n=n: _torchvision(n, batch))
        for n in (*_TV_CLASSIFY, *_TV_SEGMENT, *_TV_VIDEO)
    ]  # fmt: skip
    found += [
        _workload(f"ta-{n}", f"torchaudio {n}, small", ("torchaudio",), False,
                  lambda quick, batch, n=n: _torchaudio(n, batch))
        for n in _TA_MODELS
    ]  # fmt: skip
    # Detectors last: data-dependent shapes break graphs, their compiles are the longest.
    found += [
        _workload(f"tv-{n}", f"torchvision {n} (training losses), no weights",
                  ("torchvision",), False, lambda quick, batch, n=n: _torchvision(n, batch),
                  batch=2)
        for n in _TV_DETECT
    ]  # fmt: skip
    return found


WORKLOADS: dict[str, Workload] = {w.name: w for w in _all()}
METHODS = ("eager", "compile", "mirror-balance", "mirror-budget-0.5", "mirror-budget-0.3")


# ---- the report's table: ok / fallback / failed per model and mode --------------------


def _zoo_cell(m: dict[str, Any]) -> str:
    if m["status"] == "skipped":
        return "skipped"
    if m["status"] != "ok":
        return "CRASH"
    if m.get("grads_ok") is False:
        return "WRONG"
    return "fallback" if m.get("fallback") else "ok"


def zoo_table(doc: dict[str, Any]) -> str:
    methods = methods_of(doc)
    mirror = [m for m in methods if m.startswith("mirror-")]
    head = ["model", *methods]
    for m in mirror:
        head += [f"{m} peak / eager", "peak / compile", "time / compile"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---|" * len(methods)
             + "---:|" * (3 * len(mirror))]  # fmt: skip
    counts: dict[str, int] = {}
    notes, skipped = [], {}
    for name, w in doc["workloads"].items():
        by = {m["method"]: m for m in w["methods"]}
        if all(m["status"] == "skipped" for m in by.values()):
            reason = next(iter(by.values()))["error"]
            skipped.setdefault(reason, []).append(name)
            continue
        eager = by.get("eager")
        if eager is not None and eager["status"] == "failed":
            # The model did not train even without compiling: a build problem, not a plan's.
            counts["model failed eagerly"] = counts.get("model failed eagerly", 0) + 1
            notes.append(f"- {name}: fails eagerly, not counted: {eager['error']}")
            continue
        cells = [name]
        for method in methods:
            cell = _zoo_cell(by[method]) if method in by else "—"
            counts[cell] = counts.get(cell, 0) + 1
            cells.append(cell)
            m = by.get(method)
            if m and (m.get("fallback") or m["status"] == "failed"):
                notes.append(f"- {name} / {method}: {m.get('fallback') or m.get('error')}")
            if m and m.get("grads_ok") is False:
                notes.append(f"- {name} / {method}: gradients off by {m['grad_error']:.1e} "
                             f"(worst {m['grad_worst']})")  # fmt: skip
        for method in mirror:
            m = by.get(method, {})
            cells += [x_ratio(m.get("peak_vs_eager")), x_ratio(m.get("peak_vs_compile")),
                      x_ratio(m.get("time_vs_compile"))]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    total = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    lines = [f"Model x mode results: {total}.", "", *lines]
    if notes:
        lines += ["", "Fallbacks, crashes and wrong gradients:", "", *notes]
    for reason, names in skipped.items():
        lines += ["", f"Skipped ({reason}): {len(names)} models ({', '.join(names[:6])}...)"]
    return "\n".join(lines)


SUITE = Suite(
    name="zoo-sweep",
    description="public model families: eager, torch.compile and every planner mode",
    workloads=WORKLOADS,
    methods=METHODS,
    table=zoo_table,
    table_only=True,
    script=Path(__file__).resolve(),
)

if __name__ == "__main__":
    sys.exit(run_script_suite(SUITE, []))
