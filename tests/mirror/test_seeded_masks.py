"""Dropout masks recomputed from their seeds (mirror/seeded_masks.py): under Inductor a
dropout draws ``inductor_random(shape, seed)``, and the plans recompute the draw and its
mask in the backward instead of stashing the mask, with the same mask."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import mirrorgrad
from mirrorgrad.bench.frontier import capture_joint
from mirrorgrad.bench.suites import get_workload
from mirrorgrad.mirror import PlanOptions, plan
from mirrorgrad.mirror.partition import MirrorgradFallbackWarning
from mirrorgrad.mirror.policy import is_seeded_random, policy_for

MODES = [
    pytest.param(PlanOptions(mode="balance"), id="balance"),
    pytest.param(PlanOptions(mode="budget", budget=0.5), id="budget0.5"),
]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class AttentionWithDropout(nn.Module):
    """A pre-LayerNorm attention block with attention and residual dropout, then a
    GELU MLP with dropout: on a CPU, SDPA's dropout is a separate draw of [B, H, L, L]."""

    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.fc = nn.Linear(width, width)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, D = x.shape
        q, k, v = self.qkv(self.norm(x)).view(B, L, 3, self.heads, D // self.heads).unbind(2)
        y = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            dropout_p=0.2 if self.training else 0.0, is_causal=True,
        )  # fmt: skip
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(B, L, D)))
        return x + self.drop(self.fc(nn.functional.gelu(x)))


def _step(model: nn.Module, x: torch.Tensor, seed: int):
    torch.manual_seed(seed)
    out = model(x)
    weights = torch.linspace(-1.0, 2.0, out.numel(), dtype=out.dtype).view_as(out)
    (out * weights).sum().backward()
    return out.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("options", MODES)
def test_recomputed_masks_give_torch_compiles_gradients(options):
    """Same RNG state, same masks: the plan's forward and gradients equal plain
    torch.compile's (min-cut, which recomputes dropout from the seed as well) to float64
    rounding; a mask drawn afresh in the backward would differ by O(1)."""
    torch.manual_seed(0)
    base = AttentionWithDropout().double()
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    reference = copy.deepcopy(base)
    expected = _step(torch.compile(reference), x, seed=7)
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    kwargs = {"mode": options.mode, **({"budget": options.budget} if options.budget else {})}
    compiled = mirrorgrad.compile(model, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MirrorgradFallbackWarning)
        out, grads = _step(compiled, x, seed=7)
    (p,) = compiled._mirrorgrad_plans
    draws = [n for n in p.mirrored if is_seeded_random(n)]
    assert len(draws) == 3, p.seeded_random  # attention's and both residual dropouts
    torch.testing.assert_close(out, expected[0], rtol=1e-12, atol=1e-12)
    for name, a, b in zip(dict(model.named_parameters()), grads, expected[1]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def _joint(name: str):
    """A bench workload at its quick size and batch 1, traced as Inductor hands it to
    the partitioner (dropout is then ``inductor_random``): the model and the graph."""
    if name == "gpt2":
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    built = get_workload(name).build(device="cpu", quick=True, batch=1)
    return built.model, capture_joint(built.model, *built.make_batch())


@pytest.mark.parametrize("options", MODES)
@pytest.mark.parametrize(("name", "count"), [("transformer", 5), ("gpt2", 7)])
def test_plans_recompute_the_dropout_masks_of_transformers(name, count, options):
    """Parameters hold these graphs' peaks, so no recomputation lowers them, and both
    modes used to stash every mask (each block's forward kernel then baked its seed
    index in as a constant: no two blocks shared a kernel)."""
    _, joint = _joint(name)
    draws = [n for n in joint.forward if is_seeded_random(n)]
    masks = {u for d in draws for u in d.users}  # gt(draw, p): the boolean mask
    # the embedding's, then per block the residual dropouts (and GPT-2's attention's)
    assert len(draws) == count
    p = plan(joint, options)
    assert set(draws) <= set(p.mirrored)
    assert not masks & set(p.saved)
    assert p.peak_after <= p.peak_before
    assert p.seeded_random.startswith(f"{count} of {count} seeded random draws")
    assert f"dropout masks:  {count} of {count}" in str(p)


def test_masks_stay_stashed_where_mirroring_is_forbidden():
    model, joint = _joint("transformer")
    mirrorgrad.mark(model.blocks[0], mirror=False)
    p = plan(joint, PlanOptions(mode="balance", policy=policy_for(model)))
    draws = [n for n in joint.forward if is_seeded_random(n)]
    assert sum(d in set(p.mirrored) for d in draws) == 3  # block 0's two are kept
    assert "3 of 5" in p.seeded_random
    assert "2 stashed because mirroring is forbidden" in p.seeded_random
