"""The NaN-fill fixture (conftest.py) poisons fresh buffers of mirrorgrad.ops and makes
a kernel that leaves part of its output unwritten fail its test."""

import dataclasses

import pytest
import torch

from mirrorgrad.ops.rnn import kernels, step_loop
from mirrorgrad.ops.rnn.layer_call import LayerCall

from .conftest import INT_SENTINEL
from .test_rnn_kernels import _check_layer


def test_buffers_allocated_by_ops_are_poisoned():
    call = LayerCall("lstm", torch.zeros(3, 2, 4), torch.zeros(2, 2), torch.zeros(2, 2),
                     torch.zeros(8, 4), torch.zeros(8, 2))  # fmt: skip
    config = step_loop.loop_config(call, fused=False)
    assert config.empty(3, 2).isnan().all()
    assert (config.empty(5, dtype=torch.int64) == INT_SENTINEL).all()
    assert (config.empty(5, dtype=torch.int32) == INT_SENTINEL).all()


def test_buffers_allocated_elsewhere_are_left_alone(monkeypatch):
    marker = torch.full((4,), 7.0)
    monkeypatch.setattr(torch.Tensor, "fill_", lambda *a: pytest.fail("poisoned a test buffer"))
    torch.empty(3)
    torch.empty_like(marker)
    marker.new_empty(2)


def test_an_unwritten_last_step_fails_the_layer_test(monkeypatch):
    """A step loop that skips its last step leaves y[T-1] unwritten: NaN, and the
    comparison with the oracle fails (without the fixture it could read stale zeros)."""
    if not kernels.supports("lstm", proj=False, dtype=torch.float32, device=torch.device("cpu")):
        pytest.skip("Triton kernels need TRITON_INTERPRET=1 on CPU")
    _check_layer("lstm", memory="stash", use_graph=False)  # the real loop passes
    loop = kernels._fwd_loop

    def skips_last_step(config, buf):
        loop(dataclasses.replace(config, T=config.T - 1), buf)

    monkeypatch.setattr(kernels, "_fwd_loop", skips_last_step)
    with pytest.raises(AssertionError, match="nan"):
        _check_layer("lstm", memory="stash", use_graph=False)
