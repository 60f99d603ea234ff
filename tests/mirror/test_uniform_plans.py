"""Balance's plan is the same in every copy of a repeated block (Inductor compiles one
kernel per distinct piece of code: a plan that differs between copies compiles more)."""

import collections
import re
import warnings

import pytest
import torch

from mirrorgrad import _compat
from mirrorgrad.bench import models
from mirrorgrad.bench.frontier import capture_joint
from mirrorgrad.graph import fusion
from mirrorgrad.graph.cost import H200
from mirrorgrad.mirror import PlanOptions, plan


@pytest.mark.slow
def test_balance_recomputes_the_same_ops_in_every_block_of_a_transformer():
    # Before: the residual stream's recomputed chain was cut every few blocks wherever
    # its reads ran out (blocks 1-3 saved one residual, 0, 4 and 5 another), and the
    # LayerNorms of later blocks were priced through the whole forward residual chain.
    torch.manual_seed(0)
    blocks = 6
    model = models.TransformerLM(
        vocab=512, width=256, heads=4, layers=blocks, length=256, dropout=0.1
    )
    tokens = torch.randint(0, 512, (8, 257))
    with _compat.gpu_shape_padding(), fusion.strides_as_on_a_gpu():  # as an H200 plans it
        joint = capture_joint(model, tokens[:, :-1], tokens[:, 1:])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            p = plan(joint, PlanOptions(mode="balance", device=H200))
    assert p.peak_after < p.peak_before
    assert p.added_time_s <= 0.03 * p.step_time_s
    recomputed = set(p.mirrored)
    copies = collections.defaultdict(list)  # the same op at the same place in each block
    seen = collections.Counter()
    for n in joint.forward:
        path = str(list((n.meta.get("nn_module_stack") or {None: ("",)}).values())[-1][0])
        block = re.search(r"\.blocks\.(\d+)", path)
        if block:
            place = (re.sub(r"\.blocks\.\d+", "", path), str(n.target))
            seen[block.group(1), place] += 1
            copies[place, seen[block.group(1), place]].append(n)
    in_blocks = [c for c in copies.values() if len(c) == blocks]
    assert len(in_blocks) > 50
    assert any(recomputed & set(c) for c in in_blocks)
    mixed = [c[0].name for c in in_blocks if 0 < len(recomputed & set(c)) < blocks]
    assert not mixed
