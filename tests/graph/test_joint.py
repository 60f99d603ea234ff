import sys
from pathlib import Path

import pytest
import torch

from mirrorgrad.graph.joint import JointGraph, JointGraphError

sys.path.insert(0, str(Path(__file__).parents[1] / "mirror"))
from joint_graphs import LayerNormGeluLinear, MiB, joint_of


@pytest.fixture(scope="module")
def joint():
    model = torch.nn.Sequential(LayerNormGeluLinear(512, 512), torch.nn.Dropout(0.5))
    return joint_of(model, torch.randn(512, 512))


def _names(nodes):
    return [n.name for n in nodes]


def test_roles(joint):
    assert len(joint.primals) == 5 and len(joint.tangents) == 1
    fwd = _names(joint.forward)
    assert fwd[:2] == ["native_layer_norm", "getitem"]
    assert {"gelu", "addmm", "native_dropout"} <= set(fwd)
    assert not {"mm", "gelu_backward", "native_layer_norm_backward"} & set(fwd)
    assert set(_names(joint.backward)) >= {"mm", "gelu_backward", "native_dropout_backward"}
    assert [n.meta["val"].shape for n in joint.fwd_outputs] == [torch.Size([512, 512])]


def test_dropout_mask_is_a_forward_value(joint):
    # Nothing in the forward reads the mask; it is still a forward value, so a plan
    # saves it rather than redrawing it in the backward.
    dropout = next(n for n in joint.forward if n.name == "native_dropout")
    assert {u.name for u in dropout.users} <= set(_names(joint.forward))


def test_nbytes(joint):
    nodes = {n.name: n for n in joint.gm.graph.nodes}
    assert joint.nbytes(nodes["gelu"]) == MiB
    # a tuple sums its tensors: output [512, 512] + mean and rstd [512, 1]
    assert joint.nbytes(nodes["native_layer_norm"]) == MiB + 2 * 512 * 4


def test_bad_num_fwd_outputs(joint):
    with pytest.raises(JointGraphError, match="num_fwd_outputs"):
        JointGraph.from_fx(joint.gm, num_fwd_outputs=99)
