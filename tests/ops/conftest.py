"""Op tests run with fresh buffers poisoned: an element a kernel never writes fails.

``torch.empty``, ``torch.empty_like`` and ``Tensor.new_empty`` called from
``mirrorgrad.ops`` return NaN (floating point) or a large sentinel (integers) instead of
whatever memory held, on CPU and GPU alike. Buffers allocated anywhere else (tests,
torch itself) are left alone.
"""

from __future__ import annotations

import contextlib
import gc
import sys

import pytest
import torch

INT_SENTINEL = 2**31 - 7  # out of range as an index, visible in any sum
_OPS_PACKAGE = "mirrorgrad.ops"


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with NaN (floating, complex) or INT_SENTINEL (integers; bools stay)."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(min(INT_SENTINEL, torch.iinfo(t.dtype).max))
    return t


def _called_from_ops() -> bool:
    caller = sys._getframe(2).f_globals.get("__name__", "")
    return caller == _OPS_PACKAGE or caller.startswith(_OPS_PACKAGE + ".")


def _poisoning(allocate):
    def allocate_poisoned(*args, **kwargs):
        out = allocate(*args, **kwargs)
        return poison(out) if _called_from_ops() else out

    return allocate_poisoned


@pytest.fixture(autouse=True)
def nan_fill(monkeypatch):
    """Poison fresh buffers of mirrorgrad.ops for the duration of each op test."""
    monkeypatch.setattr(torch, "empty", _poisoning(torch.empty))
    monkeypatch.setattr(torch, "empty_like", _poisoning(torch.empty_like))
    monkeypatch.setattr(torch.Tensor, "new_empty", _poisoning(torch.Tensor.new_empty))
    yield


@pytest.fixture
def tuning():
    """Other knobs of a kernel family for the rest of the test:
    ``tuning(StepTuning(bwd_chunk_rows=6))`` (ops/rnn/tuning.py)."""
    from mirrorgrad.ops.rnn.tuning import tuned

    with contextlib.ExitStack() as stack:
        yield lambda knobs: stack.enter_context(tuned(knobs))


@pytest.fixture
def cpu_graphs(monkeypatch):
    """The graph path on CPU; yields the list of stand-in graphs captured."""
    from mirrorgrad.ops.rnn import cuda_graphs

    from .graph_stand_in import ReplayedLoop

    captured: list[ReplayedLoop] = []

    def record(device, buffers, loop):
        captured.append(ReplayedLoop(buffers, loop))
        return captured[-1]

    cuda_graphs.clear_graphs()
    def use_graph(device, elements, requested):
        return requested is not False

    monkeypatch.setattr(cuda_graphs, "use_graph", use_graph)
    monkeypatch.setattr(cuda_graphs, "_record", record)
    monkeypatch.setattr(cuda_graphs, "_replay", lambda graph, buffers: graph.replay(buffers))
    # The stand-in collects garbage after every loop it runs; what is alive now (torch,
    # Inductor, earlier tests' caches) is frozen so that those collections walk only the
    # test's own objects (a full walk of a long-lived worker's heap takes ~0.3-1 s each).
    gc.collect()
    gc.freeze()
    yield captured
    gc.unfreeze()
    cuda_graphs.clear_graphs()


@pytest.fixture
def reused_blocks(monkeypatch):
    """The kernels' outputs come from freed blocks of their size where there is one, as
    the CUDA caching allocator hands them out (graph_stand_in.ReusedBlocks)."""
    from mirrorgrad.ops.rnn import step_loop

    from .graph_stand_in import ReusedBlocks

    blocks = ReusedBlocks(poison)
    def empty(config, *shape, dtype=None):
        return blocks.empty(config, *shape, dtype=dtype)

    monkeypatch.setattr(step_loop.LoopConfig, "empty", empty)
    return blocks
