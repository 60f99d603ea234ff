"""Per-op time estimate: max(FLOPs / rate, bytes moved / bandwidth), or the op's own.

FLOPs come from ``torch.utils.flop_counter``'s formula registry where it has one
(mm, addmm, bmm, convolution, attention, and any op registered with
``register_flop_formula`` such as our RNN ops), else one FLOP per output element.
Bytes moved are the op's tensor inputs plus outputs, or what the op declares with
``mirrorgrad.formulas.register_bytes_formula`` (a chunked op that writes and
reads its intermediates); views move nothing. An op that registered a time formula
(``mirrorgrad.formulas.register_time_formula``: our RNN ops, whose recurrence is bound
by its per-step latency, not its FLOPs) is priced by it where it gives a number.

Under a fusing compiler (Inductor) the bytes are those of its kernels
(``StepCost``): a pointwise op computed inside its readers' kernels
(``fusion.inlined``) adds its arithmetic only, and an op that writes its output
reads the values its inlined inputs were computed from. A recomputed op costs what
it costs in the forward pass: a recomputed ReLU whose output a convolution's
backward reads is written to memory again (read the convolution output, write the
ReLU output); one that a pointwise backward op reads is free but for arithmetic.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.fx import Node
from torch.utils.flop_counter import flop_registry

from mirrorgrad import _compat
from mirrorgrad.formulas import bytes_formula, time_formula
from mirrorgrad.graph.fusion import REALIZE_ACC_READS, inlined
from mirrorgrad.graph.joint import (
    JointGraph,
    fake_args,
    is_getitem,
    is_view,
    schema_arg,
    value_nbytes,
)


@dataclass(kw_only=True, slots=True, frozen=True)
class DeviceRates:
    """Sustained rates of one accelerator.

    The defaults are an H100 SXM as a training step sees it: ~400 TFLOP/s of dense
    bf16/TF32 matmul reached in practice (of 989 peak), ~100 TFLOP/s of convolution
    (cuDNN, TF32), ~50 TFLOP/s for everything else (fp32 vector units, of 67 peak),
    ~3.0 TB/s of HBM3 (of 3.35 peak).
    """

    matmul_flops_per_s: float = 400e12
    # NOTE: the H100 zoo run's resnet50 (batch 64, TF32) stepped in 31.0 ms under
    # torch.compile: 1.57 TFLOP, 51 TFLOP/s over the whole step; with its BatchNorm and
    # ReLU traffic (~12 ms at 3 TB/s) the convolutions ran at ~80-100 TFLOP/s. Priced
    # at the matmul rate, recomputing every convolution looked 4x cheaper than it is
    # (ResNet-152 budget 0.5: estimated +9%, measured +29% on an H200).
    conv_flops_per_s: float = 100e12
    vector_flops_per_s: float = 50e12
    bytes_per_s: float = 3.0e12
    # The least a recomputed op written to memory costs on a GPU: a kernel of its own,
    # launched by the host (0: no floor, as on the CPU). On the H100 machines
    # torch.compile's ResNet-152 step (batch 32) ran 2,154 kernels in 51.6 ms with the
    # GPU busy 29 ms (host-bound, ~24 us a kernel); a balance plan adding 458 small
    # BatchNorm/ReLU recompute kernels, priced +3-5% by bytes, measured 1.28-1.33x.
    # With this floor it keeps the large ones: 0.69x the peak at 0.90x the time
    # (docs/planner.md, "Findings").
    launch_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("matmul_flops_per_s", "conv_flops_per_s", "vector_flops_per_s",
                     "bytes_per_s"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"DeviceRates.{name} must be > 0, got {getattr(self, name)}")
        if not self.launch_s >= 0:
            raise ValueError(f"DeviceRates.launch_s must be >= 0, got {self.launch_s}")


# Launches as the H100/H200 machines' hosts measured them (~24 us a kernel).
GPU_LAUNCH_S = 20e-6
H100 = DeviceRates(launch_s=GPU_LAUNCH_S)
# Same compute as the H100, HBM3e at 4.8 TB/s peak: memory-bound recomputation is
# ~1.4x cheaper next to the matmuls.
H200 = DeviceRates(bytes_per_s=4.3e12, launch_s=GPU_LAUNCH_S)
# TF32/bf16 matmul as reached in practice, fp32 vector units, HBM2e (2.0 TB/s peak).
A100 = DeviceRates(
    matmul_flops_per_s=200e12, conv_flops_per_s=50e12, vector_flops_per_s=15e12,
    bytes_per_s=1.7e12, launch_s=GPU_LAUNCH_S,
)  # fmt: skip
_KNOWN = (("H200", H200), ("H100", H100), ("A100", A100))
# A graph on the CPU: an H100's rates (the planner's CPU tests and captures stand for
# GPU graphs) without the launch floor (the CPU runs no kernel launches; small test
# graphs would otherwise never recompute anything). ``bench.frontier`` passes H100.
CPU = DeviceRates()


def rates_for(device: torch.device) -> DeviceRates:
    """The rates of ``device`` by its CUDA name (an unknown GPU: the H100's); on the
    CPU, ``CPU``."""
    if device.type != "cuda":
        return CPU
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
        for key, rates in _KNOWN:
            if key in name:
                return rates
    return H100


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


def _numel(val: object) -> int:
    if isinstance(val, torch.Tensor):
        return _hint(val.numel())
    if isinstance(val, (tuple, list)):
        return sum(_numel(v) for v in val)
    return 0


# Ops without a formula of their own that count as another's (same leading arguments).
_FLOPS_AS = {
    "_scaled_dot_product_flash_attention_for_cpu": "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu_backward": (
        "_scaled_dot_product_flash_attention_backward"
    ),
}


def registered_flops(node: Node) -> int | None:
    """FLOPs from torch's formula registry, or None when it has no formula for the op."""
    target = node.target
    packet = getattr(target, "overloadpacket", target)
    alias = _FLOPS_AS.get(getattr(packet, "__name__", ""))
    if alias is not None:
        packet = getattr(torch.ops.aten, alias)
    formula = flop_registry.get(packet)
    if formula is None:
        return None
    args, kwargs = fake_args(node)
    return _hint(formula(*args, **kwargs, out_val=node.meta.get("val")))


def registered_bytes(node: Node) -> int | None:
    """Bytes moved as the op declares them (``register_bytes_formula``), or None."""
    formula = bytes_formula(node.target)
    if formula is None:
        return None
    args, kwargs = fake_args(node)
    return _hint(formula(*args, **kwargs))


def registered_seconds(node: Node) -> float | None:
    """Seconds of one call as the op declares them (``register_time_formula``), or None."""
    formula = time_formula(node.target)
    if formula is None:
        return None
    args, kwargs = fake_args(node)
    seconds = formula(*args, **kwargs)
    return None if seconds is None else float(seconds)


# Convolutions (forward and backward) run at DeviceRates.conv_flops_per_s.
CONVOLUTIONS = frozenset(
    ("convolution", "_convolution", "convolution_backward", "cudnn_convolution",
     "mkldnn_convolution", "miopen_convolution", "convolution_overrideable")
)  # fmt: skip


def _flops_and_rate(node: Node, rates: DeviceRates) -> tuple[int, float]:
    """FLOPs from the registry at the matmul (or convolution) rate, else one per output
    element at the vector rate. Attention kernels skip the masked half of a causal
    product (the formula counts it), and in fp32 (forward and backward) run on the
    vector units: the memory-efficient kernel has no tensor-core path for fp32."""
    flops = registered_flops(node)
    if flops is None:
        return _numel(node.meta.get("val")), rates.vector_flops_per_s
    name = getattr(getattr(node.target, "overloadpacket", node.target), "__name__", "")
    if name in CONVOLUTIONS:
        return flops, rates.conv_flops_per_s
    if "attention" in name:
        flops = flops // 2 if schema_arg(node, "is_causal") is True else flops
        if _dtype(node.meta.get("val")) == torch.float32:
            return flops, rates.vector_flops_per_s
    return flops, rates.matmul_flops_per_s


def _dtype(val: object) -> torch.dtype | None:
    """The dtype of a value, or of a tuple's first tensor."""
    if isinstance(val, (tuple, list)):
        return next((_dtype(v) for v in val if hasattr(v, "dtype")), None)
    return getattr(val, "dtype", None)


def op_cost(node: Node, rates: DeviceRates = H100) -> OpCost:
    """Estimated cost of running ``node`` once."""
    if node.op != "call_function" or is_getitem(node) or is_view(node):
        return OpCost(flops=0, bytes=0, seconds=0.0)
    moved = registered_bytes(node)
    if moved is None:
        moved = _tensor_bytes(node.args) + _tensor_bytes(list(node.kwargs.values()))
        moved += value_nbytes(node.meta.get("val"))
    flops, rate = _flops_and_rate(node, rates)
    seconds = registered_seconds(node)
    if seconds is None:
        seconds = max(flops / rate, moved / rates.bytes_per_s)
    return OpCost(flops=flops, bytes=moved, seconds=seconds)


class StepCost:
    """What each op of a training step costs as the backend runs it.

    ``fusion=False`` (each op its own kernel, ``backend="eager"``): ``op_cost``.
    ``fusion=True`` (Inductor): inlined pointwise ops cost their arithmetic; any
    other op reads the materialised values its inputs come from (seeing through
    inlined inputs) and writes its output. Whether a value is inlined is decided
    once from all its readers, forward and backward, so an op costs the same when
    it is recomputed as when it first runs, but for what it reads through inlined
    inputs (``_nearest_reads``): in the forward an inlined chain may run back through
    every block of a Transformer (its residual stream), but the backward recomputes
    from stored values. Priced through the whole forward chain, the last block's
    LayerNorm read every earlier block's values (3x block 0's price on the suite's
    transformer), so balance recomputed the first blocks' LayerNorms only, and each
    half of the blocks compiled kernels of its own.
    """

    def __init__(self, joint: JointGraph, rates: DeviceRates = H100, *, fusion: bool) -> None:
        self.joint, self.rates, self.fusion = joint, rates, fusion
        self.inlined: frozenset[Node] = frozenset(_inlined_values(joint) if fusion else ())
        self._sources: dict[Node, frozenset[Node]] = {}
        self._cost: dict[Node, OpCost] = {}
        self._recomputed: dict[Node, OpCost] = {}
        # Inlined values several forward kernels read (a residual stream's): a
        # recomputed reader reads them stored, as the plan saves or writes them.
        backward = set(joint.backward)
        self._shared = {
            v
            for v in self.inlined
            if sum(1 for r in v.users if r not in backward and not is_view(r)) > 1
        }
        compute = [n for n in joint.gm.graph.nodes if n.op == "call_function"]
        self.step_seconds = sum(self.run(n).seconds for n in compute)

    def run(self, node: Node) -> OpCost:
        """Cost of running ``node`` once, forward or recomputed in backward."""
        cost = self._cost.get(node)
        if cost is None:
            cost = self._cost[node] = self._run(node)
        return cost

    def recomputed(self, node: Node) -> OpCost:
        """Cost of recomputing ``node`` in the backward pass: ``run``, and at least a
        kernel launch where it is written to memory (not computed inside its readers'
        kernels). The step's own estimate keeps ``run``: torch.compile's plan pays its
        launches too, and on a GPU-bound step they hide behind its kernels."""
        known = self._recomputed.get(node)
        if known is None:
            known = self._recomputed[node] = self._recomputed_cost(node)
        return known

    def _recomputed_cost(self, node: Node) -> OpCost:
        cost = self._run(node, self._nearest_reads)
        written = node not in self.inlined and not is_getitem(node) and not is_view(node)
        if written and 0 < cost.seconds < self.rates.launch_s:
            return OpCost(flops=cost.flops, bytes=cost.bytes, seconds=self.rates.launch_s)
        return cost

    def _run(self, node: Node, reads_of: Callable[[Node], set[Node]] | None = None) -> OpCost:
        """``reads_of(node)``: the storages its kernel reads (by default ``_read`` of
        each input)."""
        if not self.fusion:
            return op_cost(node, self.rates)
        if node.op != "call_function" or is_getitem(node) or is_view(node):
            return OpCost(flops=0, bytes=0, seconds=0.0)
        flops, rate = _flops_and_rate(node, self.rates)
        if node in self.inlined:
            return OpCost(flops=flops, bytes=0, seconds=flops / rate)
        moved = registered_bytes(node)
        if moved is None:
            if reads_of is None:
                reads = set().union(*(self._read(a) for a in node.all_input_nodes))
            else:
                reads = reads_of(node)
            moved = sum(self.joint.nbytes(s) for s in reads) + value_nbytes(node.meta.get("val"))
        seconds = registered_seconds(node)
        if seconds is None:
            seconds = max(flops / rate, moved / self.rates.bytes_per_s)
        return OpCost(flops=flops, bytes=moved, seconds=seconds)

    def _read(self, value: Node) -> frozenset[Node]:
        """Storages a kernel reading ``value`` reads: its own, or, if it is
        inlined, those it is computed from."""
        storage = self.joint.storage(value)
        if storage not in self.inlined:
            return frozenset((storage,))
        sources = self._sources.get(storage)
        if sources is None:
            sources = frozenset().union(*(self._read(a) for a in storage.all_input_nodes))
            self._sources[storage] = sources
        return sources

    def _nearest_reads(self, node: Node) -> set[Node]:
        """Storages ``node``'s kernel reads when recomputed: through its inlined inputs,
        nearest first, until ``REALIZE_ACC_READS`` are found (the planner cuts longer
        recomputed chains: candidates.py); an inlined value that several forward
        kernels read, or one reached after that, counts as stored. So an op costs the
        same in every copy of a repeated block but the first few."""
        reads: set[Node] = set()
        seen: set[Node] = set()
        queue = deque(node.all_input_nodes)
        while queue:
            storage = self.joint.storage(queue.popleft())
            if storage in seen:
                continue
            seen.add(storage)
            stored = storage not in self.inlined or storage in self._shared
            if not stored and len(reads) < REALIZE_ACC_READS:
                queue.extend(storage.all_input_nodes)
            else:
                reads.add(storage)
        return reads


def _inlined_values(joint: JointGraph) -> set[Node]:
    """Values Inductor computes in its readers' kernels, judged per phase: the
    forward readers of a forward value and its backward readers (where the
    partitioner recomputes it) must each take it inline."""
    backward = set(joint.backward)
    compute = [n for n in joint.gm.graph.nodes if n.op == "call_function"]
    readers: dict[Node, tuple[list[Node], list[Node]]] = {n: ([], []) for n in compute}
    for n in compute:
        for a in joint.inputs(n):
            entry = readers.get(joint.storage(a))
            if entry is not None:
                entry[1 if n in backward else 0].append(n)
    kept = {joint.storage(v) for v in (*joint.fwd_outputs, *joint.bwd_outputs)}
    return {
        n
        for n, (fwd, bwd) in readers.items()
        if n not in kept and inlined(n, fwd) and inlined(n, bwd)
    }
