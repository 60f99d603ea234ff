"""CUDA Graph capture and replay of the RNN step loops: one graph per loop config.

The step loops are bound by host launches, not by the GPU, so each is captured once
per ``LoopConfig`` (and direction) and replayed with its static buffers. Inside an
outer capture the loops run plainly and become part of it.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mirrorgrad import _compat

# NOTE: on an H200 the captured step loop beat host launches at every size of issue 3's
# table (L4 H1024 B128 T50 fp32: 10.2 ms against 51 ms), so only the memory held by the
# static buffers of each captured shape bounds it.
GRAPH_MAX_ELEMENTS = int(os.environ.get("MIRRORGRAD_RNN_GRAPH_MAX_ELEMENTS", 1 << 27))
_GRAPH_CACHE_SIZE = 16


@dataclass(kw_only=True, slots=True)
class Captured:
    """A captured step loop and the static buffers its replay reads and writes."""

    graph: torch.cuda.CUDAGraph
    buffers: Any


_GRAPHS: OrderedDict[tuple, Captured] = OrderedDict()
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def use_graph(device: torch.device, elements: int, requested: bool | None) -> bool:
    """Whether to capture: on CUDA outside another capture and outside the warm-up of
    Inductor's CUDA Graph trees (which run the loop plainly, then capture it in theirs);
    ``requested`` (None: when the loop's largest buffer has at most GRAPH_MAX_ELEMENTS
    elements)."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return False
    if _compat.cudagraph_trees_warming_up(device):
        return False
    if requested is not None:
        return requested
    return elements <= GRAPH_MAX_ELEMENTS


def captured(
    key: tuple, device: torch.device, make_buffers: Callable[[], Any], loop: Callable[[Any], None]
) -> Captured:
    """Capture ``loop(buffers)`` once per key; later calls replay it."""
    hit = _GRAPHS.get(key)
    if hit is not None:
        _GRAPHS.move_to_end(key)
        return hit
    buffers = make_buffers()
    stream = _SIDE_STREAMS.setdefault(device, torch.cuda.Stream(device))
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        loop(buffers)  # warm-up: compiles the kernels, creates the cuBLAS workspace
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        loop(buffers)
    hit = Captured(graph=graph, buffers=buffers)
    _GRAPHS[key] = hit
    if len(_GRAPHS) > _GRAPH_CACHE_SIZE:
        _GRAPHS.popitem(last=False)
    return hit


def clear_graphs() -> None:
    """Drop every captured step loop and its static buffers."""
    _GRAPHS.clear()
