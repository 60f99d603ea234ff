"""The one step timer: CUDA events on a GPU, perf_counter otherwise; median and quantiles."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(kw_only=True, slots=True, frozen=True)
class Timing:
    """Milliseconds per call: every sample, their median and 20th / 80th percentiles."""

    samples_ms: tuple[float, ...]
    median_ms: float
    p20_ms: float
    p80_ms: float

    @classmethod
    def of(cls, samples_ms: list[float]) -> Timing:
        if not samples_ms:
            raise ValueError("no samples to summarise")
        p20, median, p80 = np.percentile(samples_ms, [20, 50, 80]).tolist()
        return cls(samples_ms=tuple(samples_ms), median_ms=median, p20_ms=p20, p80_ms=p80)


def _on_cuda(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda"


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if _on_cuda(device):
        torch.cuda.synchronize(device)


def time_calls(
    fn: Callable[[], object], *, repeats: int, device: torch.device | str, warmup: int = 0
) -> Timing:
    """Time ``repeats`` calls of ``fn`` after ``warmup`` untimed ones.

    On a GPU each call sits between two CUDA events and the host waits once, at the end,
    so launches of call i+1 overlap call i's kernels as they do in training; on the CPU
    each call is timed by ``perf_counter``.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    synchronize(device)
    if _on_cuda(device):
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(repeats)
        ]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return Timing.of([start.elapsed_time(end) for start, end in events])
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return Timing.of(samples)


def host_ms(step: Callable[[], object], n: int = 8) -> float:
    """Host ms per call: ``n`` CUDA calls issued back to back with no sync between them
    (what the host spends to launch a step, whether or not the GPU keeps up)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        step()
    host = (time.perf_counter() - start) / n * 1e3
    torch.cuda.synchronize()
    return host


def peak_bytes_of(step: Callable[[], object], device: torch.device | str = "cuda") -> int:
    """The bytes ``step`` allocates on a CUDA ``device`` beyond what existed before, at its
    peak: measured on a second call, the first compiling and filling caches."""
    step()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before
