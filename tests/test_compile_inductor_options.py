"""mirrorgrad.compile(options=...) reach Inductor's compile of both graphs (forward and
the backward, which Inductor compiles lazily at the first backward)."""

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

import mirrorgrad


class _Recorder(CustomGraphPass):
    """A post-grad pass that only counts the graphs it sees."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graphs += 1

    def uuid(self) -> bytes:
        return b"mirrorgrad-test-recorder"


def test_options_patch_the_backward_compile_too():
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    recorder = _Recorder()
    compiled = mirrorgrad.compile(
        model,
        options={"post_grad_custom_post_pass": recorder, "fx_graph_cache": False},
    )
    compiled(torch.randn(3, 4)).sum().backward()
    torch._dynamo.reset()
    assert recorder.graphs == 2, "the forward and the backward graph"
