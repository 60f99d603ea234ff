"""bench/frontier.py: the joint graph Inductor hands a partitioner, and the comparison rows."""

import json

import pytest
import torch

from mirrorgrad.bench import frontier
from mirrorgrad.bench.workloads import WORKLOADS


@pytest.mark.slow
def test_capture_is_inductors_joint_graph_and_runs_nothing():
    built = WORKLOADS["transformer"].build(quick=True)
    before = [p.detach().clone() for p in built.model.parameters()]
    joint = frontier.capture_joint(built.model, *built.make_batch())
    targets = {str(n.target) for n in joint.gm.graph.nodes}
    # after Inductor's joint-graph passes: dropout draws from a seed
    assert "prims.inductor_random.default" in targets
    assert "aten.rand.default" not in targets
    assert all(p.grad is None for p in built.model.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, built.model.parameters()))


@pytest.mark.slow
def test_rows_compare_at_min_cuts_peak(tmp_path, capsys):
    assert frontier.main(["--out", str(tmp_path), "--quick", "--workloads", "mlp"]) == 0
    rows = json.loads((tmp_path / "frontier.json").read_text())["results"]["mlp"]["rows"]
    plans = {r["plan"].split(" (")[0]: r for r in rows}
    assert plans["compile"]["peak_vs_compile"] == 1.0
    for f in frontier.FRACTIONS:
        theirs, ours = plans[f"compile-budget-{f}"], plans[f"mirror at min-cut {f}'s peak"]
        if ours["peak_mib"] <= theirs["peak_mib"]:
            assert ours["added_time"] <= theirs["added_time"] + 1e-9
    target = plans["mirror-balance"]["balance_target"]  # against min-cut's peak, as the rows
    assert target["reached"] == pytest.approx(plans["mirror-balance"]["peak_vs_compile"])
    out = capsys.readouterr().out
    assert "| mlp |" in out
    assert f"| mirror-balance: {target['verdict']} |" in out
    assert f"- mlp, balance: {target['reason']}" in out


@pytest.mark.slow
def test_gpu_layout_pads_an_unaligned_vocabulary_as_a_gpu_does(tmp_path):
    # A tied-head LM with a vocabulary of 2049: on a GPU Inductor's pad_mm pads it for
    # the logits matmul; a plain CPU capture never does, --gpu-layout does.
    from torch import nn

    class TiedLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(2049, 32)

        def forward(self, tokens):
            logits = self.emb(tokens) @ self.emb.weight.t()
            return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())

    tokens = torch.randint(0, 2049, (2, 16))

    def pads(joint) -> int:
        return sum(n.target is torch.ops.aten.constant_pad_nd.default for n in joint.gm.graph.nodes)

    assert pads(frontier.capture_joint(TiedLM(), tokens)) == 0
    with frontier._as_on_a_gpu():
        assert pads(frontier.capture_joint(TiedLM(), tokens)) > 0
