"""graph/held.py: the BLAS workspaces a step holds outside its graph."""

import pytest
import torch

from mirrorgrad import _compat
from mirrorgrad.graph.held import blas_workspace_bytes, held_bytes, workspace_config_bytes

MiB = 2**20


@pytest.mark.parametrize(
    ("config", "lt", "sm90", "expected"),
    [
        (None, None, True, 32 * MiB),  # torch's sm90 default; cuBLASLt shares it
        (None, None, False, 8 * MiB + 128 * 1024),
        (":4096:8", "2048", False, 32 * MiB + 2 * MiB),  # a separate cuBLASLt size
        (":4096:2:16:8", None, True, 8 * MiB + 128 * 1024),
    ],
)
def test_workspace_sizes_follow_torchs_settings(config, lt, sm90, expected):
    assert workspace_config_bytes(config, lt, sm90) == expected


def test_nothing_is_held_off_cuda():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "mirror"))
    from joint_graphs import joint_of

    joint = joint_of(torch.nn.Linear(4, 4), torch.randn(2, 4))
    assert blas_workspace_bytes(torch.device("cpu")) == 0 and held_bytes(joint) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_forward_and_backward_matmul_hold_two_workspaces():
    """The forward's handle (this thread) and autograd's each get a workspace."""
    torch.cuda.synchronize()
    _compat.clear_cublas_workspaces()  # earlier tests' matmuls made them on both threads
    a = torch.randn(256, 256, device="cuda", requires_grad=True)
    before = torch.cuda.memory_allocated()
    (a @ a).sum().backward()
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before - a.grad.nbytes
    per_thread = blas_workspace_bytes(a.device)
    assert grown == 2 * per_thread


def test_declared_op_caches_count_once_per_key():
    """Two calls of an op that keeps one buffer per size: the two same-size calls share it."""
    from mirrorgrad.formulas import register_held_formula

    lib = torch.library.Library("mirrorgrad_held_test", "FRAGMENT")
    torch.library.define("mirrorgrad_held_test::cached_sin", "(Tensor x) -> Tensor", lib=lib)
    torch.library.impl("mirrorgrad_held_test::cached_sin", "CompositeExplicitAutograd",
                       torch.sin, lib=lib)  # fmt: skip
    torch.library.register_fake("mirrorgrad_held_test::cached_sin", torch.empty_like, lib=lib)
    op = torch.ops.mirrorgrad_held_test.cached_sin

    @register_held_formula(op)
    def _(x):
        return {("cached_sin", tuple(x.shape)): 1000 * x.numel()}

    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "mirror"))
    from joint_graphs import joint_of

    class TwoCalls(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3))

        def forward(self, x):
            return (op(x * self.w) + op(x + self.w) + op(self.w)).sum()

    joint = joint_of(TwoCalls(), torch.randn(2, 3))
    assert held_bytes(joint) == {"op caches": 1000 * 6 + 1000 * 3}


def test_rnn_ops_capture_on_a_stream_of_their_own():
    """An LSTM LM's forward and backward each run matmuls on their thread's stream, and the
    RNN op's loops are captured on the capture stream from one thread: three (handle,
    stream) workspaces; a Linear two."""
    import sys
    from pathlib import Path

    import mirrorgrad.nn as mnn
    from mirrorgrad.graph import held

    sys.path.insert(0, str(Path(__file__).parents[1] / "mirror"))
    from joint_graphs import joint_of

    class Lm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.out = mnn.LSTM(4, 6, impl="reference"), torch.nn.Linear(6, 3)

        def forward(self, x):
            return self.out(self.rnn(x)[0]).sum()

    lm = joint_of(Lm(), torch.randn(5, 2, 4))
    assert held._streams(lm.forward) == held._streams(lm.backward) == 1
    assert held._captures(lm.forward) and held._captures(lm.backward)
    linear = joint_of(torch.nn.Linear(4, 4), torch.randn(2, 4))
    assert held._streams(linear.forward) == held._streams(linear.backward) == 1
    assert not held._captures([*linear.forward, *linear.backward])
