"""Each dropout seed of a planned forward graph in a buffer of its own
(mirror/seed_buffers.py), so the copies of a repeated block share their kernels."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import fx

from mirrorgrad import _compat
from mirrorgrad.mirror.seed_buffers import give_seeds_their_own_buffers


def test_seed_split_passes_opcheck():
    """The split op's schema, fake kernel and real kernel agree (torch.library.opcheck)."""
    from mirrorgrad.mirror.seed_buffers import seed_scalars

    seeds = torch.randint(0, 2**31, (5,), dtype=torch.int64)
    torch.library.opcheck(seed_scalars, (seeds, 3))
    assert [s.item() for s in seed_scalars(seeds, 3)] == seeds[:3].tolist()


def test_seed_lookups_become_outputs_of_one_split_with_the_same_values():
    lookup = _compat.inductor_lookup_seed_op()
    graph = fx.Graph()
    seeds = graph.placeholder("seeds")
    seeds.meta["val"] = torch.empty(3, dtype=torch.int64)
    reads = []
    for k in (2, 0):
        node = graph.call_function(lookup, (seeds, k))
        node.meta["val"] = torch.empty((), dtype=torch.int64)
        reads.append(graph.call_function(torch.ops.aten.mul.Tensor, (node, 10 + k)))
    graph.output(graph.call_function(torch.ops.aten.add.Tensor, tuple(reads)))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    values = torch.tensor([5, 7, 9])
    expected = gm(values)

    give_seeds_their_own_buffers(gm)

    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert lookup not in targets
    assert targets.count(torch.ops.mirrorgrad.seed_scalars.default) == 1
    assert gm(values).item() == expected.item() == 9 * 12 + 5 * 10


_KERNELS = """
import glob, os, sys, torch
import mirrorgrad
from mirrorgrad.bench import models
torch.manual_seed(0)
model = models.TransformerLM(
    vocab=64, width=32, heads=2, layers=int(sys.argv[1]), length=16, dropout=0.1
)
tokens = torch.randint(0, 64, (1, 17))
mirrorgrad.compile(model, mode="balance")(tokens[:, :-1], tokens[:, 1:]).backward()
root = os.environ["TORCHINDUCTOR_CACHE_DIR"]
print(len(glob.glob(root + "/**/*.so", recursive=True)))
"""


def _distinct_kernels(layers: int, cache: Path) -> int:
    """Kernels Inductor builds for the suite's transformer with ``layers`` blocks, in a
    fresh process and cache (its in-memory caches would hide them)."""
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(cache),
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
    }
    out = subprocess.run(
        [sys.executable, "-c", _KERNELS, str(layers)],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return int(out.stdout.split()[-1])


@pytest.mark.slow
def test_more_blocks_with_dropout_compile_no_more_kernels(tmp_path):
    # With each seed read as seeds[k] inside the kernel that draws, every block's
    # dropout kernels were code of their own: 20 kernels at 2 blocks, 22 at 4.
    assert _distinct_kernels(4, tmp_path / "4") == _distinct_kernels(2, tmp_path / "2")
