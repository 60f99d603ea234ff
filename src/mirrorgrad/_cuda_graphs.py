"""Capture a callable in one CUDA Graph as torch asks: warm-up calls on a side stream,
then the capture on that same stream (autograd's work stays on one stream)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch

# One side stream per device for every capture. cuBLAS takes a workspace per stream it
# runs on (32 MiB on Hopper), which torch keeps for the process: a new stream per
# capture left one more each time (about 130 MiB after auto's captured timings).
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


# 4 MiB: the size measured not to slow the word LM's step (H100, fp32 B20: 236.6k vs
# 238.7k tokens/s, within run-to-run noise) while its peak fell 385 -> 246 MiB.
SMALL_CUBLAS_WORKSPACE = ":4096:1"


def small_cublas_workspaces() -> bool:
    """Sets ``CUBLAS_WORKSPACE_CONFIG`` to 4 MiB per workspace where the user has not set
    it and CUDA is not initialized yet (cuBLAS reads it when it makes a workspace).
    Returns whether it did. A whole-step graph's process holds one workspace per
    (thread's handle, stream) pair: five at 32 MiB each in `mirrorgrad train lm`, more
    than its activations."""
    if "CUBLAS_WORKSPACE_CONFIG" in os.environ or torch.cuda.is_initialized():
        return False
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = SMALL_CUBLAS_WORKSPACE
    return True


def side_stream(device: torch.device | str | None = None) -> torch.cuda.Stream:
    """The side stream captures on ``device`` run on (made once per device)."""
    index = torch.device("cuda", device) if isinstance(device, int) else device
    index = torch.device(index).index if index is not None else None
    index = torch.cuda.current_device() if index is None else index
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(index)
    return _SIDE_STREAMS[index]


def capture(
    fn: Callable[[], Any],
    *,
    warmup: int = 3,
    warm_up: Callable[[], Any] | None = None,
    warm_up_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    before_capture: Callable[[], None] | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``(graph, what fn returned while captured)``: ``warmup`` calls of ``warm_up``
    (default ``fn``) inside ``warm_up_context()`` first (they build kernels and fill
    caches), then ``before_capture()``, then ``fn`` captured. Replay with
    ``graph.replay()``; the result's tensors are rewritten by each replay."""
    current = torch.cuda.current_stream(device)
    side = side_stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side), warm_up_context():
        for _ in range(warmup):
            (warm_up or fn)()
    side.synchronize()
    if before_capture is not None:
        before_capture()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        result = fn()
    current.wait_stream(side)
    return graph, result
