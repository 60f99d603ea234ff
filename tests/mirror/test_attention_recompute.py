"""Attention kernels without dropout are deterministic: budget mode may recompute them
(as min-cut does), with eager's gradients; with dropout they are never recomputed."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import mirrorgrad
from mirrorgrad.mirror.partition import MirrorgradFallbackWarning
from mirrorgrad.mirror.policy import MirrorPolicy, is_random

aten = torch.ops.aten


def _attention_node(**kwargs) -> fx.Node:
    g = fx.Graph()
    q, k, v = (g.placeholder(name) for name in "qkv")
    return g.call_function(aten._scaled_dot_product_flash_attention.default, (q, k, v), kwargs)


@pytest.mark.parametrize(
    ("kwargs", "drawn"),
    [({}, False), ({"dropout_p": 0.0}, False), ({"dropout_p": 0.1}, True)],
    ids=["default", "p=0", "p=0.1"],
)
def test_attention_draws_only_with_dropout(kwargs, drawn):
    node = _attention_node(**kwargs)
    policy = MirrorPolicy(enabled=True)
    assert is_random(node) is drawn
    assert policy.may_mirror_heavy(node) is not drawn
    assert not policy.may_mirror(node)  # a heavy op: not among the cheap ones


class _Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, D = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, D // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
        )  # fmt: skip
        return x + torch.tanh(self.proj(y.transpose(1, 2).reshape(B, L, D)))


def _attention_ops(plan) -> list[str]:
    return [n.name for n in plan.mirrored if "attention" in str(n.target)]


@pytest.mark.slow
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_budget_mode_recomputes_attention_with_eagers_gradients(dropout):
    torch.manual_seed(0)
    reference = nn.Sequential(*(_Block(16, 2, dropout) for _ in range(4))).double()
    model = copy.deepcopy(reference)
    compiled = mirrorgrad.compile(model, mode="budget", budget=0.05, backend="eager")
    x = torch.randn(2, 64, 16, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mirrorgrad.MirrorgradBudgetWarning)
        warnings.simplefilter("error", MirrorgradFallbackWarning)
        torch.manual_seed(1)
        compiled(x).square().sum().backward()
    torch.manual_seed(1)
    reference(x).square().sum().backward()
    (plan,) = compiled._mirrorgrad_plans
    if dropout:
        assert not _attention_ops(plan)  # its mask is drawn inside the kernel
        return  # eager draws other masks than the compiled graph: no comparison
    assert _attention_ops(plan)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)
