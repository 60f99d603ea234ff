"""Memory a training step holds outside its graph that the planner can know: the BLAS
workspaces, and what custom ops declare they keep between calls
(``formulas.register_held_formula``: the RNN op's CUDA Graph arenas).

PyTorch gives every (cuBLAS handle, stream) pair a workspace from the caching allocator
the first time a matmul runs there, and keeps it for the life of the process: one for
the thread that runs the forward, one for autograd's device thread that runs the
backward, and one more where our RNN op captures its step loops as CUDA Graphs (on a
stream of their own, from one capturing thread: ops/rnn/graphs.py; the H100 showed four
32 MiB workspaces on the +mgnn workloads while the forward's and the backward's threads
each captured their own loops). They count in ``torch.cuda.max_memory_allocated`` like any
tensor, so a step whose graph runs matmuls on a GPU peaks that much above its values.
Sizes as torch sets them (ATen's CublasHandlePool.cpp): ``CUBLAS_WORKSPACE_CONFIG``
(``:KiB:count`` pairs; default 32 MiB on sm90, 8 MiB + 128 KiB elsewhere). cuBLASLt
shares it (torch 2.11 on an H100: 32.00 MiB per thread measured, nothing more after a
TF32 matmul); a separate ``CUBLASLT_WORKSPACE_SIZE`` (KiB) counts only where it is set.
"""

from __future__ import annotations

import os
import re

import torch
from torch.fx import Node

from mirrorgrad import _compat
from mirrorgrad.formulas import held_formula
from mirrorgrad.graph.joint import JointGraph, fake_args, op_name

_BLAS_OPS = frozenset(
    ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
     "aten::_scaled_mm", "aten::addmv", "aten::mv")
)  # fmt: skip
# Ops that capture CUDA Graphs of their own on a side stream (ops/rnn/graphs.py).
_CAPTURING = frozenset(("mirrorgrad::rnn_forward", "mirrorgrad::rnn_backward"))
_PAIR = re.compile(r":(\d+):(\d+)")


def blas_workspace_bytes(device: torch.device) -> int:
    """cuBLAS + cuBLASLt workspace bytes of one (handle, stream) on ``device``; 0 off CUDA."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0
    sm90 = torch.cuda.get_device_capability(device) == (9, 0)
    return workspace_config_bytes(
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"), os.environ.get("CUBLASLT_WORKSPACE_SIZE"), sm90
    )


def workspace_config_bytes(cublas_config: str | None, lt_kib: str | None, sm90: bool) -> int:
    """The workspace torch sizes from these settings: ``CUBLAS_WORKSPACE_CONFIG``
    (``:KiB:count`` pairs, e.g. ``:4096:8``), ``CUBLASLT_WORKSPACE_SIZE`` (KiB)."""
    pairs = _PAIR.findall(cublas_config or "")
    if pairs:
        cublas = sum(int(kib) * int(n) for kib, n in pairs) * 1024
    else:
        cublas = 4096 * 8 * 1024 if sm90 else 4096 * 1024 * 2 + 16 * 1024 * 8
    return cublas + int(lt_kib or 0) * 1024


def _runs_blas(node: Node) -> bool:
    """A node whose op calls cuBLAS: the matmul family, or one of our custom ops (their
    GPU paths run GEMMs through torch)."""
    if node.op != "call_function":
        return False
    name = op_name(node)
    return name in _BLAS_OPS or name.startswith("mirrorgrad::")


def _streams(nodes: list[Node]) -> int:
    """(handle, stream) pairs one phase's thread runs matmuls on: its stream."""
    return int(any(map(_runs_blas, nodes)))


def _captures(nodes: list[Node]) -> bool:
    """Whether an op among ``nodes`` captures loops (on the one capturing thread's handle
    and the side stream: one more workspace for the whole step)."""
    return any(n.op == "call_function" and op_name(n) in _CAPTURING for n in nodes)


def held_bytes(joint: JointGraph) -> dict[str, int]:
    """What the step holds beyond the graph's values, by what holds it: the BLAS
    workspaces of the forward's thread and of the backward's, where they run matmuls,
    and the ops' declared caches (each key once)."""
    held = {}
    per_thread = blas_workspace_bytes(joint.device)
    streams = sum(_streams(nodes) for nodes in (joint.forward, joint.backward))
    streams += _captures([*joint.forward, *joint.backward])
    if per_thread and streams:
        held["cuBLAS workspaces"] = streams * per_thread
    caches = _op_caches(joint)
    if caches:
        held["op caches"] = caches
    return held


def _op_caches(joint: JointGraph) -> int:
    buffers: dict[object, int] = {}
    for node in joint.gm.graph.nodes:
        formula = held_formula(node.target) if node.op == "call_function" else None
        if formula is None:
            continue
        args, kwargs = fake_args(node)
        for key, nbytes in formula(*args, **kwargs).items():
            if isinstance(nbytes, torch.SymInt):
                nbytes = _compat.optimization_hint(nbytes, fallback=0)
            buffers[key] = max(buffers.get(key, 0), int(nbytes))
    return sum(buffers.values())
