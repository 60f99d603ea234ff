"""CUDA Graph capture and replay of the RNN step loops, holding no second copy of anything.

The step loops are bound by host launches, not by the GPU, so each is captured once
and replayed. A replay reads and writes fixed addresses; what lives there is chosen so
that nothing is held twice for the whole run:

- **outputs are handed out, not copied**: a captured loop writes its outputs (y, cells,
  stash) into buffers that are given to the caller as they are. An ``Entry`` may
  replay again only once every tensor it handed out is dropped (its storage is used by
  the cache alone); until then another entry is captured (at most
  ``ENTRIES_PER_KEY``), then the loop runs uncaptured;
- **inputs are read where they are**: weights (parameters keep their address), and in
  backward the outputs a captured forward handed out (``is_static``), are read in
  place, their addresses part of the key; only small or transient inputs are copied;
- **workspace is shared**: buffers that are dead after each call (pre-activations in
  recompute mode, gate gradients, copied-in inputs) are views of one arena per device
  and name, as large as the largest config asked (one stream runs the loops in turn),
  so configs of several sizes (another T, another layer width) add no workspace of
  their own; a forward's pre-activations and a backward's gate gradients, never live
  at once, share one arena;
- **bounded**: past ``GRAPH_CACHE_BYTES`` held, the least recently used idle entries
  are dropped (and workspace nobody reads any more);
- **one capturing thread**: torch keeps a cuBLAS workspace per (thread's handle, stream)
  for the whole process (32 MiB on an H100), and the captured GEMMs point into it. Loops
  are captured on a side stream; captured from the forward's thread and from autograd's
  backward thread, that made two workspaces. Every capture runs on one worker thread
  instead (the caller waits): one.

Inside an outer capture the loops run plainly and become part of it.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mirrorgrad import _compat

# NOTE: on an H200 the captured step loop beat host launches at every size of issue 3's
# table (L4 H1024 B128 T50 fp32: 10.2 ms against 51 ms), so only size bounds it.
GRAPH_MAX_ELEMENTS = int(os.environ.get("MIRRORGRAD_RNN_GRAPH_MAX_ELEMENTS", 1 << 27))
# Keys are per layer (weights are read in place): room for 16 layer-directions x 2 phases.
_GRAPH_CACHE_SIZE = 32
# Entries of one key alive at once: forward passes of one layer before their backward.
ENTRIES_PER_KEY = 4
# Held bytes past which idle entries are dropped, least recently used first. A training
# loop's working set (each layer's outputs and stash, the arenas) is held between steps
# by design; the bound is for entries of shapes no longer run.
GRAPH_CACHE_BYTES = int(os.environ.get("MIRRORGRAD_RNN_GRAPH_CACHE_MB", 1024)) << 20
# Workspace names whose buffers are never live at once share an arena: a forward's
# pre-activations are dead when its loop ends, a backward's gate gradients once the
# chunk's GEMMs have read them (an LSTM's, written over its recomputed pre-activations:
# "bwd.pre_dg"), and no loop runs between a loop and its own readers.
_ARENA_OF = {"pre": "gates", "bwd.dg": "gates", "bwd.pre_dg": "gates"}


@dataclass(kw_only=True, slots=True)
class Entry:
    """A captured step loop, the buffers it reads and writes, and those it hands out."""

    graph: Any  # torch.cuda.CUDAGraph: .replay()
    buffers: Any
    handed_out: tuple[Tensor, ...]
    idle_uses: tuple[int, ...]  # storage use counts when only the cache holds them

    reads_in_place: tuple[Tensor, ...] = ()  # views of other entries' handed-out buffers

    def idle(self) -> bool:
        """No tensor this entry handed out is referenced outside the cache."""
        uses = tuple(
            _compat.storage_use_count(t) - _READERS.get(_ptr(t), 0) for t in self.handed_out
        )
        return uses == self.idle_uses


_ENTRIES: OrderedDict[tuple, list[Entry]] = OrderedDict()
_WORKSPACE: dict[tuple, Tensor] = {}  # (config, name) -> a view of an arena
_ARENAS: dict[tuple, Tensor] = {}  # (device, arena name) -> bytes
_ARENA_ALONE: dict[tuple, int] = {}  # its storage use count while no view of it exists
_STATIC: dict[int, int] = {}  # data_ptr of a handed-out storage -> its nbytes
_READERS: dict[int, int] = {}  # data_ptr of a handed-out storage -> views entries hold
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_RECORDING: list[set[tuple]] = []  # the key sets of open recording() blocks
_CAPTURE_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mirrorgrad-rnn-capture")


def captures_by_size(elements: int) -> bool:
    """Whether a loop whose largest buffer has ``elements`` elements is captured when
    nothing asks otherwise."""
    return elements <= GRAPH_MAX_ELEMENTS


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


def _ptr(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def is_static(t: Tensor) -> bool:
    """``t`` lies in a buffer a captured loop handed out (its address is stable)."""
    return _ptr(t) in _STATIC


def reader(t: Tensor) -> Tensor:
    """``t`` as a tensor with no base: it holds its storage once and nothing else alive.
    (A view also keeps its base alive: under AOTAutograd a saved stash is a detached
    tensor whose view, kept by a backward entry, would keep the forward entry busy.)"""
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def acquire(
    key: tuple,
    device: torch.device,
    make_buffers: Callable[[], Any],
    loop: Callable[[Any], None],
    handed_out: Callable[[Any], tuple[Tensor, ...]],
    reads_in_place: tuple[Tensor, ...] = (),
    before_capture: Callable[[], None] | None = None,
) -> Entry | None:
    """An idle captured entry for ``key``, capturing a new one if all are busy; None
    when ENTRIES_PER_KEY are busy (the caller then runs the loop uncaptured).

    ``reads_in_place``: the ``reader``s of other entries' handed-out buffers that the new
    entry's buffers keep (they do not make those entries busy). ``before_capture``: called
    just before a new entry is captured, whose warm-up runs the loop once on the shared
    workspace (the caller saves what it still needs from there). The caller fills the
    entry's input buffers, then calls ``entry.graph.replay()``."""
    entries = _ENTRIES.setdefault(key, [])
    _ENTRIES.move_to_end(key)
    for keys in _RECORDING:
        keys.add(key)
    for entry in entries:
        if entry.idle():
            return entry
    if len(entries) >= ENTRIES_PER_KEY:
        return None
    if before_capture is not None:
        before_capture()
    entry = _capture(device, make_buffers(), loop, handed_out)
    entry.reads_in_place = tuple(t for t in reads_in_place if is_static(t))
    for t in entry.reads_in_place:
        _READERS[_ptr(t)] = _READERS.get(_ptr(t), 0) + 1
    entries.append(entry)
    while len(_ENTRIES) > _GRAPH_CACHE_SIZE:
        _forget(_ENTRIES.popitem(last=False)[1])
    if held_bytes() > GRAPH_CACHE_BYTES:
        _drop_idle(keep=key)
    return entry


def _drop_idle(keep: tuple) -> None:
    """Drop idle entries, least recently used first, until the cache holds at most
    GRAPH_CACHE_BYTES (or nothing idle is left but ``keep``'s), then the workspace of
    configs no entry uses."""
    for key in list(_ENTRIES):
        if key == keep or held_bytes() <= GRAPH_CACHE_BYTES:
            continue
        busy = [e for e in _ENTRIES[key] if not e.idle()]
        _forget([e for e in _ENTRIES[key] if e.idle()])
        if busy:
            _ENTRIES[key] = busy
        else:
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
        _forget(_ENTRIES.pop(key, []))
    _drop_unused_workspace()


def _record(device: torch.device, buffers: Any, loop: Callable[[Any], None]):
    """A CUDA Graph of ``loop(buffers)`` (tests stand in a replaying loop on CPU)."""
    stream = _SIDE_STREAMS.setdefault(device, torch.cuda.Stream(device))
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        loop(buffers)  # warm-up: compiles the kernels, creates the cuBLAS workspace
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        loop(buffers)
    return graph


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


def _capture(device, buffers, loop, handed_out) -> Entry:
    graph = _on_capture_thread(device, buffers, loop)
    out = tuple(handed_out(buffers))
    for t in out:
        _STATIC[_ptr(t)] = t.untyped_storage().nbytes()
    idle_uses = tuple(_compat.storage_use_count(t) for t in out)
    return Entry(graph=graph, buffers=buffers, handed_out=out, idle_uses=idle_uses)


def _forget(entries: list[Entry]) -> None:
    for entry in entries:
        for t in entry.handed_out:
            _STATIC.pop(_ptr(t), None)
        for t in entry.reads_in_place:
            _READERS[_ptr(t)] -= 1


def held() -> list[Tensor]:
    """One tensor per storage the cache holds: entries' handed-out buffers and those they
    read in place (a forward entry's, kept alive by a backward entry), workspace."""
    tensors = [
        t
        for entries in _ENTRIES.values()
        for e in entries
        for t in (*e.handed_out, *e.reads_in_place)
    ]
    workspace = (*_WORKSPACE.values(), *_ARENAS.values())
    return list({_ptr(t): t for t in (*tensors, *workspace)}.values())


def held_bytes() -> int:
    """Bytes the cache holds: handed-out buffers of every entry (and those read in place),
    and the workspace."""
    return sum(t.untyped_storage().nbytes() for t in held())


def clear_graphs() -> None:
    """Drop every captured step loop, its buffers and the shared workspace."""
    for entries in _ENTRIES.values():
        _forget(entries)
    _ENTRIES.clear()
    _WORKSPACE.clear()
    _ARENAS.clear()
    _ARENA_ALONE.clear()
    _READERS.clear()
