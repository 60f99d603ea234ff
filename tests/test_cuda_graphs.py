"""_cuda_graphs.capture: warm-ups on a side stream, then one CUDA Graph that replays."""

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
