"""partition(): a plan becomes forward and backward modules; failures fall back."""

from __future__ import annotations

import copy
import dataclasses
import functools
import pickle
import warnings

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from mirrorgrad import _compat
from mirrorgrad.mirror import PlanOptions
from mirrorgrad.mirror import partition as partition_module
from mirrorgrad.mirror import planner as planner_module
from mirrorgrad.mirror.partition import (
    MirrorgradFallbackWarning,
    MirrorPartitioner,
    PartitionerKey,
    one_per_storage,
    partition,
)
from mirrorgrad.mirror.policy import is_random, mark, policy_for


def chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A matmul whose input comes through a chain of cheap ops, then a dropout."""
    h = torch.sigmoid(torch.tanh(x) * 2.0 + 1.0) @ w
    return nn.functional.dropout(torch.relu(h), p=0.5, training=True)


def run(partition_fn, seed: int = 0):
    """Forward+backward of `chain` through AOTAutograd with `partition_fn`."""
    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            return _compat.boxed_nop(gm, example_inputs)

        return compiler

    torch.manual_seed(0)
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    compiled = _compat.aot_function(
        chain, fw_compiler=keep("fw"), bw_compiler=keep("bw"), partition_fn=partition_fn
    )
    torch.manual_seed(seed)
    out = compiled(x, w)
    grads = torch.autograd.grad((out * out.detach().cos()).sum(), (x, w))
    return out.detach(), grads, graphs


def eager_reference(seed: int = 0):
    torch.manual_seed(0)
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(seed)
    out = chain(x, w)
    return out.detach(), torch.autograd.grad((out * out.detach().cos()).sum(), (x, w))


def ours(**options):
    plans = []
    fn = functools.partial(partition, options=PlanOptions(**options), on_plan=plans.append)
    return fn, plans


@pytest.mark.parametrize(
    "options", [{"mode": "off"}, {"mode": "balance"}, {"mode": "budget", "budget": 0.3}]
)
def test_partition_gives_eager_results(options):
    fn, plans = ours(**options)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MirrorgradFallbackWarning)
        out, grads, graphs = run(fn)
    ref_out, ref_grads = eager_reference()
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
    (plan,) = plans
    # The forward returns its output, then exactly the plan's saved values.
    fw_outputs = next(iter(graphs["fw"].graph.find_nodes(op="output"))).args[0]
    saved_names = [n.name for n in fw_outputs[1:]]
    expected = [*one_per_storage(plan.saved), *plan.saved_sym]
    assert sorted(saved_names) == sorted(n.name for n in expected)
    # Mirrored values are computed in the backward, never read from the stash.
    bw_names = {n.name for n in graphs["bw"].graph.nodes if n.op != "placeholder"}
    assert {n.name for n in plan.mirrored} <= bw_names
    assert not any(is_random(n) for n in graphs["bw"].graph.nodes if n.op == "call_function")


def test_mode_off_mirrors_nothing():
    fn, plans = ours(mode="off")
    _, _, graphs = run(fn)
    (plan,) = plans
    assert plan.mirrored == []
    bw_ops = {str(n.target) for n in graphs["bw"].graph.nodes if n.op == "call_function"}
    assert "aten.tanh.default" not in bw_ops and "aten.sigmoid.default" not in bw_ops


def test_budget_mode_recomputes_the_cheap_chain_in_backward():
    fn, plans = ours(mode="budget", budget=0.3)
    _, _, graphs = run(fn)
    (plan,) = plans
    assert plan.mirrored, "a tight budget should mirror part of the tanh/sigmoid chain"
    bw_nodes = [n for n in graphs["bw"].graph.nodes if n.op == "call_function"]
    assert {n.name for n in plan.mirrored} <= {n.name for n in bw_nodes}


def test_a_plan_that_recomputes_dropout_is_refused(monkeypatch):
    """A buggy plan leaving the dropout mask out of the stash must not reach training."""
    real_plan = planner_module.plan

    def forgetful_plan(joint, options, **kwargs):
        good = real_plan(joint, options, **kwargs)
        saved = [n for n in good.saved if not _reads_dropout(n)]
        return dataclasses.replace(good, saved=saved)

    monkeypatch.setattr(planner_module, "plan", forgetful_plan)
    fn, plans = ours(mode="off")
    with pytest.warns(MirrorgradFallbackWarning, match="random op"):
        out, grads, _ = run(fn)
    ref_out, ref_grads = eager_reference()
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
    assert plans == []


def _reads_dropout(node: torch.fx.Node) -> bool:
    return is_random(node) or any(
        a.op == "call_function" and is_random(a) for a in node.all_input_nodes
    )


def test_strict_raises_instead_of_falling_back(monkeypatch):
    def broken(joint, options, **kwargs):
        raise KeyError("no such node")

    monkeypatch.setattr(planner_module, "plan", broken)
    fn = functools.partial(partition, options=PlanOptions(mode="balance"), strict=True)
    with pytest.raises(KeyError, match="no such node"):
        run(fn)


def test_fallback_warning_names_cause_and_dump(monkeypatch):
    def broken(joint, options, **kwargs):
        raise ValueError("unsupported op foo")

    monkeypatch.setattr(planner_module, "plan", broken)
    fn = functools.partial(partition, options=PlanOptions(mode="balance"))
    with pytest.warns(MirrorgradFallbackWarning) as record:
        _, grads, _ = run(fn)
    assert len(record) == 1
    message = str(record[0].message)
    assert "ValueError: unsupported op foo" in message and "default_partition" in message
    with open(message.rsplit(": ", 1)[-1]) as f:
        dumped = f.read()
    assert "unsupported op foo" in dumped and "aten.tanh" in dumped
    _, ref_grads = eager_reference()
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


def test_inductor_partitioner_uuid_follows_options_and_marks():
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh())

    def uuid(mode="balance"):
        options = PlanOptions(mode=mode, policy=policy_for(model))
        return MirrorPartitioner(options).uuid()

    assert uuid() == uuid()
    assert uuid() != uuid("off")
    before = uuid()
    mark(model[1], mirror=False)
    assert uuid() != before
    assert isinstance(MirrorPartitioner(PlanOptions()), _compat.CustomPartitionerFn)


def test_inductor_partitioner_pickles_as_its_uuid():
    partitioner = MirrorPartitioner(PlanOptions(mode="off"), on_plan=print)
    restored = pickle.loads(pickle.dumps(partitioner))
    assert restored == PartitionerKey(partitioner.uuid())
    assert copy.deepcopy(partitioner) is partitioner


def test_inductor_partitioner_accepts_inductor_keywords():
    plans = []
    partitioner = MirrorPartitioner(PlanOptions(mode="balance"), on_plan=plans.append)

    def call(gm, joint_inputs, **kwargs):
        return partitioner(gm, joint_inputs, compiler="inductor", **kwargs)

    _, grads, _ = run(call)
    _, ref_grads = eager_reference()
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
    assert len(plans) == 1


def test_root_module_marks_reach_the_policy():
    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.act = mark(nn.Tanh(), mirror=False)

        def forward(self, x, w):
            return chain(self.act(x), w)

    model = Chain()
    plans = []
    fn = functools.partial(
        partition, options=PlanOptions(mode="budget", budget=0.3), on_plan=plans.append
    )
    torch._dynamo.reset()
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    backend = _compat.aot_autograd(
        fw_compiler=_compat.boxed_nop,
        partition_fn=functools.partial(fn, root_module=model),
    )
    torch.compile(model, backend=backend)(x, w).sum().backward()
    (plan,) = plans
    assert plan.mirrored, "chain's own ops are still mirrored"
    assert not [n for n in plan.mirrored if "act" in str(n.meta.get("nn_module_stack"))]


def test_one_per_storage_saves_a_base_instead_of_its_views():
    def f(x):
        y = torch.relu(x)
        z = torch.tanh(x)
        return y.t(), y.view(-1), z.view(-1), x.t(), x.view(-1)

    gm = make_fx(f)(torch.randn(3, 4))
    nodes = {n.name: n for n in gm.graph.nodes}
    y, z, x = nodes["relu"], nodes["tanh"], nodes["x_1"]
    y_t, y_view, z_view, x_t, x_view = [nodes[n] for n in ("t", "view", "view_1", "t_1", "view_2")]
    # Two views of relu (unsaved) -> relu; relu and its view -> relu; a lone view of
    # tanh stays; views of an input alias the input and are never donated: kept.
    assert one_per_storage([y_t, y_view]) == [y]
    assert one_per_storage([y, y_view, y_t]) == [y]
    assert one_per_storage([z_view, x_t, x_view]) == [z_view, x_t, x_view]
    assert x.op == "placeholder" and z.target is torch.ops.aten.tanh.default


def test_random_check_ignores_backward_ops_of_their_own():
    # The efficient-attention backward takes a philox seed (a random op to the policy)
    # but is no recompute: only recomputed forward nodes may not be random.
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.aten.bernoulli.default, (x,)))
    bw_gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    (rand,) = [n for n in graph.nodes if n.op == "call_function"]
    partition_module._check_no_random_recompute(bw_gm, forward_names=set())
    with pytest.raises(RuntimeError, match="recomputes random op"):
        partition_module._check_no_random_recompute(bw_gm, forward_names={rand.name})
