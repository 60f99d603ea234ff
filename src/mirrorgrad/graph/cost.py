"""Per-op time estimate: max(FLOPs / rate, bytes moved / bandwidth).

FLOPs come from ``torch.utils.flop_counter``'s formula registry where it has one
(mm, addmm, bmm, convolution, attention, and any op registered with
``register_flop_formula`` such as our RNN ops), else one FLOP per output element.
Bytes moved are the op's tensor inputs plus outputs; views move nothing.

A recomputed op costs the same, except under a fusing compiler (Inductor): a
recomputed pointwise op runs inside the kernel of its backward consumer, which
then reads the op's inputs from the stash instead of its output. It adds its
arithmetic, not its memory traffic; other recomputed ops skip their output write.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node
from torch.utils.flop_counter import flop_registry

from mirrorgrad import _compat
from mirrorgrad.graph.joint import is_getitem, is_view, value_nbytes


@dataclass(kw_only=True, slots=True, frozen=True)
class DeviceRates:
    """Sustained rates of one accelerator.

    The defaults are an H100 SXM as a training step sees it: ~400 TFLOP/s of dense
    bf16/TF32 matmul reached in practice (of 989 peak), ~50 TFLOP/s for everything
    else (fp32 vector units, of 67 peak), ~3.0 TB/s of HBM3 (of 3.35 peak).
    """

    matmul_flops_per_s: float = 400e12
    vector_flops_per_s: float = 50e12
    bytes_per_s: float = 3.0e12

    def __post_init__(self) -> None:
        for name in ("matmul_flops_per_s", "vector_flops_per_s", "bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"DeviceRates.{name} must be > 0, got {getattr(self, name)}")


H100 = DeviceRates()


@dataclass(kw_only=True, slots=True, frozen=True)
class OpCost:
    flops: int
    bytes: int
    seconds: float


def _hint(x: object) -> int:
    return _compat.optimization_hint(x, fallback=4096) if isinstance(x, torch.SymInt) else int(x)


def _tensor_bytes(args) -> int:
    total = 0
    for a in args:
        if isinstance(a, Node):
            total += value_nbytes(a.meta.get("val"))
        elif isinstance(a, (list, tuple)):
            total += _tensor_bytes(a)
    return total


def _meta(a: object) -> object:
    if isinstance(a, Node):
        return a.meta.get("val")
    if isinstance(a, (list, tuple)):
        return type(a)(_meta(x) for x in a)
    return a


def _numel(val: object) -> int:
    if isinstance(val, torch.Tensor):
        return _hint(val.numel())
    if isinstance(val, (tuple, list)):
        return sum(_numel(v) for v in val)
    return 0


def registered_flops(node: Node) -> int | None:
    """FLOPs from torch's formula registry, or None when it has no formula for the op."""
    target = node.target
    packet = getattr(target, "overloadpacket", target)
    formula = flop_registry.get(packet)
    if formula is None:
        return None
    args = [_meta(a) for a in node.args]
    kwargs = {k: _meta(v) for k, v in node.kwargs.items()}
    return _hint(formula(*args, **kwargs, out_val=node.meta.get("val")))


def op_cost(node: Node, rates: DeviceRates = H100) -> OpCost:
    """Estimated cost of running ``node`` once."""
    if node.op != "call_function" or is_getitem(node) or is_view(node):
        return OpCost(flops=0, bytes=0, seconds=0.0)
    out = node.meta.get("val")
    moved = _tensor_bytes(node.args) + _tensor_bytes(list(node.kwargs.values()))
    moved += value_nbytes(out)
    flops = registered_flops(node)
    rate = rates.matmul_flops_per_s
    if flops is None:
        flops, rate = _numel(out), rates.vector_flops_per_s
    seconds = max(flops / rate, moved / rates.bytes_per_s)
    return OpCost(flops=flops, bytes=moved, seconds=seconds)


def recompute_cost(node: Node, rates: DeviceRates = H100, *, fused: bool = True) -> OpCost:
    """Estimated cost of recomputing ``node`` in the backward pass."""
    cost = op_cost(node, rates)
    if not fused or cost.seconds == 0.0:
        return cost
    target = node.target
    if isinstance(target, _compat.OpOverload) and torch.Tag.pointwise in target.tags:
        return OpCost(flops=cost.flops, bytes=0, seconds=cost.flops / rates.vector_flops_per_s)
    moved = cost.bytes - value_nbytes(node.meta.get("val"))
    rate = (
        rates.matmul_flops_per_s
        if registered_flops(node) is not None
        else (rates.vector_flops_per_s)
    )
    seconds = max(cost.flops / rate, moved / rates.bytes_per_s)
    return OpCost(flops=cost.flops, bytes=moved, seconds=seconds)
