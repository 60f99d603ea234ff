"""The LM-head loss rewrite (mirror/fused_loss.py): which graphs it fuses, and that a
fused step's loss and gradients are the unfused step's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrorgrad
from mirrorgrad.bench.workloads import WORKLOADS
from mirrorgrad.mirror import fused_loss
from mirrorgrad.mirror.fused_loss import FusedLoss
from mirrorgrad.ops.linear_cross_entropy import op as lce_op

IGNORE = -100


def _step(fn, *inputs, params):
    """(loss, the gradient of every parameter) of one step of ``fn``."""
    for p in params:
        p.grad = None
    loss = fn(*inputs)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in params]


def _compiled_step(fn, *inputs, params, **options):
    """(loss, gradients, the compiled graph's fused_losses) through mirrorgrad.compile."""
    torch._dynamo.reset()
    compiled = mirrorgrad.compile(fn, backend="eager", fullgraph=True, **options)
    loss, grads = _step(compiled, *inputs, params=params)
    (plan,) = compiled._mirrorgrad_plans
    return loss, grads, plan.fused_losses


def _assert_same_step(fn, *inputs, params, rtol=1e-10, atol=1e-12, fuse_loss=True):
    """The fused step equals the eager one; returns the compiled graph's fused_losses."""
    loss, grads = _step(fn, *inputs, params=params)
    fused_l, fused_g, found = _compiled_step(fn, *inputs, params=params, fuse_loss=fuse_loss)
    torch.testing.assert_close(fused_l, loss, rtol=rtol, atol=atol)
    for g, ref in zip(fused_g, grads):
        torch.testing.assert_close(g, ref, rtol=rtol, atol=atol)
    return found


def _targets(shape, vocab, ignored_rows):
    target = torch.randint(0, vocab, shape)
    target.view(-1)[ignored_rows] = IGNORE
    return target


class Head(nn.Module):
    """An ``nn.Linear`` LM head whose logits go into ``F.cross_entropy``."""

    def __init__(self, hidden=6, vocab=11, bias=True, reduction="mean", form="module"):
        super().__init__()
        self.body = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab, bias=bias)
        self.reduction, self.form = reduction, form

    def logits(self, x):
        h = torch.tanh(self.body(x))
        if self.form == "matmul":  # x @ w.t() (+ b)
            out = h @ self.head.weight.t()
            return out if self.head.bias is None else out + self.head.bias
        return self.head(h)

    def forward(self, x, target):
        logits = self.logits(x)
        if self.form == "shift":  # logits[..., :-1, :] against the next tokens
            logits, target = logits[..., :-1, :].contiguous(), target[..., 1:]
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            target.reshape(-1),
            reduction=self.reduction,
        )


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("form", ["module", "shift"])
def test_linear_cross_entropy_model_fused_step_equals_eager_float64(reduction, bias, form):
    torch.manual_seed(0)
    model = Head(bias=bias, reduction=reduction, form=form).double()
    x = torch.randn(3, 5, 6, dtype=torch.float64)
    target = _targets((3, 5), 11, ignored_rows=[2, 7, 8])
    found = _assert_same_step(model, x, target, params=list(model.parameters()))
    rows = 3 * 4 if form == "shift" else 3 * 5
    assert found == [FusedLoss(rows=rows, vocab=11, fused=True)]


def test_matmul_with_a_transposed_weight_is_fused():
    torch.manual_seed(0)
    model = Head(bias=False, form="matmul").double()
    x = torch.randn(4, 6, dtype=torch.float64)
    target = _targets((4,), 11, ignored_rows=[1])
    found = _assert_same_step(model, x, target, params=list(model.parameters()))
    assert [f.fused for f in found] == [True]


def test_cross_entropy_loss_module_with_its_ignore_index_is_fused():
    torch.manual_seed(0)
    model = Head(bias=True).double()
    criterion = nn.CrossEntropyLoss(ignore_index=3, reduction="sum")

    def loss(x, target):
        return criterion(model.logits(x), target)

    x = torch.randn(6, 6, dtype=torch.float64)
    target = torch.tensor([3, 1, 3, 10, 0, 3])
    found = _assert_same_step(loss, x, target, params=list(model.parameters()))
    assert [f.fused for f in found] == [True]


def _tiny_gpt2(vocab=40, positions=8, layers=1):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_embd=16, n_layer=layers, n_head=2, vocab_size=vocab, n_positions=positions,
        bos_token_id=0, eos_token_id=0, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # named: otherwise a warning (a graph break)
    return model


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gpt2_with_padded_labels_fused_step_equals_eager(reduction):
    """transformers' ForCausalLMLoss: logits.float(), labels shifted with -100 padding;
    "sum" and a division when num_items_in_batch is given, else "mean". The float64
    model's loss runs in float32 (``.float()`` downcasts), ours in float64 and then cast:
    so the two agree to float32's precision."""
    model = _tiny_gpt2().double()
    ids = torch.randint(0, 40, (2, 8))
    labels = ids.clone()
    labels[0, 5:] = IGNORE  # padding
    extra = {"num_items_in_batch": torch.tensor(9)} if reduction == "sum" else {}

    def loss(ids, labels):
        return model(input_ids=ids, labels=labels, **extra).loss

    found = _assert_same_step(
        loss, ids, labels, params=list(model.parameters()), rtol=2e-6, atol=1e-7
    )
    assert found == [FusedLoss(rows=16, vocab=40, fused=True)]


def test_bench_transformer_workload_fused_step_equals_eager_float64():
    built = WORKLOADS["transformer"].build(quick=True, dtype=torch.float64)
    model = built.model.eval()  # dropout off: the same step twice
    found = _assert_same_step(model, *built.make_batch(), params=list(model.parameters()))
    assert [f.fused for f in found] == [True]


class ReturnsLogits(Head):
    def forward(self, x, target):
        logits = self.logits(x)
        return F.cross_entropy(logits, target), logits


def test_logits_returned_to_the_caller_are_not_fused():
    model = ReturnsLogits().double()
    x, target = torch.randn(4, 6, dtype=torch.float64), torch.randint(0, 11, (4,))
    torch._dynamo.reset()
    compiled = mirrorgrad.compile(model, backend="eager", fuse_loss=True)
    loss, logits = compiled(x, target)
    loss.backward()
    torch.testing.assert_close(logits, model.logits(x))
    (found,) = compiled._mirrorgrad_plans[0].fused_losses
    assert not found.fused and "another user" in found.reason
    assert "not fused (the logits have another user" in str(compiled._mirrorgrad_plans[0])


def test_gpt2_model_output_with_logits_is_not_fused():
    """The model itself returns CausalLMOutput(loss, logits): the logits are an output."""
    model = _tiny_gpt2()
    ids = torch.randint(0, 40, (2, 8))
    torch._dynamo.reset()
    compiled = mirrorgrad.compile(model, backend="eager", fuse_loss=True)
    compiled(input_ids=ids, labels=ids).loss.backward()
    found = [f for p in compiled._mirrorgrad_plans for f in p.fused_losses]
    assert found and not any(f.fused for f in found)


class Smoothed(Head):
    def forward(self, x, target):
        return F.cross_entropy(self.logits(x), target, label_smoothing=0.1)


def test_label_smoothing_is_left_alone_and_still_correct():
    model = Smoothed().double()
    x, target = torch.randn(4, 6, dtype=torch.float64), torch.randint(0, 11, (4,))
    found = _assert_same_step(model, x, target, params=list(model.parameters()))
    assert [(f.fused, f.reason) for f in found] == [(False, "label smoothing")]


def test_fuse_loss_left_unset_never_fuses_and_says_how_to():
    """The fused op trades time for memory (GPT-2 at budget 0.5 on an H100: 0.76x the
    peak at 1.30x the step), so only ``fuse_loss=True`` asks for it, in any mode."""
    vocab = 4096
    torch.manual_seed(0)
    model = Head(hidden=4, vocab=vocab)
    x, target = torch.randn(8192, 4), torch.randint(0, vocab, (8192,))  # 128 MiB of logits
    params = list(model.parameters())
    for mode in ("budget", "balance", "off"):
        budget = {"budget": 0.5} if mode == "budget" else {}
        _, _, found = _compiled_step(model, x, target, params=params, mode=mode, **budget)
        assert [(f.fused, f.reason) for f in found] == [(False, "fuse_loss=True fuses it")]
        _, _, found = _compiled_step(model, x, target, params=params, mode=mode,
                                     fuse_loss=True, **budget)  # fmt: skip
        assert [f.fused for f in found] == [True], mode


def test_gpt2_estimated_peak_drops_by_about_the_logits(monkeypatch):
    """explain()'s estimated peak with and without the rewrite, where the logits matter:
    1024 tokens x 32768 words, 128 MiB of float32 logits beside a 16-wide model; the fused
    op's passes over the logits torch's on any machine (the Triton ones hold one [C, V]
    temporary fewer: a larger drop)."""
    monkeypatch.setattr(lce_op, "TRITON_PASSES", ())
    model = _tiny_gpt2(vocab=32768, positions=512)
    ids = torch.randint(0, 32768, (2, 512))

    def loss(ids):
        return model(input_ids=ids, labels=ids).loss

    plans = {}
    for fuse in (False, True):
        torch._dynamo.reset()
        plans[fuse] = mirrorgrad.explain(loss, ids, mode="off", backend="eager", fuse_loss=fuse)
    logits = 1024 * 32768 * 4
    drop = plans[False].peak_before - plans[True].peak_before
    # Unfused, the backward holds the log-softmax (saved) and the logits' gradient at once.
    assert 1.8 * logits <= drop <= 2.2 * logits, (drop, logits)
    assert "logits [1,024, 32,768] and their gradient never stored (128 MiB each)" in str(
        plans[True]
    )


@pytest.mark.parametrize(
    ("index", "ndim", "row_wise"),
    [
        ((Ellipsis, slice(None, -1), slice(None)), 3, True),
        ((slice(None), slice(1, None)), 3, True),
        ((slice(None), slice(None, -1), slice(None)), 3, True),
        (0, 3, True),
        ((Ellipsis, slice(None, 5)), 3, False),  # cuts the vocabulary
        ((slice(None), slice(None), 0), 3, False),
        ((None, Ellipsis), 3, False),  # a new dim
        (True, 2, False),
    ],
)
def test_only_slices_of_the_leading_dims_are_row_wise(index, ndim, row_wise):
    assert fused_loss._index_keeps_last_dim(index, ndim) is row_wise


def test_fuse_loss_option_is_validated():
    with pytest.raises(ValueError, match="fuse_loss=1"):
        mirrorgrad.MirrorOptions(fuse_loss=1)
