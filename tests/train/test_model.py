"""The word LM's rows stored 16-byte aligned: the same model as the unpadded one, exactly."""

import dataclasses

import pytest
import torch

from mirrorgrad.ops import aligned_mm
from mirrorgrad.ops.linear_cross_entropy import op as lce_op
from mirrorgrad.options import MirrorOptions
from mirrorgrad.train import checkpoint, config, progress, step
from mirrorgrad.train.config import PRESETS
from mirrorgrad.train.distributed import World
from mirrorgrad.train.model import LanguageModel, stored_width
from mirrorgrad.train.setup import set_up

VOCAB, T, B = 37, 6, 3
# 10 and 13 wide: stored 16 wide, as the medium preset's 650 is stored 656 wide.
MISALIGNED = dataclasses.replace(PRESETS["tiny"], embedding=10, hidden=13, layers=2, dropout=0.0)
PADDED = ("encoder.weight", "rnn.weight_ih_l0", "decoder.weight")


def _models(preset=MISALIGNED, dtype=torch.float64, **kwargs):
    """(unpadded reference, padded model with the reference's weights)."""
    torch.manual_seed(0)
    plain = LanguageModel(VOCAB, preset, aligned_rows=False, **kwargs).to(dtype)
    padded = LanguageModel(VOCAB, preset, **kwargs).to(dtype)
    padded.load_state_dict(plain.state_dict())  # real-width tensors, padded on the way in
    return plain, padded


def _batch(dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (T + 1, B), generator=g)
    state = tuple(torch.randn(MISALIGNED.layers, B, MISALIGNED.hidden, generator=g, dtype=dtype)
                  for _ in range(2))  # fmt: skip
    return tokens[:-1], tokens[1:], state


def _width(name: str, preset) -> int:
    return preset.hidden if name.startswith("decoder") else preset.embedding


def _real(name: str, t: torch.Tensor, preset=MISALIGNED) -> torch.Tensor:
    """``t``'s real columns (all of it for an unpadded weight)."""
    return t[:, : _width(name, preset)] if name in PADDED else t


def _pads(name: str, t: torch.Tensor, preset=MISALIGNED) -> torch.Tensor:
    """``t``'s pad columns (none for an unpadded weight)."""
    return t[:, _width(name, preset) :] if name in PADDED else t[:0]


def test_stored_widths():
    assert stored_width(650) == 656 and stored_width(1500) == 1504
    assert stored_width(128) == 128  # tiny: aligned already


def test_the_misaligned_weights_are_stored_padded_with_zeros():
    _, padded = _models()
    assert padded.real_widths == {"encoder.weight": 10, "rnn.weight_ih_l0": 10,
                                  "decoder.weight": 13}  # fmt: skip
    params = dict(padded.named_parameters())
    assert params["encoder.weight"].shape == (VOCAB, 16)
    assert params["rnn.weight_ih_l0"].shape == (4 * 13, 16)
    assert params["rnn.weight_ih_l1"].shape == (4 * 13, 13)  # inside the RNN op: its own rule
    assert params["decoder.weight"].shape == (VOCAB, 16)
    fresh = dict(LanguageModel(VOCAB, MISALIGNED).named_parameters())  # initialised, not loaded
    for name in PADDED:
        assert _pads(name, fresh[name]).shape[1] > 0
        assert torch.count_nonzero(_pads(name, fresh[name])) == 0, name
        assert torch.count_nonzero(_real(name, fresh[name])) == _real(name, fresh[name]).numel()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_equal_to_the_unpadded_model_with_zero_gradients_in_the_pads(dtype, tie):
    preset = dataclasses.replace(MISALIGNED, hidden=10) if tie else MISALIGNED
    plain, padded = _models(preset, dtype, tie_weights=tie)
    if tie:
        assert padded.decoder.weight is padded.encoder.weight
        assert padded.encoder.weight.shape == (VOCAB, 16)
    tokens, targets, state = _batch(dtype)
    state = tuple(s[..., : preset.hidden] for s in state)
    results = []
    for model in (plain, padded):
        loss, (h, c) = model(tokens, targets, state)
        loss.backward()
        results.append((loss, h, c, dict(model.named_parameters())))
    (loss, h, c, want), (loss_p, h_p, c_p, got) = results
    torch.testing.assert_close(loss_p, loss)
    torch.testing.assert_close((h_p, c_p), (h, c))
    assert want.keys() == got.keys()
    for name, p in got.items():
        torch.testing.assert_close(_real(name, p.grad, preset), want[name].grad, msg=name)
        assert torch.count_nonzero(_pads(name, p.grad, preset)) == 0, name


def test_pads_stay_zero_through_sgd_steps_with_dropout_and_clipping():
    preset = dataclasses.replace(MISALIGNED, dropout=0.5)
    torch.manual_seed(0)
    model = LanguageModel(VOCAB, preset).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=20.0)
    tokens, targets, state = _batch(torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(4):
        _, norm, state = step.sgd_step(model, model, optimizer, tokens, targets, state, clip=0.05)
        assert norm > 0.05  # the clip scaled the gradients
    for name, p in model.named_parameters():
        assert not torch.equal(p, before[name]), name  # it trained
        assert torch.count_nonzero(_pads(name, p)) == 0, name


def test_sgd_steps_follow_the_unpadded_model():
    plain, padded = _models(dtype=torch.float32)
    tokens, targets, state = _batch(torch.float32)
    for model in (plain, padded):
        optimizer = torch.optim.SGD(model.parameters(), lr=20.0)
        carried = state
        for _ in range(3):
            _, _, carried = step.sgd_step(model, model, optimizer, tokens, targets, carried,
                                          clip=0.25)  # fmt: skip
    want = dict(plain.named_parameters())
    for name, p in padded.named_parameters():
        torch.testing.assert_close(_real(name, p), want[name], msg=name)


def test_aligned_sizes_store_the_real_widths():
    preset = dataclasses.replace(MISALIGNED, embedding=16, hidden=24)
    model = LanguageModel(VOCAB, preset)
    plain = LanguageModel(VOCAB, preset, aligned_rows=False)
    assert model.real_widths == {}
    shapes = {n: t.shape for n, t in model.state_dict().items()}
    assert shapes == {n: t.shape for n, t in plain.state_dict().items()}
    assert model.decoder.in_features == 24


def test_parameter_count_counts_the_real_weights_only():
    for tie in (False, True):
        preset = dataclasses.replace(MISALIGNED, hidden=10) if tie else MISALIGNED
        plain, padded = _models(preset, tie_weights=tie)
        real = sum(p.numel() for p in plain.parameters())
        assert padded.parameter_count() == plain.parameter_count() == real
        assert sum(p.numel() for p in padded.parameters()) > real


def test_state_dicts_of_either_width_load_and_a_wrong_width_fails_clearly():
    plain, padded = _models()  # a real-width state_dict loaded (the checkpoints of before)
    for name, p in padded.named_parameters():
        torch.testing.assert_close(_real(name, p), dict(plain.named_parameters())[name])
    again = LanguageModel(VOCAB, MISALIGNED).double()
    again.load_state_dict(padded.state_dict())  # a checkpoint of the padded model
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), padded.parameters()))
    wrong = {**plain.state_dict(), "decoder.weight": torch.zeros(VOCAB, 12)}
    with pytest.raises(RuntimeError, match=r"decoder\.weight.*torch.Size\(\[37, 16\]\)"):
        again.load_state_dict(wrong)


def test_pytorch_example_weights_load_into_the_padded_model():
    """The word-lm bench copies PyTorch's word_language_model into ours."""
    from mirrorgrad.bench import word_lm

    torch.manual_seed(0)
    example = word_lm.ExampleLM(VOCAB, MISALIGNED).double().eval()
    ours = word_lm._to_train_model(example).eval()
    assert ours.encoder.weight.shape == (VOCAB, 16)
    tokens, targets, state = _batch()
    log_probs, _ = example(tokens, state)
    want = torch.nn.functional.nll_loss(log_probs, targets.reshape(-1))
    loss, _ = ours(tokens, targets, state)
    torch.testing.assert_close(loss, want)


def test_the_head_op_runs_the_stored_width_unpadded(monkeypatch):
    """Where padding would pay (a GPU), the head op pads 650 but not the stored 656."""
    monkeypatch.setattr(aligned_mm, "pays_to_pad", lambda *args: True)
    for width, pads in ((650, True), (stored_width(650), False)):
        hidden, weight = torch.empty(700, width), torch.empty(VOCAB, width)
        assert lce_op.forward_pads(hidden, weight) is pads
        assert lce_op.backward_pads(hidden, weight, True, True) is pads


def test_a_checkpoint_of_real_widths_resumes_into_the_padded_model(corpus, tmp_path, monkeypatch):
    """A `train lm` checkpoint written before rows were stored aligned restores."""
    from mirrorgrad.train import probes

    monkeypatch.setattr(probes, "explain_plan", lambda *args: None)
    narrow = dataclasses.replace(PRESETS["tiny"], embedding=20, hidden=20)  # stored 24 wide
    monkeypatch.setitem(config.PRESETS, "tiny", narrow)
    off = MirrorOptions.from_cli("off")
    cfg = config.TrainConfig.from_preset("tiny", data=corpus, batch_size=8, bptt=20, logdir=None,
                                         mirror=off)  # fmt: skip
    cpu = torch.device("cpu")
    setup, moved = set_up(cfg, World(), cpu, [])
    assert setup.model.encoder.weight.shape[1] == 24
    saved = progress.checkpoint_state(
        moved, model=setup.model, optimizer=setup.optimizer, scheduler=setup.scheduler,
        vocab=setup.data.vocab, config=cfg, world=setup.world,
    )  # fmt: skip
    saved["model"] = {n: _real(n, t, narrow) for n, t in saved["model"].items()}
    assert saved["model"]["encoder.weight"].shape[1] == 20
    checkpoint.save(saved, tmp_path / "last.pt")
    resumed, _ = set_up(dataclasses.replace(cfg, resume=tmp_path), World(), cpu, [])
    for a, b in zip(resumed.model.parameters(), setup.model.parameters(), strict=True):
        assert torch.equal(a, b)
