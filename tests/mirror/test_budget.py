import sys
from pathlib import Path

import pytest
import torch

from mirrorgrad import _compat
from mirrorgrad.mirror.budget import PlanOptions, plan

sys.path.insert(0, str(Path(__file__).parent))
from joint_graphs import LayerNormGeluLinear, joint_of


def _deep_mlp(blocks: int = 4, d: int = 256) -> torch.nn.Sequential:
    return torch.nn.Sequential(*(LayerNormGeluLinear(d, d) for _ in range(blocks)))


@pytest.mark.parametrize("mode", ["off", "balance", "budget"])
def test_plan_saved_values_suffice_for_the_real_extraction(mode):
    model = _deep_mlp()
    x = torch.randn(512, 256)  # activations outweigh the parameters
    joint = joint_of(model, x)
    options = PlanOptions(mode=mode, budget=0.5 if mode == "budget" else None, max_overhead=1.0)
    p = plan(joint, options)
    assert bool(p.mirrored) == (mode != "off")
    fwd, bwd = _compat.extract_fwd_bwd_modules(
        joint.gm, list(p.saved), list(p.saved_sym), num_fwd_outputs=joint.num_fwd_outputs
    )
    recomputed = {n.name for n in bwd.graph.nodes if n.op == "call_function"}
    forward_names = {n.name for n in joint.forward}
    assert recomputed & forward_names == {n.name for n in p.mirrored}
    ref_fwd, ref_bwd = _compat.default_partition(
        joint.gm, None, num_fwd_outputs=joint.num_fwd_outputs
    )
    torch.testing.assert_close(_run(fwd, bwd, joint), _run(ref_fwd, ref_bwd, joint))


def _run(fwd, bwd, joint):
    """Forward then backward of a partition on fixed inputs; returns the gradients."""
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(n.meta["val"].shape, generator=gen) for n in joint.primals]
    outs = fwd(*args)
    saved = list(outs[joint.num_fwd_outputs :])
    tangents = [torch.randn(n.meta["val"].shape, generator=gen) for n in joint.tangents]
    return [g for g in bwd(*saved, *tangents) if g is not None]
