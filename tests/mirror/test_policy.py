import sys
from pathlib import Path

import pytest
import torch
from torch import fx

from mirrorgrad.mirror import PlanOptions, plan
from mirrorgrad.mirror.policy import MirrorPolicy, mark, module_path, policy_for

sys.path.insert(0, str(Path(__file__).parent))
from joint_graphs import LayerNormGeluLinear, joint_of, joint_of_compiled

aten = torch.ops.aten


def _call(target, *args):
    g = fx.Graph()
    inputs = [g.placeholder(f"x{i}") for i in range(len(args))]
    return g.call_function(target, tuple(inputs))


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        (aten.gelu.default, True),
        (aten.add.Tensor, True),
        (aten.t.default, True),
        (aten.cat.default, True),
        (aten.native_layer_norm.default, True),
        (aten._softmax.default, True),
        (aten._safe_softmax.default, True),
        (aten.sum.dim_IntList, True),
        (aten.mm.default, False),
        (aten.addmm.default, False),
        (aten.convolution.default, False),
        (aten._scaled_dot_product_flash_attention.default, False),
        (aten.embedding.default, False),
        (aten.native_dropout.default, False),
        (aten.bernoulli.default, False),
        (aten.rand_like.default, False),
    ],
    ids=lambda v: str(v),
)
def test_op_classes(target, expected):
    assert MirrorPolicy(enabled=True).may_mirror(_call(target, 1)) is expected


def test_seeded_random_ops_are_replayed_and_seed_draws_are_not():
    import torch._inductor.inductor_prims  # registers the prims

    from mirrorgrad.mirror.policy import is_random

    prims = torch.ops.prims
    policy = MirrorPolicy()
    # inductor_random(shape, seed, mode): the same seed draws the same numbers
    replayed = _call(prims.inductor_random.default, "shape", "seed", "mode")
    assert not is_random(replayed) and policy.may_mirror(replayed)
    # inductor_seeds draws the seeds themselves
    draw = _call(prims.inductor_seeds.default, "count", "device")
    assert is_random(draw) and not policy.may_mirror(draw)
    assert is_random(_call(aten.rand.default, "shape"))


def test_switches_and_op_overrides():
    gelu, mm = _call(aten.gelu.default, 1), _call(aten.mm.default, 1, 2)
    assert not MirrorPolicy(enabled=True, mirror_pointwise=False).may_mirror(gelu)
    policy = MirrorPolicy(enabled=True, op_overrides={"gelu": False, "aten.mm": True})
    assert not policy.may_mirror(gelu) and policy.may_mirror(mm)
    assert policy_for(None, gelu=False).op_overrides == {"aten::gelu": False}


def test_random_ops_cannot_be_forced():
    dropout = _call(aten.native_dropout.default, 1)
    with pytest.raises(ValueError, match="never mirrored"):
        MirrorPolicy(op_overrides={"native_dropout": True})
    forced = MirrorPolicy(enabled=True, module_overrides={"": True})
    dropout.meta["nn_module_stack"] = {"k": ("L['self']", torch.nn.Module)}
    assert not forced.may_mirror(dropout)


def test_env_var_turns_mirroring_off(monkeypatch):
    monkeypatch.setenv("MIRRORGRAD_MIRROR", "0")
    assert not MirrorPolicy().may_mirror(_call(aten.gelu.default, 1))
    model = torch.nn.Sequential(*(LayerNormGeluLinear(256, 256) for _ in range(3)))
    joint = joint_of(model, torch.randn(512, 256))
    p = plan(joint, PlanOptions(mode="budget", budget=0.1))
    assert p.mirrored == [] and p.peak_after == p.peak_before
    monkeypatch.setenv("MIRRORGRAD_MIRROR", "1")
    assert plan(joint, PlanOptions(mode="budget", budget=0.1)).mirrored


@pytest.mark.parametrize(
    ("dynamo", "qualified"),
    [
        ("L['self']", ""),
        ("L['fn'].0", "0"),
        ("L['self'].layers[2].norm", "layers.2.norm"),
        ("L['self']._modules['layers']._modules['2']", "layers.2"),
        ("L['mod'].blocks['a'].proj", "blocks.a.proj"),
    ],
)
def test_module_path(dynamo, qualified):
    assert module_path(dynamo) == qualified


def test_mark_validates_its_arguments():
    with pytest.raises(TypeError, match=r"nn\.Module"):
        mark(object(), True)
    with pytest.raises(TypeError, match="True or False"):
        mark(torch.nn.GELU(), 1)


def test_mark_overrides_per_module():
    model = torch.nn.Sequential(*(LayerNormGeluLinear(64, 64) for _ in range(2)))
    mark(model[1].act, False)
    mark(model[0].proj, True)
    policy = policy_for(model)
    assert policy.module_overrides == {"0.proj": True, "1.act": False}
    joint = joint_of_compiled(model, torch.randn(32, 64))
    by_module = {}
    for n in joint.forward:
        if n.op == "call_function" and n.meta.get("nn_module_stack"):
            path = module_path(list(n.meta["nn_module_stack"].values())[-1][0])
            by_module.setdefault(path, []).append(policy.may_mirror(n))
    assert by_module["1.act"] == [False]  # gelu, normally mirrorable
    assert by_module["0.act"] == [True]
    assert all(by_module["0.proj"])  # addmm and its transposes, forced
    assert not all(by_module["1.proj"])  # addmm stays heavy
