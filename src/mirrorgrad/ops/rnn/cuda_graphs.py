"""CUDA Graph capture and replay of the RNN step loops, holding no second copy of anything
(docs/rnn-op.md, "CUDA Graphs of the step loops").

A loop is captured once per key (configuration, weights' addresses) and replayed on
the addresses it was captured with; an ``Entry`` holds those addresses, never tensors.
Outputs are each call's fresh tensors (a call replays the entry captured with exactly
its addresses, else captures one: at most ``ENTRIES_PER_KEY`` per key), large inputs are
read in place, and what is dead after a call (``workspace``) is a view of one arena per
device and name, shared by every configuration (``_ARENA_OF``: names never live at once
share one). Past ``GRAPH_CACHE_BYTES`` of arenas the least recently used keys go; a key
that keeps missing captures only at its 1st-4th, 8th, 16th, ... miss in a row, or when
a call brings back one of its last ``RECENT_MISSES`` uncaptured address sets. Every
capture runs on one worker thread (one cuBLAS workspace for the side stream); inside an
outer capture the loops run plainly and become part of it.

``MIRRORGRAD_RNN_GRAPH_MAX_ELEMENTS`` (the largest loop buffer captured, in elements; 0
captures nothing) and ``MIRRORGRAD_RNN_GRAPH_CACHE_MB`` (the arenas kept) are read at
each call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from mirrorgrad import _compat
from mirrorgrad._cuda_graphs import side_stream

# NOTE: on an H200 the captured step loop beat host launches at every size measured
# (L4 H1024 B128 T50 fp32: 10.2 ms against 51 ms), so only size bounds it. Where
# MIRRORGRAD_RNN_GRAPH_MAX_ELEMENTS is unset.
GRAPH_MAX_ELEMENTS = 1 << 27
# Keys are per layer-direction and phase (backward: per chunk); weights in the key. An
# entry holds a graph, no buffer, so the bound is generous: a step that cycles through
# more keys than this evicts each before its next use, and captures on every call.
_GRAPH_CACHE_SIZE = 256
# Entries of one key: the address sets a loop's calls get (a forward's outputs held over
# a step, a warm-up's addresses) before the steady loop's repeat.
ENTRIES_PER_KEY = 4
# Address sets of a key's latest uncaptured calls: one that comes back is captured.
RECENT_MISSES = 8
# Bytes of arenas past which the least recently used keys are dropped, with the
# workspace only they used (where MIRRORGRAD_RNN_GRAPH_CACHE_MB is unset).
GRAPH_CACHE_BYTES = 1024 << 20
# Workspace names whose buffers are never live at once share an arena: a forward's
# pre-activations are dead when its loop ends, a backward's gate gradients once the
# chunk's GEMMs have read them (an LSTM's, written over its recomputed pre-activations:
# "bwd.pre_dg"), and no loop runs between a loop and its own readers.
# persistent.py's captured layers: its backward's padded gate gradients share "gates"
# too, its recomputed pre-activations and GRU hidden-side gradients kernels.py's arenas,
# the padded copies of x and W_ih (padded_operands.py) one arena each for both phases,
# a backward chunk's padded h_{t-1} x's (filled once the chunk's x and grad_x are done).
_ARENA_OF = {"pre": "gates", "bwd.dg": "gates", "bwd.pre_dg": "gates",
             "persistent.bwd.dg": "gates", "persistent.bwd.pre": "bwd.pre",
             "persistent.bwd.dgh": "bwd.dgh", "persistent.fwd.pad.x": "pad.x",
             "persistent.bwd.pad.x": "pad.x", "persistent.bwd.pad.h": "pad.x",
             "persistent.fwd.pad.w_ih": "pad.w_ih",
             "persistent.bwd.pad.w_ih": "pad.w_ih"}  # fmt: skip


@dataclass(slots=True)
class Entry:
    """A captured step loop and the address of every tensor field of the buffers it was
    captured with (0 for None); it holds none of them."""

    graph: Any  # torch.cuda.CUDAGraph: .replay()
    addresses: tuple[int, ...]

    def replay(self, buffers: Any) -> None:
        """Run the loop on ``buffers``: those it was captured with, field by field
        (the caller found this entry by their addresses)."""
        _replay(self.graph, buffers)


@dataclass(slots=True)
class _Key:
    entries: list[Entry] = field(default_factory=list)  # least recently used first
    misses: int = 0  # calls in a row that found no entry
    uncaptured: deque[tuple[int, ...]] = field(
        default_factory=lambda: deque(maxlen=RECENT_MISSES)
    )  # the address sets of the latest calls that ran uncaptured


_ENTRIES: OrderedDict[tuple, _Key] = OrderedDict()
_WORKSPACE: dict[tuple, Tensor] = {}  # (config, name) -> a view of an arena
_ARENAS: dict[tuple, Tensor] = {}  # (device, arena name) -> bytes
_ARENA_ALONE: dict[tuple, int] = {}  # its storage use count while no view of it exists
_RECORDING: list[set[tuple]] = []  # the key sets of open recording() blocks
_CAPTURE_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mirrorgrad-rnn-capture")
_COUNTS = {"captures": 0, "replays": 0, "uncaptured": 0}
# The latest misses: (the key's phase name, the fields whose addresses differ from the
# key's closest entry). A key that never replays shows here which buffer moves.
_MISSES: deque[tuple[str, tuple[str, ...]]] = deque(maxlen=64)


def captures_by_size(elements: int) -> bool:
    """Whether a loop whose largest buffer has ``elements`` elements is captured when
    nothing asks otherwise."""
    bound = os.environ.get("MIRRORGRAD_RNN_GRAPH_MAX_ELEMENTS")
    return elements <= (GRAPH_MAX_ELEMENTS if bound is None else int(bound))


def _cache_bytes() -> int:
    """The bytes of arenas the cache keeps at most."""
    mib = os.environ.get("MIRRORGRAD_RNN_GRAPH_CACHE_MB")
    return GRAPH_CACHE_BYTES if mib is None else int(mib) << 20


_plain_depth = 0  # > 0 inside plain_loops()


@contextlib.contextmanager
def plain_loops():
    """Loops inside run plainly, capturing nothing and taking no arena: for the warm-up
    of a caller that will capture the whole step, where the loops become part of its
    graph and graphs or arenas of their own would only hold memory."""
    global _plain_depth
    _plain_depth += 1
    try:
        yield
    finally:
        _plain_depth -= 1


def use_graph(device: torch.device, elements: int, requested: bool | None) -> bool:
    """Whether to capture: on CUDA outside another capture, outside ``plain_loops()`` and
    outside the warm-up of Inductor's CUDA Graph trees (which run the loop plainly, then
    capture it in theirs); ``requested`` (None: when the loop's largest buffer has at
    most GRAPH_MAX_ELEMENTS elements)."""
    if device.type != "cuda" or _plain_depth or torch.cuda.is_current_stream_capturing():
        return False
    if _compat.cudagraph_trees_warming_up(device):
        return False
    if requested is not None:
        return requested
    return captures_by_size(elements)


def workspace(config: Any, name: str, make: Callable[[], Tensor]) -> Tensor:
    """The buffer ``name`` shared by every captured loop of ``config``: a view, shaped as
    ``make()`` would make it (nothing is allocated to find out), of the arena that all
    configs' ``name`` buffers share on that device."""
    key = (config, name)
    buffer = _WORKSPACE.get(key)
    if buffer is None:
        with _compat.fake_tensors():
            like = make()
        buffer = _WORKSPACE[key] = _arena_view(arena_name(name), like)
    return buffer


def arena_name(name: str) -> str:
    """The arena that workspace buffer ``name`` is a view of."""
    return _ARENA_OF.get(name, name)


def arena_bytes(like: Tensor) -> int:
    """Bytes of an arena that can hold a buffer shaped like ``like``."""
    return max(like.numel() * like.dtype.itemsize, 1)


class ArenaSizes:
    """A stand-in for ``workspace`` that hands out what ``make`` makes (on the meta
    device, by the callers) and records the bytes each arena is asked for: what a
    capture would hold, as ``held()`` keys it for the op's held-memory formula."""

    def __init__(self, device: torch.device | str) -> None:
        self.device, self.sizes = str(device), {}

    def __call__(self, _config: Any, name: str, make: Callable[[], Tensor]) -> Tensor:
        like = make()
        self.ask(name, arena_bytes(like))
        return like

    def ask(self, name: str, nbytes: int) -> None:
        arena = arena_name(name)
        self.sizes[arena] = max(self.sizes.get(arena, 0), nbytes)

    def held(self) -> dict[tuple, int]:
        return {("mirrorgrad.rnn arena", self.device, n): b for n, b in self.sizes.items()}


def reserve(device: torch.device, name: str, nbytes: int) -> None:
    """Make the arena of workspace ``name`` at least ``nbytes`` now, before views of it are
    taken: an arena that grows later keeps its old self alive in the views already taken
    (deepspeech2 on the H100: a 44 MiB arena of forward pre-activations, then a 59 MiB
    one for the recomputing backward, both held for the whole run)."""
    key = (torch.device(device), arena_name(name))
    arena = _ARENAS.get(key)
    if arena is None or arena.numel() < nbytes:
        arena = _ARENAS[key] = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
        _ARENA_ALONE[key] = _compat.storage_use_count(arena)


def _arena_view(name: str, like: Tensor) -> Tensor:
    """A tensor shaped like ``like`` at the start of arena ``name`` on its device; the
    arena is replaced by a larger one when too small (the old one lives on in the
    views already handed out, until their entries are dropped)."""
    nbytes = like.numel() * like.dtype.itemsize
    key = (like.device, name)
    arena = _ARENAS.get(key)
    if arena is None or arena.numel() < nbytes:
        arena = _ARENAS[key] = torch.empty(arena_bytes(like), dtype=torch.uint8, device=like.device)
        _ARENA_ALONE[key] = _compat.storage_use_count(arena)
    return arena[:nbytes].view(like.dtype).view(like.shape)


def addresses(buffers: Any) -> tuple[int, ...]:
    """The address of every tensor field of ``buffers`` (a dataclass), 0 for None: what an
    entry must have been captured with to replay on them."""
    return tuple(
        0 if value is None else value.data_ptr()
        for value in map(buffers.__getattribute__, _field_names(type(buffers)))
    )


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def acquire(
    key: tuple,
    device: torch.device,
    buffers: Any,
    loop: Callable[[Any], None],
    before_capture: Callable[[], None] | None = None,
) -> Entry | None:
    """The entry of ``key`` captured with ``buffers``' addresses, capturing one on
    ``buffers`` if none was; None where the key keeps missing and skips this capture
    (the caller runs the loop uncaptured).

    ``buffers``: a dataclass of tensors (or None), this call's own: fresh outputs,
    inputs read in place, views of the workspace. ``before_capture``: called just before
    a new entry is captured, whose warm-up runs the loop once on ``buffers`` (the caller
    saves what it still needs from the shared workspace). The caller fills the inputs
    that are copied in, then calls ``entry.replay(buffers)``."""
    slot = _ENTRIES.get(key)
    if slot is None:
        slot = _ENTRIES[key] = _Key()
    _ENTRIES.move_to_end(key)
    for keys in _RECORDING:
        keys.add(key)
    wanted = addresses(buffers)
    for entry in reversed(slot.entries):
        if entry.addresses == wanted:
            slot.misses = 0
            if entry is not slot.entries[-1]:
                slot.entries.remove(entry)
                slot.entries.append(entry)
            _COUNTS["replays"] += 1
            return entry
    slot.misses += 1
    if slot.entries:
        _MISSES.append((_phase(key), _moved(type(buffers), slot.entries, wanted)))
    backing_off = slot.misses > ENTRIES_PER_KEY and slot.misses & (slot.misses - 1)
    if backing_off and wanted not in slot.uncaptured:
        slot.uncaptured.append(wanted)
        _COUNTS["uncaptured"] += 1
        return None
    if before_capture is not None:
        before_capture()
    entry = Entry(graph=_on_capture_thread(device, buffers, loop), addresses=wanted)
    _COUNTS["captures"] += 1
    if len(slot.entries) >= ENTRIES_PER_KEY:
        del slot.entries[0]
    slot.entries.append(entry)
    if len(_ENTRIES) > _GRAPH_CACHE_SIZE:
        while len(_ENTRIES) > _GRAPH_CACHE_SIZE:
            _ENTRIES.popitem(last=False)
        _drop_unused_workspace()
    if held_bytes() > _cache_bytes():
        _drop_least_recent(keep=key)
    return entry


def _phase(key: tuple) -> str:
    """The first string in a key (its phase: "fwd", "bwd", "persistent.fwd", ...)."""
    return next((part for part in key if isinstance(part, str)), "?")


def _moved(cls: type, entries: list[Entry], wanted: tuple[int, ...]) -> tuple[str, ...]:
    """The fields of ``cls`` whose addresses differ from the entry closest to ``wanted``."""
    names = _field_names(cls)
    differing = (
        tuple(n for n, a, b in zip(names, entry.addresses, wanted) if a != b) for entry in entries
    )
    return min(differing, key=len)


def misses() -> list[tuple[str, tuple[str, ...]]]:
    """The latest misses of keys that had entries: (phase, fields that moved)."""
    return list(_MISSES)


def counts() -> dict[str, int]:
    """Calls since the cache was cleared that captured, replayed, or ran uncaptured."""
    return dict(_COUNTS)


def _drop_least_recent(keep: tuple) -> None:
    """Drop keys, least recently used first, until the arenas left hold at most
    ``_cache_bytes()`` (or only ``keep`` is left), with the workspace only they used."""
    limit = _cache_bytes()
    for key in list(_ENTRIES):
        if held_bytes() <= limit:
            break
        if key != keep:
            del _ENTRIES[key]
            _drop_unused_workspace()


def _drop_unused_workspace() -> None:
    """Workspace of configs no entry uses, and arenas no view is left of."""
    live = {key[0] for key in _ENTRIES}
    for key in [k for k in _WORKSPACE if k[0] not in live]:
        del _WORKSPACE[key]
    for key, arena in list(_ARENAS.items()):
        if _compat.storage_use_count(arena) == _ARENA_ALONE[key]:
            del _ARENAS[key], _ARENA_ALONE[key]


@contextlib.contextmanager
def recording():
    """Yields the set of entry keys that the loops run inside the block use."""
    keys: set[tuple] = set()
    _RECORDING.append(keys)
    try:
        yield keys
    finally:
        # By identity: nested blocks' sets can be equal, and list.remove would drop the
        # outer one, which then misses the keys recorded after the inner block ended.
        del _RECORDING[next(i for i, k in enumerate(_RECORDING) if k is keys)]


def release(keys: set[tuple]) -> None:
    """Forget the entries of ``keys`` (loops ``impl="auto"`` timed but did not pick) and
    the workspace that only they used."""
    for key in keys:
        _ENTRIES.pop(key, None)
    _drop_unused_workspace()


def _record(device: torch.device, buffers: Any, loop: Callable[[Any], None]):
    """A CUDA Graph of ``loop(buffers)`` (tests stand in a replaying loop on CPU).

    Captured with ``capture_begin``/``capture_end``, not ``torch.cuda.graph``, whose
    entry synchronizes and empties the caching allocator's cache: every capture would
    then move the addresses the next calls get, the very thing entries are found by
    (and cost a device sync and the re-allocation of every freed segment)."""
    stream = side_stream(device)  # every capture's one stream: one cuBLAS workspace
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        loop(buffers)  # warm-up: compiles the kernels, creates the cuBLAS workspace
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin()
        try:
            loop(buffers)
        finally:
            graph.capture_end()
    torch.cuda.current_stream(device).wait_stream(stream)
    return graph


def _replay(graph: Any, buffers: Any) -> None:
    """A CUDA Graph replays on its captured addresses (tests stand in a loop run on
    ``buffers``)."""
    graph.replay()


def _on_capture_thread(device: torch.device, buffers: Any, loop: Callable[[Any], None]):
    """``_record(device, buffers, loop)`` on the one capturing thread (its cuBLAS handle is
    the only one that meets the side stream), with the caller's device and current stream
    (the side stream waits for it), no autograd recording (the loops write into buffers
    in place); the caller's exceptions are raised in the caller."""
    caller_stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    def record():
        context = contextlib.nullcontext()
        if caller_stream is not None:
            torch.cuda.set_device(caller_stream.device)
            context = torch.cuda.stream(caller_stream)
        with context, torch.no_grad():
            return _record(device, buffers, loop)

    return _CAPTURE_THREAD.submit(record).result()


def held() -> list[Tensor]:
    """One tensor per storage the cache holds between calls: the arenas (entries hold
    no tensor; the workspace views are views of the arenas)."""
    tensors = (*_WORKSPACE.values(), *_ARENAS.values())
    return list({t.untyped_storage().data_ptr(): t for t in tensors}.values())


def held_bytes() -> int:
    """Bytes the cache holds between calls: its arenas."""
    return sum(t.untyped_storage().nbytes() for t in held())


def clear_graphs() -> None:
    """Drop every captured step loop and the shared workspace."""
    _ENTRIES.clear()
    _WORKSPACE.clear()
    _ARENAS.clear()
    _ARENA_ALONE.clear()
    _COUNTS.update(dict.fromkeys(_COUNTS, 0))
    _MISSES.clear()
