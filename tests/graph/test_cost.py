import pytest
import torch
from torch import fx

from mirrorgrad.graph.cost import DeviceRates, op_cost, recompute_cost

aten = torch.ops.aten
RATES = DeviceRates(matmul_flops_per_s=1e12, vector_flops_per_s=1e11, bytes_per_s=1e11)


def _node(target, *arg_shapes, out_shape, **kwargs):
    g = fx.Graph()
    args = []
    for i, shape in enumerate(arg_shapes):
        if isinstance(shape, tuple):
            p = g.placeholder(f"a{i}")
            p.meta["val"] = torch.empty(shape, device="meta")
            args.append(p)
        else:
            args.append(shape)
    n = g.call_function(target, tuple(args), kwargs)
    n.meta["val"] = torch.empty(out_shape, device="meta")
    return n


def test_mm_flops_and_time():
    n = _node(aten.mm.default, (512, 512), (512, 512), out_shape=(512, 512))
    cost = op_cost(n, RATES)
    assert cost.flops == 2 * 512**3  # one normalised matmul unit, twice (multiply-add)
    assert cost.bytes == 3 * 2**20
    assert cost.seconds == pytest.approx(2 * 512**3 / 1e12)


def test_convolution_flops():
    # 2 * batch * C_out * C_in * kH * kW * H_out * W_out
    n = _node(
        aten.convolution.default,
        (2, 3, 8, 8),
        (4, 3, 3, 3),
        None,
        [1, 1],
        [1, 1],
        [1, 1],
        False,
        [0, 0],
        1,
        out_shape=(2, 4, 8, 8),
    )
    assert op_cost(n, RATES).flops == 2 * 2 * 4 * 3 * 3 * 3 * 8 * 8


def test_pointwise_is_memory_bound_and_fused_recompute_is_not():
    n = _node(aten.gelu.default, (512, 512), out_shape=(512, 512))
    cost = op_cost(n, RATES)
    assert cost.flops == 512 * 512
    assert cost.seconds == pytest.approx(2 * 2**20 / 1e11)
    fused = recompute_cost(n, RATES, fused=True)
    assert fused.bytes == 0 and fused.seconds == pytest.approx(512 * 512 / 1e11)
    assert recompute_cost(n, RATES, fused=False) == cost


def test_views_cost_nothing():
    n = _node(aten.t.default, (512, 256), out_shape=(256, 512))
    assert op_cost(n, RATES).seconds == 0.0


def test_rates_must_be_positive():
    with pytest.raises(ValueError, match="bytes_per_s"):
        DeviceRates(bytes_per_s=0)
