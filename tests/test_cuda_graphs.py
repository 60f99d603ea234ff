"""_cuda_graphs.capture: warm-ups on a side stream, then one CUDA Graph that replays."""

import os

import pytest
import torch

from mirrorgrad._cuda_graphs import capture


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_capture_warms_up_then_records_a_graph_whose_replays_recompute():
    x = torch.ones(4, device="cuda")
    calls = {"warm": 0, "entered": 0, "before": 0}

    class Counting:
        def __enter__(self):
            calls["entered"] += 1

        def __exit__(self, *exc):
            return None

    def warm():
        calls["warm"] += 1

    def before():
        calls["before"] += 1

    graph, out = capture(lambda: x * 2, warmup=2, warm_up=warm, warm_up_context=Counting,
                         before_capture=before)  # fmt: skip
    assert calls == {"warm": 2, "entered": 1, "before": 1}
    x.fill_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full((4,), 6.0, device="cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captures_share_one_stream_so_cublas_keeps_one_workspace():
    """cuBLAS keeps a workspace (32 MiB on Hopper) per stream it ran on: ten captures of
    a matmul must not hold ten."""
    a = torch.randn(256, 256, device="cuda")
    capture(lambda: a @ a)  # the shared stream's workspace exists from here on
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    graphs = [capture(lambda: a @ a)[0] for _ in range(10)]
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    assert grown < 10 * 2**20, f"{grown / 2**20:.0f} MiB more after ten captures"
    del graphs


def test_small_cublas_workspaces_sets_4_mib_only_where_unset_and_cuda_is_not_started(
    monkeypatch,
):
    from mirrorgrad import _cuda_graphs

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert _cuda_graphs.small_cublas_workspaces()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:1"

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # the user's choice stays
    assert not _cuda_graphs.small_cublas_workspaces()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # too late to take effect
    assert not _cuda_graphs.small_cublas_workspaces()
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
