"""``explain`` plans the graph ``compile`` plans: the joint graph Inductor partitions,
with no code generated and no activation kept."""

import torch
from torch import nn

import mirrorgrad
from mirrorgrad.bench.frontier import capture_joint
from mirrorgrad.compiler import MirrorBackend
from mirrorgrad.mirror import PlanOptions, plan
from mirrorgrad.options import MirrorOptions


def _values(nodes) -> list[tuple[str, str]]:
    """Each value's op and shape, sorted."""
    return sorted((str(n.target), str(getattr(n.meta.get("val"), "shape", ""))) for n in nodes)


def test_explain_plans_the_graph_inductor_partitions():
    """Inductor's decompositions: dropout is a seeded draw, layer norm and GELU pointwise
    ops, as ``compile`` plans them (AOTAutograd's own graph stashes dropout's mask and
    layer norm's statistics: 35% over the device's peak on a 12-layer Transformer)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1), nn.LayerNorm(256), nn.Linear(256, 8)
    )
    x = torch.randn(512, 64)
    explained = mirrorgrad.explain(model, x, mode="balance")
    captured = plan(capture_joint(model, x), PlanOptions(mode="balance"), warn=False)
    ops = {str(n.target) for n in explained.saved + explained.mirrored}
    assert not ops & {"aten.native_dropout.default", "aten.native_layer_norm.default"}
    # the same values (names of primals follow Dynamo's order of lifting, not the plan)
    assert _values(explained.saved) == _values(captured.saved)
    assert _values(explained.mirrored) == _values(captured.mirrored)
    assert explained.peak_before == captured.peak_before
    assert explained.peak_after == captured.peak_after
    # compile's own plan of that step is explain's
    step = mirrorgrad.compile(model, mode="balance")
    step(x).sum().backward()
    (compiled,) = step._mirrorgrad_plans
    assert compiled.peak_before == explained.peak_before
    assert compiled.peak_after == explained.peak_after
    assert compiled.balance_target is None and explained.balance_target is not None


class _BrokenBlock(nn.Module):
    """A Linear, a graph break, then a tail without parameters: its graph has a backward
    only if the first graph's output requires grad."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 256)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.linear(x))
        torch._dynamo.graph_break()
        return torch.tanh(h).square().mean()


def test_each_graph_after_a_break_is_planned_and_no_activation_is_kept():
    torch.manual_seed(0)
    model, x = _BrokenBlock(), torch.randn(512, 64)
    backend = MirrorBackend(options=MirrorOptions(mode="off"), strict=True, plan_only=True)
    out = torch.compile(model, backend=backend)(x)
    assert len(backend.plans) == 2  # the tail's graph too: its input requires grad
    # run under no_grad: a leaf, no autograd graph holding the forward's activations
    assert out.requires_grad and out.grad_fn is None


def test_a_second_explain_at_other_sizes_plans_those_sizes():
    """Every explain's frame shares Dynamo's record of the shapes seen: without static
    shapes the second would plan symbolic sizes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8))
    mirrorgrad.explain(model, torch.randn(128, 64))
    second = mirrorgrad.explain(model, torch.randn(512, 64))
    torch._dynamo.reset()
    fresh = mirrorgrad.explain(model, torch.randn(512, 64))
    assert _values(second.saved) == _values(fresh.saved)
    assert not second.saved_sym
    assert (second.peak_before, second.peak_after) == (fresh.peak_before, fresh.peak_after)
