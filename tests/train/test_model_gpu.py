"""On a GPU: the medium LM with its rows stored 656 wide computes what the 650-wide one does."""

import dataclasses

import pytest
import torch

from mirrorgrad.train import step
from mirrorgrad.train.config import PRESETS
from mirrorgrad.train.model import LanguageModel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VOCAB, T, B = 10_000, 35, 20
# Relative error of a gradient (Frobenius) between the two layouts: the padded products
# run other cuBLAS kernels, which round TF32 and bf16 products in another order.
GRAD_TOLERANCE = {"fp32": 1e-2, "bf16": 5e-2}


@pytest.fixture(autouse=True)
def tf32():
    """TF32 on, as `mirrorgrad train lm` runs."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    yield
    torch.set_float32_matmul_precision(before)


def _batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (T + 1, B), generator=g).cuda()
    return tokens[:-1], tokens[1:]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_padded_medium_model_equals_the_unpadded_one(precision):
    preset = dataclasses.replace(PRESETS["medium"], dropout=0.0)
    torch.manual_seed(0)
    plain = LanguageModel(VOCAB, preset, precision=precision, aligned_rows=False).cuda()
    padded = LanguageModel(VOCAB, preset, precision=precision).cuda()
    padded.load_state_dict(plain.state_dict())
    assert padded.encoder.weight.shape == (VOCAB, 656)
    tokens, targets = _batch()
    results = []
    for model in (plain, padded):
        loss, _ = model(tokens, targets, model.initial_state(B, "cuda"))
        loss.backward()
        results.append((loss.detach(), dict(model.named_parameters())))
    (loss, want), (loss_p, got) = results
    torch.testing.assert_close(loss_p, loss, rtol=1e-3 if precision == "fp32" else 1e-2, atol=0)
    for name, p in got.items():
        width = padded.real_widths.get(name, p.shape[-1])
        real, pads = p.grad[..., :width], p.grad[..., width:]
        error = (real - want[name].grad).norm() / want[name].grad.norm()
        assert error < GRAD_TOLERANCE[precision], (name, error.item())
        assert torch.count_nonzero(pads) == 0, name


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_pads_stay_zero_through_training_steps(precision):
    torch.manual_seed(0)
    model = LanguageModel(VOCAB, PRESETS["medium"], precision=precision).cuda()  # dropout 0.5
    optimizer = torch.optim.SGD(model.parameters(), lr=20.0)
    tokens, targets = _batch()
    state = model.initial_state(B, "cuda")
    for _ in range(3):
        _, _, state = step.sgd_step(model, model, optimizer, tokens, targets, state, clip=0.25)
    params = dict(model.named_parameters())
    for name, width in model.real_widths.items():
        assert torch.count_nonzero(params[name][:, width:]) == 0, name
