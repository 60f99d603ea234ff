"""Copies of a planned backward's inputs taken before its first call (``BackwardGuard``).

The compiled backward frees its inputs as it runs and writes into the saved values it
was donated; if that first call fails, the eager fallback needs the inputs as they
were. The copies cost time at every cold start, so:

- only what the fallback reads is copied: no input on a parameter's storage (the
  model keeps those alive and the backward never writes them), no input the
  backward graph never reads, and each storage once (the bytes its inputs view: a
  value and its views cost one copy, and come back as views of one copy);
- beside the original on its device (``clone``: TB/s on a GPU) as far as
  ``room(device)`` bytes allow (``device_room``: no higher peak), the rest in
  pageable host memory;
- ``release()`` drops them as soon as the first call returned.

``device_room`` says how many bytes may go on a CUDA device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mirrorgrad.mirror.plan import Plan

# Kept free beside the copies and the backward's estimated growth: the estimate's error.
DEVICE_MARGIN = 0.10  # of the device's memory
# The largest element size: a span starting on a multiple of it keeps every view's
# offset a whole number of elements (and its alignment).
_SPAN_ALIGNMENT = 16

Room = Callable[[torch.device], int]


def device_room(plan: Callable[[], Plan | None]) -> Room:
    """Bytes of copies that may go on ``device`` without raising the process's peak: on
    CUDA, what the peak so far (``max_memory_allocated``) leaves above the memory in use
    and the plan's estimated growth in the backward (its peak less its stash: an upper
    bound); within the device's free memory (the driver's and the caching allocator's
    unused blocks) less ``DEVICE_MARGIN`` of it; under a budget, at most what the plan's
    peak leaves of it. The copies live through the first backward: a copy beyond that
    headroom would raise the first step's peak by its size (GBs on GPT-2), so the rest
    goes to host memory. Other devices: none (host memory)."""

    def room(device: torch.device) -> int:
        if device.type != "cuda":
            return 0
        known = plan()
        free, total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        growth = 0 if known is None else max(0, known.step_peak - known.stash_bytes_after)
        fits = free + cached - growth - int(DEVICE_MARGIN * total)
        in_use = torch.cuda.memory_allocated(device)
        fits = min(fits, torch.cuda.max_memory_allocated(device) - in_use - growth)
        if known is not None and known.budget_bytes is not None:
            fits = min(fits, known.budget_bytes - known.peak_after)
        return max(0, fits)

    return room


@dataclass(slots=True)
class _Span:
    """The bytes ``[lo, hi)`` of one storage that copied inputs view, and their copy."""

    storage: torch.UntypedStorage | None  # the original, until copied
    device: torch.device
    lo: int
    hi: int
    copy: torch.Tensor | None = None  # uint8
    on_device: bool = False  # the copy is beside the original, not in host memory

    @property
    def nbytes(self) -> int:
        return self.hi - self.lo

    def take(self, on_device: bool) -> None:
        assert self.storage is not None
        source = torch.empty(0, dtype=torch.uint8, device=self.device)
        source = source.set_(self.storage)[self.lo : self.hi]
        self.storage = None  # the original may go when the call frees it
        self.copy = _copy(source, on_device)
        self.on_device = on_device

    def storage_on_device(self) -> torch.UntypedStorage:
        assert self.copy is not None
        if self.on_device:
            return self.copy.untyped_storage()
        return self.copy.to(self.device).untyped_storage()


@dataclass(slots=True)
class _View:
    """An input as a view of a span's copy."""

    span: _Span
    dtype: torch.dtype
    offset: int  # bytes from the start of the original storage
    size: tuple[int, ...]
    stride: tuple[int, ...]

    def restore(self, storages: dict[int, torch.UntypedStorage]) -> torch.Tensor:
        if id(self.span) not in storages:
            storages[id(self.span)] = self.span.storage_on_device()
        out = torch.empty(0, dtype=self.dtype, device=self.span.device)
        start = (self.offset - self.span.lo) // self.dtype.itemsize
        return out.set_(storages[id(self.span)], start, self.size, self.stride)


@dataclass(slots=True)
class _Whole:
    """An input copied by itself: no plain storage (a tensor subclass, a conjugate view),
    or no elements."""

    copy: torch.Tensor
    device: torch.device
    on_device: bool

    @classmethod
    def of(cls, t: torch.Tensor, on_device: bool) -> _Whole:
        t = t.detach()
        return cls(_copy(t, on_device), t.device, on_device)

    def restore(self, storages: dict[int, torch.UntypedStorage]) -> torch.Tensor:
        return self.copy if self.on_device else self.copy.to(self.device)


def _copy(t: torch.Tensor, on_device: bool) -> torch.Tensor:
    """A copy of ``t`` beside it, or in pageable host memory. Page-locked host copies were
    measured on an H200 at 0.47 s a GiB to take (the pinning) and 0.13 s to give back,
    against 0.81 s for a pageable one, and a 4 GiB set did not finish in 12 s: not worth
    their risk."""
    return t.clone() if on_device else t.to("cpu", copy=True)


@dataclass(slots=True)
class SafetyCopies:
    """The inputs of one call: copies (``_View``, ``_Whole``) or the values as they are."""

    values: list[Any]

    @classmethod
    def of(
        cls,
        args: Sequence[Any],
        *,
        keep: Sequence[bool],
        needed: Sequence[bool],
        room: Room,
    ) -> SafetyCopies:
        """Copies of ``args`` but for those to ``keep`` (as they are) and those not
        ``needed`` (None: the caller's list holds them until the call frees them)."""
        spans: dict[tuple[torch.device, int], _Span] = {}
        values: list[Any] = []
        wholes: list[int] = []
        for i, (arg, kept, read) in enumerate(zip(args, keep, needed, strict=True)):
            if not read:
                values.append(None)
            elif kept or not isinstance(arg, torch.Tensor):
                values.append(arg)
            elif _plain(arg) and arg.numel():
                values.append(_view_of(arg, spans))
            else:
                values.append(arg)
                wholes.append(i)
        left: dict[torch.device, int] = {}  # room not yet taken, per device

        def on_device(device: torch.device, nbytes: int) -> bool:
            if device not in left:
                left[device] = room(device)
            if nbytes > left[device]:
                return False
            left[device] -= nbytes
            return True

        with torch.no_grad():
            for span in spans.values():
                span.take(on_device(span.device, span.nbytes))
            for i in wholes:
                t = values[i]
                values[i] = _Whole.of(t, on_device(t.device, t.numel() * t.element_size()))
        return cls(values)

    def _copies(self) -> list[tuple[torch.device, bool, int]]:
        """Each copy once: its original's device, whether it is beside it, its bytes."""
        found: dict[int, tuple[torch.device, bool, int]] = {}
        for v in self.values:
            if isinstance(v, _View):
                assert v.span.copy is not None
                found[id(v.span)] = (v.span.device, v.span.on_device, v.span.copy.nbytes)
            elif isinstance(v, _Whole):
                found[id(v)] = (v.device, v.on_device, v.copy.nbytes)
        return list(found.values())

    def placed(self) -> dict[str, int]:
        """Bytes copied, by where: ``"device"`` (beside the originals) or ``"host"``."""
        placed = {"device": 0, "host": 0}
        for _, on_device, nbytes in self._copies():
            placed["device" if on_device else "host"] += nbytes
        return placed

    def restore(self) -> list[Any]:
        """The inputs as they were (new tensors for the copies)."""
        storages: dict[int, torch.UntypedStorage] = {}
        with torch.no_grad():
            return [
                v.restore(storages) if isinstance(v, (_View, _Whole)) else v for v in self.values
            ]

    def release(self) -> None:
        """Drops the copies."""
        self.values.clear()


def _plain(t: torch.Tensor) -> bool:
    """A strided tensor whose bytes are its storage's: copied as a view of a span."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.layout == torch.strided
        and not (t.is_conj() or t.is_neg() or t.is_quantized)
    )


def _view_of(t: torch.Tensor, spans: dict[tuple[torch.device, int], _Span]) -> _View:
    """``t`` (some elements) as a view of its storage's span, widened to its bytes."""
    storage = t.untyped_storage()
    itemsize = t.element_size()
    start = t.storage_offset() * itemsize
    elements = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    end = start + elements * itemsize
    lo = start - start % _SPAN_ALIGNMENT
    key = (t.device, storage.data_ptr())
    span = spans.get(key)
    if span is None:
        spans[key] = span = _Span(storage, t.device, lo, end)
    else:
        span.lo, span.hi = min(span.lo, lo), max(span.hi, end)
    return _View(span, t.dtype, start, tuple(t.shape), tuple(t.stride()))
