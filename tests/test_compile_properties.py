"""Property: random small graphs of supported ops get eager's gradients, no fallback."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.zoo import loss_of
from torch import nn

import mirrorgrad
from mirrorgrad.mirror.partition import MirrorgradFallbackWarning

D = 6
UNARY = ("tanh", "sigmoid", "gelu", "relu", "exp", "layer_norm", "softmax", "dropout")
BINARY = ("add", "mul", "cat_linear", "sum_broadcast", "view_mix")
WITH_PARAMS = {"linear": D, "cat_linear": 2 * D, "layer_norm": None}
OPS = (*UNARY, *BINARY, "linear")


def apply(op: str, a: torch.Tensor, b: torch.Tensor, module: nn.Module) -> torch.Tensor:
    if op in ("tanh", "sigmoid", "relu"):
        return getattr(torch, op)(a)
    if op == "gelu":
        return nn.functional.gelu(a)
    if op == "exp":
        return (0.3 * a).exp()
    if op == "softmax":
        return torch.softmax(a, dim=-1)
    if op == "dropout":
        return nn.functional.dropout(a, p=0.4, training=True)
    if op == "add":
        return a + b
    if op == "mul":
        return a * b
    if op == "sum_broadcast":
        return a - b.sum(dim=-1, keepdim=True) / D
    if op == "view_mix":
        # A reshape round trip with a transpose in between: views and copies.
        return a.reshape(-1, 2, D // 2).transpose(1, 2).reshape(a.shape) + b
    if op == "cat_linear":
        return module(torch.cat([a, b], dim=-1))
    return module(a)  # linear, layer_norm


class RandomProgram(nn.Module):
    """Each step applies an op to earlier values; every value feeds the output."""

    def __init__(self, program: tuple[tuple[str, int, int], ...]) -> None:
        super().__init__()
        self.program = program
        self.layers = nn.ModuleDict()
        for k, (op, _, _) in enumerate(program):
            if op == "layer_norm":
                self.layers[str(k)] = nn.LayerNorm(D)
            elif op in WITH_PARAMS:
                self.layers[str(k)] = nn.Linear(WITH_PARAMS[op], D)
            else:
                self.layers[str(k)] = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values = [x]
        for k, (op, i, j) in enumerate(self.program):
            a, b = values[i % len(values)], values[j % len(values)]
            values.append(apply(op, a, b, self.layers[str(k)]))
        out = values[-1]
        for v in values[1:-1]:
            out = out + v.mean(dim=0)  # reads v in the forward only
        return out


programs = st.lists(
    st.tuples(st.sampled_from(OPS), st.integers(0, 15), st.integers(0, 15)), min_size=3, max_size=8
).map(tuple)
# Hypothesis favours the first choices: the mirroring modes come first.
options = st.sampled_from(
    [
        {"mode": "budget", "budget": 0.3},
        {"mode": "balance"},
        {"mode": "budget", "budget": 0.6},
        {"mode": "off"},
    ]
)


# derandomize: CI sees the same examples every run (a failure reproduces).
@pytest.mark.slow
@settings(
    max_examples=16,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(program=programs, options=options)
def test_random_graphs_get_eager_gradients(program, options):
    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = RandomProgram(program).double()
    model = copy.deepcopy(reference)
    x = torch.randn(32, D, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    compiled = mirrorgrad.compile(model, backend="eager", **options)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MirrorgradFallbackWarning)
        torch.manual_seed(1)
        out = compiled(x)
        loss_of(out).backward()
    torch.manual_seed(1)
    expected = reference(x_ref)
    loss_of(expected).backward()
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-9, atol=1e-12)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=name)
    assert len(compiled._mirrorgrad_plans) == 1
