"""The word-lm suite: PyTorch's word_language_model training step beside `mirrorgrad train lm`'s.

    mirrorgrad bench --suite word-lm --out DIR

``pytorch-example`` is the step of PyTorch's examples/word_language_model (``main.py``
with ``--model LSTM``): ``nn.LSTM`` (cuDNN), dropout, the full-vocabulary ``Linear``,
``log_softmax`` + ``NLLLoss``, gradient-norm clip 0.25 and the hand-written SGD update,
eager, the hidden state carried (detached) from window to window. ``train-lm*`` is the
step `mirrorgrad train lm` runs, taken from the train package itself (its model, its
compile options, its step), with ``--mirror balance`` (its default), ``off`` and
``budget:0.5``; its model starts from the example's weights. Sizes are the train
presets' (medium: 2x650, dropout 0.5; large: 2x1500, dropout 0.65), vocabulary 10k,
BPTT 35, lr 20.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from mirrorgrad.bench.methods import Backend, Method
from mirrorgrad.bench.workloads import Workload, token_pairs

VOCAB, BPTT, LR, CLIP = 10_000, 35, 20.0, 0.25
_QUICK = {"vocab": 50, "width": 16, "bptt": 5}


def _preset(name: str, quick: bool):
    from mirrorgrad.train.config import PRESETS

    preset = PRESETS[name]
    if quick:
        preset = dataclasses.replace(preset, embedding=_QUICK["width"], hidden=_QUICK["width"])
    return preset


class ExampleLM(nn.Module):
    """PyTorch's word_language_model ``RNNModel`` for ``--model LSTM`` (untied)."""

    def __init__(self, vocab: int, preset) -> None:
        super().__init__()
        self.vocab, self.preset = vocab, preset
        self.drop = nn.Dropout(preset.dropout)
        self.encoder = nn.Embedding(vocab, preset.embedding)
        self.rnn = nn.LSTM(preset.embedding, preset.hidden, preset.layers, dropout=preset.dropout)
        self.decoder = nn.Linear(preset.hidden, vocab)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, tokens: Tensor, hidden: tuple[Tensor, Tensor]):
        emb = self.drop(self.encoder(tokens))
        output, hidden = self.rnn(emb, hidden)
        decoded = self.decoder(self.drop(output)).view(-1, self.vocab)
        return nn.functional.log_softmax(decoded, dim=1), hidden


def _example_step(model: nn.Module, batch: tuple[Tensor, ...], backend: Backend):
    return example_step(model, *batch)


def example_step(
    model: ExampleLM, tokens: Tensor, targets: Tensor, autocast_dtype: torch.dtype | None = None
):
    """main.py's ``train()`` body for one batch; with ``autocast_dtype`` its forward and
    loss under autocast, as AMP runs it."""
    layers, hidden = model.preset.layers, model.preset.hidden
    w = model.decoder.weight
    zeros = torch.zeros(layers, tokens.shape[1], hidden, device=w.device, dtype=w.dtype)
    state = [(zeros, zeros.clone())]
    criterion = nn.NLLLoss()
    device_type = w.device.type
    amp = autocast_dtype is not None

    def step() -> Tensor:
        model.zero_grad()
        hidden = tuple(h.detach() for h in state[0])  # repackage_hidden
        with torch.autocast(device_type, dtype=autocast_dtype, enabled=amp):
            output, state[0] = model(tokens, hidden)
            loss = criterion(output, targets.reshape(-1))
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-LR)
        return loss

    return step


def _to_train_model(example: nn.Module) -> nn.Module:
    """`mirrorgrad train lm`'s ``LanguageModel`` at the example's sizes and weights."""
    from mirrorgrad.train.model import LanguageModel

    p = next(example.parameters())
    model = LanguageModel(example.vocab, example.preset).to(p.device, p.dtype)
    model.load_state_dict(example.state_dict())
    return model


def _train_lm_step(mirror: str):
    """The step `mirrorgrad train lm --mirror MIRROR` runs: the train package's own
    compile (``train.step.compile_for_training``) and SGD step (``train.step.sgd_step``)."""

    def make_step(model: nn.Module, batch: tuple[Tensor, ...], backend: Backend):
        from mirrorgrad.options import MirrorOptions
        from mirrorgrad.train import step

        tokens, targets = batch
        device = tokens.device
        step_model = step.compile_for_training(model, MirrorOptions.from_cli(mirror), device)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        state = [model.initial_state(tokens.shape[1], device)]

        def one_step():
            loss, _, state[0] = step.sgd_step(
                step_model, model, optimizer, tokens, targets, state[0], clip=CLIP
            )
            return loss

        return one_step

    return make_step


def methods() -> list[Method]:
    found = [
        Method(
            name="pytorch-example",
            description="PyTorch's word_language_model step: nn.LSTM (cuDNN), eager",
            wrap=lambda model, blocks, backend: model,
            compiles=False,
            make_step=_example_step,
        )
    ]
    for suffix, mirror in (("", "balance"), ("-off", "off"), ("-budget-0.5", "budget:0.5")):
        found.append(
            Method(
                name=f"train-lm{suffix}",
                description=f"mirrorgrad train lm's step, --mirror {mirror}",
                wrap=lambda model, blocks, backend: model,
                compiles=True,
                rebuild=_to_train_model,
                make_step=_train_lm_step(mirror),
            )
        )
    return found


def _workload(preset_name: str, batch: int) -> Workload:
    def builder(batch: int, quick: bool):
        vocab, bptt = (_QUICK["vocab"], _QUICK["bptt"]) if quick else (VOCAB, BPTT)
        model = ExampleLM(vocab, _preset(preset_name, quick))
        return model, token_pairs(vocab, bptt, batch), ("rnn",)

    return Workload(
        name=f"word-lm-{preset_name}-b{batch}",
        description=f"word LM, train preset {preset_name}, vocab 10k, BPTT 35, batch {batch}",
        batch=batch,
        quick_batch=3,
        recurrent=True,
        compile_weight=2,
        builder=builder,
        tokens_per_sample=lambda quick: _QUICK["bptt"] if quick else BPTT,
        cpu_slice=(preset_name, batch) == ("medium", 20),
    )


WORKLOADS: dict[str, Workload] = {
    w.name: w for w in (_workload("medium", 20), _workload("large", 20), _workload("medium", 128))
}
METHODS = ("pytorch-example", "train-lm", "train-lm-off", "train-lm-budget-0.5")
