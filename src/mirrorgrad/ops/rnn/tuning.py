"""The tuning knobs of the RNN op's Triton kernels: one frozen dataclass per kernel family,
its defaults the ones measured best (docs/rnn-op.md).

The code that launches reads its family's active knobs (``active(StepTuning)``); tests
and benchmarks run others for a block::

    with tuned(PersistentTuning(split_k=4)):
        ...

or hand them to the function that takes them (``persistent_plan.plan(..., tuning=...)``).
The active knobs are one module-wide setting, not a context variable: autograd runs a
CUDA backward on a thread of its own, which must see the knobs its forward saw.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeVar


@dataclass(frozen=True, kw_only=True)
class StepTuning:
    """The split Triton kernels (kernels.py: one launch per step), and the backward's
    chunks of steps, which the persistent layer runs too."""

    # Batch sizes up to this run the hidden GEMM inside the step kernel. NOTE: it lost to
    # cuBLAS + pointwise at every size measured (L2 H650 B20 T35 fp32: 3.40 ms against
    # 2.89 ms), so it runs only when asked for.
    fused_max_batch: int = 0
    # Rows (steps x batch) per backward chunk: bounds the gate gradients whatever T is.
    # NOTE: chunks of 8 steps at batch 256 cost 20% (L2 H512 T35 fp32: 3.86 ms against 3.15).
    bwd_chunk_rows: int = 8192


@dataclass(frozen=True, kw_only=True)
class PersistentTuning:
    """The persistent kernel (persistent.py: one launch per layer-direction). Defaults
    from the H100 runs (docs/rnn-op.md, "Where a persistent step's time goes"): the
    probe put the hidden GEMM's phase at 60-75% of every step, the backward's worst
    (10-18 us of 14-22); the backward's knobs below (K slices, deeper chunks, gathered
    loads, 8 warps) took its step from 14.4-21.8 us to 7.8-13.6 us, while the same for
    the forward made it slower (6.3-8.8 us to 10.3-15.0 us), so the forward keeps the
    earlier layout."""

    # W_hh's slice per program is kept resident up to this many bytes, else streamed.
    resident_bytes: int = 160 * 1024
    # Hidden units per program (all gates of them); doubled until the grid fits the SMs,
    # up to max_bn (beyond: the split kernels run the layer).
    block_n: int = 16
    max_bn: int = 64
    # Streamed forward: 4 warps (2.47 ms against 2.75 at 8, LSTM 2x650 B20 fp32 layer
    # level), pipelined over num_stages, 64-deep K chunks in one MMA chain.
    num_warps: int = 4
    num_stages: int = 3
    # Resident W: forward 16 warps, backward 8.
    resident_warps: tuple[int, int] = (16, 8)
    # A resident layout that ptxas spills (more than spill_words 32-bit words per thread)
    # runs streamed, unless allow_spills (benchmarks).
    spill_words: int = 16
    allow_spills: bool = False
    # Streamed W: K depth per load; each K chunk in split_k slices of block_k / split_k
    # (>= 16), one MMA chain each (a batched dot), summed after the loop.
    block_k: int = 64
    split_k: int = 1
    # The backward's K is G*H (4x the forward's for an LSTM): its own chunk depth, slices
    # and warps (8: one slice pair each; 16 KiB of W a pipeline stage at fp32).
    bwd_block_k: int = 256
    bwd_split_k: int = 8
    bwd_num_warps: int = 8
    # Resident W: the hidden GEMM's K in this many slices (forward: H, fused gates only;
    # backward: each part's rows), a batched dot with one MMA chain per slice spread over
    # the warps, summed after (1: one chain over the whole K).
    resident_split: int = 1
    bwd_resident_split: int = 8
    # Backward: each step's other inputs (stashed gates, cells, dh, dy) in one load per
    # dtype instead of one per tile: Triton converts each loaded tile to the MMA layout
    # through shared memory right after its load, which waits for it, so separate loads
    # are round trips one after another (ptxas for sm_90: 8 in the LSTM backward, bf16
    # resident; the forward's loads are issued together).
    gather_loads: bool = True
    # Resident backward with K slices: shared memory for W and one part's dG rows (the
    # H100 has 227 KiB per program; the rest is the reductions' scratch).
    bwd_part_bytes: int = 200 * 1024
    # Streamed W: the most batch rows per tile (each tile re-reads the W slice, so one
    # tile for the whole batch where it fits; resident tiles stay at 16 rows since the
    # whole-K h tile lives in registers beside W).
    max_bb: int = 64
    # The barrier polls with loads and acquires once (True), or polls with acquiring
    # atomics (False: arrival + wait 1.3 us against 1.6 polling with loads).
    spin_load: bool = False
    # Forward: one [BB, 4*BN] dot for all gates, split after (more warps share the work).
    # NOTE: ptxas for sm_90: fused, the resident forward stops spilling (LSTM bf16 H 650:
    # 0 bytes against 1.5-4 KB per thread; fp32 H 512: 32 B against 11 KB).
    fuse_gates: bool = True


Tuning = TypeVar("Tuning", StepTuning, PersistentTuning)

_ACTIVE: dict[type, StepTuning | PersistentTuning] = {
    StepTuning: StepTuning(),
    PersistentTuning: PersistentTuning(),
}


def active(family: type[Tuning]) -> Tuning:
    """The knobs of ``family`` (``StepTuning``, ``PersistentTuning``) that launches use now."""
    return _ACTIVE[family]


@contextlib.contextmanager
def tuned(knobs: Tuning) -> Iterator[Tuning]:
    """Launches in the block use ``knobs`` for their family (the previous ones after)."""
    family = type(knobs)
    if family not in _ACTIVE:
        raise TypeError(f"tuned() takes a StepTuning or PersistentTuning, got {family.__name__}")
    before = _ACTIVE[family]
    _ACTIVE[family] = knobs
    try:
        yield knobs
    finally:
        _ACTIVE[family] = before
