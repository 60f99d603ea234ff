"""late_gemm: Inductor's late addmm is split back where it would keep a large input alive."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code
from torch.fx.experimental.proxy_tensor import make_fx

import mirrorgrad
from mirrorgrad.mirror.late_gemm import split_late_addmms

aten = torch.ops.aten


def traced(fn, *shapes):
    gm = make_fx(fn, tracing_mode="fake")(*(torch.randn(s) for s in shapes))
    return gm


def tied_weight_gradient(logits, h, emb_grad):
    # The LM head's weight gradient, fused with the tied embedding's (produced last).
    dlogits = logits.exp()  # computed in the graph (an input may alias a parameter)
    other = torch.tanh(dlogits).sum(0)  # the big input's other reader
    late = torch.sigmoid(emb_grad) * 2  # what the embedding's gradient waits for
    return aten.addmm(late, dlogits.t(), h), other


def test_a_late_addmm_whose_big_input_dies_earlier_is_split_before_its_add():
    gm = traced(tied_weight_gradient, (64, 100), (64, 8), (100, 8))
    assert split_late_addmms(gm.graph) == 1
    nodes = list(gm.graph.nodes)
    mm = next(n for n in nodes if n.target is aten.mm.default)
    late = next(n for n in nodes if n.target is aten.sigmoid.default)
    add = next(n for n in nodes if n.target is aten.add.Tensor and mm in n.args)
    assert nodes.index(mm) < nodes.index(late) < nodes.index(add)  # the product runs early
    assert not [n for n in nodes if n.target is aten.addmm.default]
    gm.graph.lint()
    gm.recompile()
    args = [torch.randn(64, 100), torch.randn(64, 8), torch.randn(100, 8)]
    for got, want in zip(gm(*args), tied_weight_gradient(*args)):
        torch.testing.assert_close(got, want)


def test_an_addmm_whose_inputs_outlive_it_or_are_small_or_not_waiting_is_left_alone():
    def graph_inputs(x, w, b):  # a recomputed Linear: inputs of the graph free nothing
        return aten.addmm(torch.sigmoid(b), x, w.t())

    gm = traced(graph_inputs, (4, 8), (6, 8), (6,))
    assert split_late_addmms(gm.graph) == 0

    def outlived(x, w, b):  # the input is read again after the addmm
        y = x.exp()
        return aten.addmm(torch.sigmoid(b), y, w.t()) * y.sum()

    gm = traced(outlived, (40, 8), (6, 8), (6,))
    assert split_late_addmms(gm.graph) == 0

    def not_waiting(x, w, b):  # the added value exists before the product's input
        c = torch.sigmoid(b)
        return aten.addmm(c, x.exp(), w.t())

    gm = traced(not_waiting, (40, 8), (6, 8), (6,))
    assert split_late_addmms(gm.graph) == 0

    def small_input(a, b, c):  # the output is larger than the inputs it would free
        return aten.addmm(torch.sigmoid(c), a.exp(), b.exp())

    gm = traced(small_input, (64, 2), (2, 64), (64, 64))
    assert split_late_addmms(gm.graph) == 0


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 96, width: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))

    def forward(self, tokens, targets):
        logits = nn.functional.linear(self.mlp(self.tok(tokens)), self.tok.weight)
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _backward_code(compile_fn):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TiedLM()
    tokens = torch.randint(0, 96, (4, 33))
    compiled = compile_fn(model)
    _, codes = run_and_get_code(
        lambda: compiled(tokens[:, :-1], tokens[:, 1:]).backward()
    )
    grads = [p.grad.clone() for p in model.parameters()]
    torch._dynamo.reset()
    return codes[-1], grads


def _late_addmms(code: str) -> list[str]:
    """The backward's addmms that add a product to a buffer computed in the backward."""
    return re.findall(r"extern_kernels\.addmm\(buf\d+,[^\n]*", code)


@pytest.mark.slow
def test_the_tied_lm_heads_weight_gradient_runs_before_the_embeddings():
    # torch.compile fuses it into an addmm at the end of the backward, keeping the
    # logits gradient alive throughout (1,000 MiB on the suite's transformer).
    plain_code, plain = _backward_code(torch.compile)
    ours_code, ours = _backward_code(lambda m: mirrorgrad.compile(m, mode="off"))
    assert _late_addmms(plain_code), "Inductor no longer fuses the late addmm"
    assert not _late_addmms(ours_code)
    for a, b in zip(ours, plain):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
