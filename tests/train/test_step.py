"""The training step: the whole-step CUDA Graph and its eager twin, and bf16 autocast."""

import dataclasses

import pytest
import torch

from mirrorgrad.options import MirrorOptions
from mirrorgrad.train import step
from mirrorgrad.train.config import PRESETS, TrainConfig
from mirrorgrad.train.loop import train
from mirrorgrad.train.model import LanguageModel

SMALL = dataclasses.replace(PRESETS["tiny"], embedding=24, hidden=32, layers=2, dropout=0.3)
VOCAB, T, B = 50, 6, 4


def _model_and_batches(device, precision="fp32", steps=4):
    torch.manual_seed(0)
    model = LanguageModel(VOCAB, SMALL, precision=precision).to(device)
    batches = [
        (torch.randint(0, VOCAB, (T, B), device=device),
         torch.randint(0, VOCAB, (T, B), device=device))
        for _ in range(steps)
    ]  # fmt: skip
    return model, batches


def _run(run_step, model, optimizer, batches, lrs):
    """Steps with the lr changed before each one (a scheduler's change must reach it)."""
    state = model.initial_state(B, batches[0][0].device)
    losses, norms = [], []
    for (x, y), lr in zip(batches, lrs):
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss, norm, state = run_step(x, y, state)
        losses.append(loss.clone())
        norms.append(norm.clone())
    return torch.stack(losses), torch.stack(norms), [p.detach().clone() for p in model.parameters()]


def _sgd_run(device):
    model, batches = _model_and_batches(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    torch.manual_seed(0)

    def run_step(x, y, state):
        return step.sgd_step(model, model, optimizer, x, y, state, clip=0.25)

    return _run(run_step, model, optimizer, batches, [1.0, 0.5, 0.5, 2.0])


def test_evaluation_makes_the_logits_in_small_chunks(monkeypatch):
    """Outside training the decoder's logits come in chunks of at most 4 MiB (the final
    evaluation runs beside the held step graph); training keeps the op's default. The
    loss is the same either way."""
    from mirrorgrad.train import model as model_module

    seen, real = [], model_module.linear_cross_entropy
    monkeypatch.setattr(model_module, "EVAL_LOGITS_BYTES", 4 * 50 * 7)  # 7 rows of vocab 50
    monkeypatch.setattr(model_module, "linear_cross_entropy",
                        lambda *args, chunk_size=None: seen.append(chunk_size) or real(
                            *args, chunk_size=chunk_size))  # fmt: skip
    torch.manual_seed(0)
    model = LanguageModel(50, dataclasses.replace(SMALL, dropout=0.0))
    tokens = torch.randint(0, 50, (5, 4))
    state = model.initial_state(4, "cpu")
    trained, _ = model(tokens, tokens.roll(-1, 0), state)
    model.eval()
    evaluated, _ = model(tokens, tokens.roll(-1, 0), state)
    assert seen == [None, 7]
    torch.testing.assert_close(evaluated, trained)


def test_eager_whole_step_equals_optimizer_step():
    """GraphedStep(capture=False) is the arithmetic the graph replays: the same losses,
    norms and weights as forward + backward + clip_grad_norm_ + torch.optim.SGD."""
    expected = _sgd_run("cpu")
    model, batches = _model_and_batches("cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    torch.manual_seed(0)
    graphed = step.GraphedStep(model, optimizer, clip=0.25, capture=False)
    got = _run(graphed, model, optimizer, batches, [1.0, 0.5, 0.5, 2.0])
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-6, atol=1e-6)
    for p, q in zip(got[2], expected[2]):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda ps: torch.optim.Adam(ps), "Adam is not plain"),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "momentum"),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=1e-4), "weight_decay"),
    ],
)
def test_whole_step_refuses_an_optimizer_it_would_not_run(make, reason):
    model, _ = _model_and_batches("cpu")
    with pytest.raises(ValueError, match=reason):
        step.GraphedStep(model, make(model.parameters()), clip=0.25)


def test_bf16_forward_keeps_float32_weights_loss_and_state():
    model, [(x, y), *_] = _model_and_batches("cpu", "bf16", steps=1)
    state = model.initial_state(B, "cpu")
    seen = []
    model.rnn.register_forward_hook(lambda m, i, o: seen.append(o[0].dtype))
    loss, (h, c) = model(x, y, state)
    loss.backward()
    assert seen == [torch.bfloat16]  # the LSTM ran in bf16
    assert loss.dtype == h.dtype == c.dtype == torch.float32
    assert all(p.dtype == p.grad.dtype == torch.float32 for p in model.parameters())
    with pytest.raises(ValueError, match="fp32, bf16"):
        LanguageModel(VOCAB, SMALL, precision="fp16")


def test_bf16_training_is_close_to_fp32_and_reported(corpus, tmp_path):
    def config(precision):
        return TrainConfig.from_preset(
            "tiny", data=corpus, batch_size=8, bptt=20, epochs=1, max_steps=6, seed=3,
            logdir=tmp_path / precision, mirror=MirrorOptions.from_cli("balance"),
            precision=precision,
        )  # fmt: skip

    fp32, bf16 = train(config("fp32")), train(config("bf16"))
    assert bf16.precision == "bf16" and "bf16" in str(bf16)
    assert abs(bf16.valid_perplexity / fp32.valid_perplexity - 1) < 0.02
    with pytest.raises(ValueError, match="--precision 'fp16'"):
        dataclasses.replace(config("fp32"), precision="fp16")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA Graphs need a GPU")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_whole_step_graph_replays_the_eager_step(precision):
    """Captured and replayed, the step gives what it gives step by step (the dropout
    masks too: the graph draws them from the same generator state). Both runs choose
    impl="auto" as captured, so both run the same kernels (in bf16 two implementations
    round apart)."""
    import mirrorgrad
    from mirrorgrad.nn import dispatch_as_captured

    results = []
    for capture in (False, True):
        model, batches = _model_and_batches("cuda", precision)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        compiled = mirrorgrad.compile(model, backend="inductor")
        torch.manual_seed(0)
        with dispatch_as_captured():
            graphed = step.GraphedStep(compiled, optimizer, clip=0.25, capture=capture)
            results.append(_run(graphed, model, optimizer, batches, [1.0, 0.5, 0.5, 2.0]))
        assert (graphed.graph is not None) == capture
    (loss0, norm0, w0), (loss1, norm1, w1) = results
    torch.testing.assert_close(loss1, loss0, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(norm1, norm0, rtol=1e-3, atol=1e-4)
    for p, q in zip(w1, w0):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)
