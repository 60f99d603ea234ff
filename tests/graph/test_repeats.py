"""Repeated blocks: the same op at the same place in each copy shares a class."""

import sys
from pathlib import Path

import pytest
import torch

from mirrorgrad.graph.repeats import repeated_classes
from mirrorgrad.mirror.policy import MirrorPolicy
from mirrorgrad.mirror.storage_balance import UnitGraph

sys.path.insert(0, str(Path(__file__).parents[1] / "mirror"))
from joint_graphs import Bottleneck, joint_of


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
