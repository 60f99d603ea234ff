"""Repeated blocks: the same op at the same place in each copy shares a class."""

import sys
from pathlib import Path

import pytest
import torch

from mirrorgrad.bench import models
from mirrorgrad.bench.frontier import capture_joint
from mirrorgrad.graph.repeats import repeat_labels, repeated_classes
from mirrorgrad.mirror.policy import MirrorPolicy
from mirrorgrad.mirror.storage_balance import UnitGraph

sys.path.insert(0, str(Path(__file__).parents[1] / "mirror"))
from joint_graphs import Bottleneck, LayerNormGeluLinear, joint_of, joint_of_compiled


@pytest.mark.slow
def test_each_convolution_of_a_bottleneck_has_one_class_across_the_middle_copies():
    blocks = 8
    model = torch.nn.Sequential(*(Bottleneck(16, 4) for _ in range(blocks)))
    joint = joint_of(model, torch.randn(2, 16, 8, 8), decompose=True)
    units = UnitGraph(joint, MirrorPolicy()).units
    convs = [u for u in units if u.target is torch.ops.aten.convolution.default]
    assert len(convs) == 3 * blocks
    class_of = {n: i for i, c in enumerate(repeated_classes(joint, units)) for n in c}
    middle = range(2, blocks - 2)  # the ends' neighbourhoods differ (graph inputs, loss)
    by_role = [{class_of.get(convs[3 * b + role]) for b in middle} for role in range(3)]
    assert all(len(ids) == 1 and None not in ids for ids in by_role)
    # conv1 (16 -> 4 channels), conv2 (3x3) and conv3 (4 -> 16) are different ops
    assert len(set().union(*by_role)) == 3


def test_a_graph_without_repeats_has_no_classes():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    joint = joint_of(model, torch.randn(3, 8))
    units = UnitGraph(joint, MirrorPolicy()).units
    assert all(len({u.target for u in c}) == 1 for c in repeated_classes(joint, units))


def test_module_paths_class_every_copy_the_first_and_last_included():
    blocks = 4
    model = torch.nn.Sequential(*(LayerNormGeluLinear(16, 16) for _ in range(blocks)))
    joint = joint_of_compiled(model, torch.randn(2, 16), decompose=True)
    units = UnitGraph(joint, MirrorPolicy()).units
    class_of = {n: i for i, c in enumerate(repeated_classes(joint, units)) for n in c}
    for op in (torch.ops.aten.var_mean.correction, torch.ops.aten.erf.default):
        copies = [u for u in units if u.target is op]
        assert len(copies) == blocks
        # By their neighbourhoods alone, the first block (it reads the input) and the
        # last (the loss reads it) are told apart from the middle ones.
        assert len({class_of.get(u) for u in copies} - {None}) == 1
        assert None not in {class_of.get(u) for u in copies}


def test_dropout_seed_indices_do_not_tell_copies_apart():
    # Inductor gives each draw its seed as inductor_lookup_seed(seeds, k): k differs in
    # every copy of a block, so counted, it split every class within reach of a dropout.
    torch.manual_seed(0)
    model = models.TransformerLM(vocab=64, width=16, heads=2, layers=6, length=8, dropout=0.1)
    tokens = torch.randint(0, 64, (2, 9))
    joint = capture_joint(model, tokens[:, :-1], tokens[:, 1:])
    for n in joint.gm.graph.nodes:  # the Weisfeiler-Lehman labels alone
        n.meta.pop("nn_module_stack", None)
    label = repeat_labels(joint)
    masks = [n for n in joint.forward if n.target is torch.ops.aten.gt.Scalar]
    assert len(masks) == 2 * 6 + 1  # two dropouts a block, one after the embeddings
    middle = masks[1 + 2 * 2 : 1 + 2 * 4]  # blocks 2 and 3
    assert label[middle[0]] == label[middle[2]]
    assert label[middle[1]] == label[middle[3]]
