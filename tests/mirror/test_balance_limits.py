"""Balance's plan says what holds it above 0.8x the unmirrored peak or +3% time."""

import functools
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import mirrorgrad
from mirrorgrad.mirror import PlanOptions, plan
from mirrorgrad.mirror.balance import GOAL_OVERHEAD, GOAL_PEAK

sys.path.insert(0, str(Path(__file__).parent))
from joint_graphs import Bottleneck, LayerNormGeluLinear, joint_of


def _balance(joint, **options):
    return plan(joint, PlanOptions(mode="balance", **options), warn=False)


@functools.cache
def _layernorm_gelu():
    torch.manual_seed(0)
    blocks = nn.Sequential(*(LayerNormGeluLinear(512, 512) for _ in range(3)))
    return joint_of(blocks, torch.randn(512, 512), decompose=True)


@functools.cache
def _wide_linears():
    """Weights of 4 MiB against activations of 16 KiB."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))
    return joint_of(model, torch.randn(4, 1024), decompose=True)


class _LMHead(nn.Module):
    """A vocabulary of 4,096 on 1,024 tokens: the logits' gradient is the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.norm, self.head = (
            nn.Embedding(4096, 64),
            nn.LayerNorm(64),
            nn.Linear(64, 4096),
        )

    def forward(self, tokens):
        logits = self.head(torch.relu(self.norm(self.embed(tokens))))
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())


@functools.cache
def _lm_head():
    torch.manual_seed(0)
    return joint_of(_LMHead(), torch.randint(0, 4096, (4, 256)), decompose=True)


@functools.cache
def _bottlenecks():
    torch.manual_seed(0)
    blocks = nn.Sequential(*(Bottleneck(16, 4) for _ in range(6)))
    return joint_of(blocks, torch.randn(8, 16, 16, 16), decompose=True)


@pytest.mark.parametrize("build", [_layernorm_gelu, _wide_linears, _lm_head, _bottlenecks])
@pytest.mark.parametrize("max_overhead", [0.001, 0.03, 0.2])
def test_a_plan_short_of_the_goal_says_why_and_only_such_a_plan(build, max_overhead):
    p = _balance(build(), max_overhead=max_overhead)
    short = (
        p.peak_after > GOAL_PEAK * p.peak_before or p.added_time_s > GOAL_OVERHEAD * p.step_time_s
    )
    assert bool(p.limits) == short
    assert all(f"held up by:     {why}" in str(p) for why in p.limits)
    assert p.to_dict()["limits"] == p.limits


def test_the_time_cap_is_named_with_the_next_lower_peak():
    p = _balance(_layernorm_gelu(), max_overhead=0.001)
    (why,) = [w for w in p.limits if w.startswith("the next lower peak")]
    lower, cost = (float(s) for s in _numbers(why)[:2])
    assert lower < p.peak_after / p.peak_before
    assert cost > 0.1  # percent of the step, over the cap of 0.1%
    assert "over max_overhead 0.1%" in why


def test_parameters_and_gradients_are_named_where_they_hold_the_peak():
    p = _balance(_wide_linears())
    assert "parameters and gradients are 100% of the peak" in p.limits
    assert any(w.startswith("the peak (backward") and "no stash changes" in w for w in p.limits)


def test_one_value_no_stash_changes_is_named():
    p = _balance(_lm_head())
    (why,) = [w for w in p.limits if w.startswith("one value is")]
    share = int(_numbers(why)[0]) / 100
    assert share >= 0.5 and "backward temporaries" in why and "no stash changes it" in why
    assert not any(w.startswith("parameters and gradients") for w in p.limits)


def test_a_cap_over_the_goal_says_what_the_goal_would_reach():
    p = _balance(_layernorm_gelu(), max_overhead=0.5)
    assert p.added_time_s > GOAL_OVERHEAD * p.step_time_s
    (why,) = [w for w in p.limits if w.startswith("the time is")]
    within, this = (float(x) for x in _numbers(why)[-2:])
    assert this == pytest.approx(p.peak_after / p.peak_before, abs=1e-3)
    assert within > this  # the goal's time reaches less


def test_explain_prints_the_reason():
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    p = mirrorgrad.explain(model, torch.randn(2, 256), mode="balance", backend="eager")
    assert "held up by:     parameters and gradients" in str(p)


def _numbers(text: str) -> list[str]:
    return re.findall(r"\d+(?:\.\d+)?", text)
