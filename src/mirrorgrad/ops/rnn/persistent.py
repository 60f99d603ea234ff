"""Persistent RNN layer: one Triton launch runs all T steps of a layer and direction.

The same per-layer contract as ``kernels.py`` (``reference.py``'s docstring), same
saved layout, dropout and workspace, so the op can run ``impl="persistent"`` where it
runs ``"triton"``. Per layer and direction:

* forward: the input GEMM ``X @ W_ih^T + b`` over all steps (cuBLAS, as kernels.py),
  then ONE launch of ``_fwd_kernel``: program p owns hidden units [p*BN, (p+1)*BN)
  (all G gates of them), computes ``h_{t-1} @ W_hh[its rows]^T`` and the fused cell
  update for every batch row, writes its slice of h_t, then waits at a grid-wide
  barrier before step t+1 reads the whole h_t.
* backward: chunks of steps as kernels.py; per chunk ONE launch of ``_bwd_kernel``:
  program p owns the columns [p*BN, (p+1)*BN) of dh, computes ``dG_{t+1} @ W_hh[:, its
  columns]`` and the gate gradients of its units, barrier per step; dW_ih, dW_hh, db
  and dx are GEMMs over the stored dG after the launch (kernels.py's helpers).

W_hh's slice per program is **resident** (loaded once before the time loop; Triton keeps
it in shared memory and loads MMA operands from there each step) where it is at most
RESIDENT_BYTES and compiles without spills, else **streamed** from L2 each step in
BK-deep chunks. Batch tiles are spread over groups of programs (grid axis 1), each group
with its own barrier. h_{t-1} and dG_{t+1} come from L2: Triton's pipeliner turns
their loads into ``cp.async.ca`` (through L1, which is not coherent) whatever their
cache modifier, so every step writes them to addresses of their own (h: [T+1, B, H]
workspace instead of a ping-pong pair; dG: [T, B, G*H] as stored for the weight GEMMs)
with rows padded to whole 128-byte lines: an L1 line is only ever fetched after its
step's barrier, complete, and never written again in the launch. The barrier is a
monotonic int32 counter: ``atomic_add(+1, release)`` after the step's stores, a poll
with volatile loads, then one acquiring read (``grid_barrier``).

A spin barrier needs every program resident at once: the grid is capped at the SM
count (one program per SM), else the layer runs kernels.py (``plan`` returns None).
Under ``TRITON_INTERPRET=1`` programs run one after another, so the grid is one
program owning all units (same arithmetic, the barrier trivially met).
On CUDA each layer-direction's forward and backward (fills, GEMMs, the launch) is one
body captured in a CUDA Graph and replayed through cuda_graphs.py, as kernels.py's step
loops are: the host work of a call is one replay (the layer functions' section below).
Not covered (delegated to kernels.py): projections (kernels.py refuses them too), an
empty batch, and hidden sizes whose grid would exceed the SMs at BN <= MAX_BN.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch import Tensor

from mirrorgrad.ops.rnn import cuda_graphs, kernels
from mirrorgrad.ops.rnn.cell_modes import GATES, MODES
from mirrorgrad.ops.rnn.kernels import _sigmoid, _tanh, _tile

# The contract's parts that are kernels.py's own: same saved tensors, same workspace,
# same dropout masks (the same Philox kernel from the same seed and offset).
saved_layout = kernels.saved_layout
supports = kernels.supports
dropout = kernels.dropout

# Rows that other programs read during a launch (h_t, dG_t) start on a 128-byte L1 line.
_LINE_BYTES = 128


def _padded(n: int, dtype: torch.dtype) -> int:
    """``n`` elements rounded up to whole L1 lines."""
    per_line = _LINE_BYTES // dtype.itemsize
    return -(-n // per_line) * per_line


def workspace_bytes(
    mode: str, memory: str, T: int, B: int, H: int, dtype: torch.dtype, *, backward: bool,
    captured: bool = False,
) -> int:  # fmt: skip
    """Peak bytes one ``layer_forward`` (or ``layer_backward``) allocates beyond its inputs
    and outputs ([B, H]-sized buffers left out): forward the pre-activations where they
    are not the stash and every step's h ([T+1, B, H] with padded rows); backward per
    chunk the padded gate gradients and the recomputed pre-activations. ``captured``:
    the layer runs as a CUDA Graph, whose buffers are arenas held between calls
    (``held_arenas``), not allocated per call."""
    if captured:
        return 0
    d, gh = dtype.itemsize, GATES[mode] * H
    if not backward:
        pre = 0 if mode == "lstm" and memory == "stash" else T * B * gh * d
        return pre + (T + 1) * B * _padded(H, dtype) * d
    rows = kernels._chunk_steps(T, B) * B
    dg = rows * _padded(gh, dtype) * d * (2 if mode == "gru" else 1)
    recompute = memory == "recompute" and not mode.startswith("rnn")
    width = 4 * H if mode == "gru" else gh
    return dg + (rows * width * d if recompute else 0)


RESIDENT_BYTES = int(os.environ.get("MIRRORGRAD_RNN_PERSISTENT_RESIDENT_BYTES", 160 * 1024))
# Hidden units per program (all gates of them); doubled until the grid fits the SMs.
BLOCK_N = int(os.environ.get("MIRRORGRAD_RNN_PERSISTENT_BN", 16))
MAX_BN = 64
# Defaults from the H100 windows (docs/rnn-op.md, "Where a persistent step's time
# goes"): the probe (15:41 UTC window) put the hidden GEMM's phase at 60-75% of every
# step, the backward's worst (10-18 us of 14-22); the backward's knobs below (K slices,
# deeper chunks, gathered loads, 8 warps) took its step from 14.4-21.8 us to 7.8-13.6
# us, while the same for the forward made it slower (6.3-8.8 us to 10.3-15.0 us), so the
# forward keeps window 2's layout.
# Streamed forward: 4 warps (window 2 sweep: 2.47 ms against 2.75 at 8, LSTM 2x650 B20
# fp32 layer level), 64-deep K chunks in one MMA chain.
NUM_WARPS = int(os.environ.get("MIRRORGRAD_RNN_PERSISTENT_WARPS", 4))
NUM_STAGES = int(os.environ.get("MIRRORGRAD_RNN_PERSISTENT_STAGES", 3))
# Resident W: forward 16 warps, backward 8.
RESIDENT_WARPS = (16, 8)
# A resident layout that ptxas spills (more than SPILL_WORDS 32-bit words per thread)
# runs streamed, unless ALLOW_SPILLS (benchmarks).
SPILL_WORDS = 16
ALLOW_SPILLS = False
# Streamed W: K depth per load, and the most batch rows per tile (each tile re-reads the
# W slice, so one tile for the whole batch where it fits; resident tiles stay at 16 rows
# since the whole-K h tile lives in registers beside W).
BLOCK_K = int(os.environ.get("MIRRORGRAD_RNN_PERSISTENT_BK", 64))
# Streamed: each K chunk in SPLIT_K slices of BLOCK_K / SPLIT_K (>= 16), one MMA chain
# each (a batched dot), summed after the loop: chains SPLIT_K times shorter.
SPLIT_K = int(os.environ.get("MIRRORGRAD_RNN_PERSISTENT_SPLIT_K", 1))
# The backward's K is G*H (4x the forward's for an LSTM): its own chunk depth, slices and
# warps (8: one slice pair each; 16 KiB of W a pipeline stage at fp32).
BWD_BLOCK_K = int(os.environ.get("MIRRORGRAD_RNN_PERSISTENT_BWD_BK", 256))
BWD_SPLIT_K = int(os.environ.get("MIRRORGRAD_RNN_PERSISTENT_BWD_SPLIT_K", 8))
BWD_NUM_WARPS = int(os.environ.get("MIRRORGRAD_RNN_PERSISTENT_BWD_WARPS", 8))
# Resident W: the hidden GEMM's K in this many slices (forward: H, fused gates only;
# backward: each part's rows), a batched dot with one MMA chain per slice spread over
# the warps, summed after (1: one chain over the whole K).
RESIDENT_SPLIT = int(os.environ.get("MIRRORGRAD_RNN_PERSISTENT_RESIDENT_SPLIT", 1))
BWD_RESIDENT_SPLIT = int(os.environ.get("MIRRORGRAD_RNN_PERSISTENT_BWD_RESIDENT_SPLIT", 8))
# Backward: each step's other inputs (stashed gates, cells, dh, dy) in one load per dtype
# instead of one per tile: Triton converts each loaded tile to the MMA layout through
# shared memory right after its load, which waits for it, so separate loads are round
# trips one after another (ptxas for sm_90: 8 in the LSTM backward, bf16 resident; the
# forward's loads are issued together).
GATHER_LOADS = os.environ.get("MIRRORGRAD_RNN_PERSISTENT_GATHER", "1") == "1"
# Resident backward with K slices: shared memory for W and one part's dG rows (the H100
# has 227 KiB per program; the rest is the reductions' scratch).
BWD_PART_BYTES = 200 * 1024
MAX_BB = int(os.environ.get("MIRRORGRAD_RNN_PERSISTENT_MAX_BB", 64))
# The barrier polls with acquiring atomics (no separate acquire after the last poll):
# the 15:41 UTC window: arrival + wait 1.3 us against 1.6 polling with loads ("load").
SPIN_LOAD = os.environ.get("MIRRORGRAD_RNN_PERSISTENT_SPIN", "atomic") == "load"
# Forward: one [BB, 4*BN] dot for all gates, split after (more warps share the work).
# NOTE: ptxas for sm_90: fused, the resident forward stops spilling (LSTM bf16 H 650:
# 0 bytes against 1.5-4 KB per thread; fp32 H 512: 32 B against 11 KB).
FUSE_GATES = os.environ.get("MIRRORGRAD_RNN_PERSISTENT_FUSE_GATES", "1") == "1"
_MODE_ID = {"lstm": 0, "gru": 1, "rnn_tanh": 2, "rnn_relu": 3}


@triton.jit
def grid_barrier(count_ptr, target, SPIN_LOAD: tl.constexpr, probe=None, PROBE: tl.constexpr = 0):
    """Wait until ``target`` arrivals: every program's stores before are visible after.
    PROBE: stamp the arrival in ``probe`` (the step's phase stamps)."""
    arrived = _arrive(count_ptr)
    if PROBE:
        _probe_arrived(probe, arrived)
    _await(count_ptr, target, SPIN_LOAD)


@triton.jit
def _arrive(count_ptr):
    """This program's arrival at the barrier (after its stores); returns the count before."""
    tl.debug_barrier()  # the whole program's stores are done before it arrives
    return tl.atomic_add(count_ptr, 1, sem="release")


@triton.jit
def _await(count_ptr, target, SPIN_LOAD: tl.constexpr):
    """Spin until ``target`` arrivals. SPIN_LOAD: poll with volatile loads and acquire
    once at the end (fewer atomics on the counter's L2 line), else poll with acquiring
    atomics."""
    if SPIN_LOAD:
        seen = tl.load(count_ptr, volatile=True)
        while seen < target:
            seen = tl.load(count_ptr, volatile=True)
    # The acquire (once, after polling with loads): a loop on its result keeps the
    # compiler from dropping it as unused (it did, checked in the PTX).
    seen = tl.atomic_add(count_ptr, 0, sem="acquire")
    while seen < target:
        seen = tl.atomic_add(count_ptr, 0, sem="acquire")
    tl.debug_barrier()  # no thread reads the next step before the acquire


# ---- PROBE: per program and step, when each phase ends (GPU only, benchmarks) --------
# probe_ptr: int64 [groups, programs, T, STAMPS]: 0 %globaltimer (ns) at the step's start,
# then %clock64 (SM cycles): 1 at its start, 2 once its inputs are loaded, 3 once the
# hidden GEMM's result is there, 4 once the new state is computed (its stores issued),
# 5 once it arrived at the barrier (stores visible, release done); the wait is the next
# step's start minus the arrival. PROBE 1 records 0, 1, 5 (work against wait, nearly
# free); 2 adds 3 and 4; 3 adds 2, which holds the dot's loads until the inputs are
# there (one more L2 round trip). A stamp "once x is there" reads the clock in every
# thread after its elements of x (a predicate on x orders the read after them; a NaN
# element reads 0) and keeps the latest: a cross-warp reduction, a CTA barrier, each.
STAMPS = tl.constexpr(6)


@triton.jit
def _clock_after(x):
    """%clock64 once every element of the 2-D tensor x is available, the latest thread's."""
    c = tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.eq.f32 p, $1, $1; @p mov.u64 $0, %clock64; @!p mov.u64 $0, 0; }",
        "=l,f", [x.to(tl.float32)], dtype=tl.int64, is_pure=False, pack=1,
    )  # fmt: skip
    return tl.max(tl.max(c, axis=1), axis=0)


@triton.jit
def _probe_start(probe):
    """The step's first stamps: %globaltimer and %clock64."""
    ns = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                   is_pure=False, pack=1)  # fmt: skip
    cycles = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64,
                                       is_pure=False, pack=1)  # fmt: skip
    tl.store(probe, ns)
    tl.store(probe + 1, cycles)


@triton.jit
def _probe_arrived(probe, old):
    """Stamp 5 after the arrival's atomic (``old``: its result) returned."""
    tl.store(probe + 5, _clock_after(tl.full([1, 1], 0.0, tl.float32) + old.to(tl.float32)))


@triton.jit
def _rows(ptr, rb, mb, stride, offset, k0, K: tl.constexpr, H: tl.constexpr):
    """[BB, K] tile ``ptr[rb, offset + k0 + k]`` (k0 + k < H) from L2: other programs
    wrote it during this launch, so an L1 line could be stale."""
    rk = k0 + tl.arange(0, K)
    return tl.load(
        ptr + rb[:, None] * stride + offset + rk[None, :],
        mask=mb[:, None] & (rk < H)[None, :],
        other=0.0,
        cache_modifier=".cg",
    )


@triton.jit
def _split_rows(ptr, rb, mb, stride, k0, S: tl.constexpr, SS: tl.constexpr, KS: tl.constexpr,
                H: tl.constexpr):  # fmt: skip
    """[S, BB, KS] tile ``ptr[rb, k0 + s*SS + j]`` (< H): ``_rows`` with K in S slices
    SS apart."""
    rk = k0 + tl.arange(0, S)[:, None, None] * SS + tl.arange(0, KS)[None, None, :]
    return tl.load(
        ptr + rb[None, :, None] * stride + rk,
        mask=mb[None, :, None] & (rk < H),
        other=0.0,
        cache_modifier=".cg",
    )


@triton.jit
def _split_wtile(w_ptr, sk, sn, rn, mn, k0, S: tl.constexpr, SS: tl.constexpr,
                 KS: tl.constexpr, H: tl.constexpr):  # fmt: skip
    """[S, KS, N] tile ``w_ptr[(k0 + s*SS + j) * sk + rn * sn]``: ``_wtile`` in S slices."""
    rk = k0 + tl.arange(0, S)[:, None, None] * SS + tl.arange(0, KS)[None, :, None]
    return tl.load(
        w_ptr + rk * sk + rn[None, None, :] * sn,
        mask=(rk < H) & mn[None, None, :],
        other=0.0,
    )


@triton.jit
def _slice_tiles(w_ptr, sk, sn, rn, mn, K: tl.constexpr, S: tl.constexpr, KA: tl.constexpr,
                 KB: tl.constexpr):  # fmt: skip
    """Resident W^T ([K, N] through (sk, sn)) in S slices of KA + KB rows (K's rows in
    order, zero past K), each slice as two pieces: ([S, KA, N], [S, KB, N] or 0)."""
    wa = _split_wtile(w_ptr, sk, sn, rn, mn, 0, S, KA + KB, KA, K)
    wb = 0
    if KB > 0:
        wb = _split_wtile(w_ptr, sk, sn, rn, mn, KA, S, KA + KB, KB, K)
    return wa, wb


@triton.jit
def _sliced_dot(a_ptr, rb, mb, stride, wa, wb, K: tl.constexpr, S: tl.constexpr,
                KA: tl.constexpr, KB: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """A[rb, :K] @ W with W as ``_slice_tiles``' S slices: a batched dot, one MMA chain
    per slice (K/S deep instead of K; the slices spread over the warps), summed after."""
    aa, ab = _slice_rows(a_ptr, rb, mb, stride, K, S, KA, KB)
    return _sliced_mma(aa, ab, wa, wb, KB, PREC)


@triton.jit
def _slice_rows(a_ptr, rb, mb, stride, K: tl.constexpr, S: tl.constexpr, KA: tl.constexpr,
                KB: tl.constexpr):  # fmt: skip
    """A[rb, :K] as ``_slice_tiles``' slices: ([S, BB, KA], [S, BB, KB] or 0)."""
    aa = _split_rows(a_ptr, rb, mb, stride, 0, S, KA + KB, KA, K)
    ab = 0
    if KB > 0:
        ab = _split_rows(a_ptr, rb, mb, stride, KA, S, KA + KB, KB, K)
    return aa, ab


@triton.jit
def _sliced_mma(aa, ab, wa, wb, KB: tl.constexpr, PREC: tl.constexpr):
    """``_sliced_dot`` of rows already loaded (``_slice_rows``)."""
    accs = _mma(aa, wa, PREC)
    if KB > 0:
        accs += _mma(ab, wb, PREC)
    return tl.sum(accs, axis=0)


@triton.jit
def _wtile(w_ptr, sk, sn, rn, mn, k0, K: tl.constexpr, H: tl.constexpr):
    """[K, BN] tile ``w_ptr[(k0 + k) * sk + rn * sn]`` (k0 + k < H, zero elsewhere)."""
    rk = k0 + tl.arange(0, K)
    return tl.load(
        w_ptr + rk[:, None] * sk + rn[None, :] * sn,
        mask=(rk < H)[:, None] & mn[None, :],
        other=0.0,
    )


@triton.jit
def _mma(a, b, PREC: tl.constexpr):
    """a @ b in fp32; PREC "upcast": 16-bit operands as fp32 (the interpreter's dot
    multiplies bf16 bit patterns as integers, Triton 3.6)."""
    if PREC == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _gate_tiles(w_ptr, sk, sn, rn, mn, H: tl.constexpr, G: tl.constexpr, KA: tl.constexpr,
                KB: tl.constexpr):  # fmt: skip
    """Each gate's [K, BN] block ``W_hh[g*H:(g+1)*H]`` viewed through (sk, sn), as two K
    pieces: (a0, b0, a1, b1, a2, b2, a3, b3), zero where the gate or piece is absent."""
    a0 = _wtile(w_ptr, sk, sn, rn, mn, 0, KA, H)
    b0, a1, b1, a2, b2, a3, b3 = 0, 0, 0, 0, 0, 0, 0
    if KB > 0:
        b0 = _wtile(w_ptr, sk, sn, rn, mn, KA, KB, H)
    if G >= 3:
        a1 = _wtile(w_ptr + H * H, sk, sn, rn, mn, 0, KA, H)
        a2 = _wtile(w_ptr + 2 * H * H, sk, sn, rn, mn, 0, KA, H)
        if KB > 0:
            b1 = _wtile(w_ptr + H * H, sk, sn, rn, mn, KA, KB, H)
            b2 = _wtile(w_ptr + 2 * H * H, sk, sn, rn, mn, KA, KB, H)
    if G == 4:
        a3 = _wtile(w_ptr + 3 * H * H, sk, sn, rn, mn, 0, KA, H)
        if KB > 0:
            b3 = _wtile(w_ptr + 3 * H * H, sk, sn, rn, mn, KA, KB, H)
    return a0, b0, a1, b1, a2, b2, a3, b3


@triton.jit
def _resident_dot(a_ptr, rb, mb, stride, offset, wa, wb, H: tl.constexpr, KA: tl.constexpr,
                  KB: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """A[rb, offset : offset + H] @ W with W held as two K pieces (KA, then KB rows)."""
    acc = _mma(_rows(a_ptr, rb, mb, stride, offset, 0, KA, H), wa, PREC)
    if KB > 0:
        acc += _mma(_rows(a_ptr, rb, mb, stride, offset, KA, KB, H), wb, PREC)
    return acc


@triton.jit
def _split_gates(acc, BB: tl.constexpr, BN: tl.constexpr):
    """[BB, 4*BN] (gate-major columns) -> four [BB, BN] gates."""
    a = tl.permute(tl.reshape(acc, (BB, 4, BN)), (0, 2, 1))
    x0, x1 = tl.split(tl.reshape(a, (BB, BN, 2, 2)))  # gate 2i + j: j = 0 | j = 1
    g0, g2 = tl.split(x0)
    g1, g3 = tl.split(x1)
    return g0, g1, g2, g3


@triton.jit
def _fwd_kernel(
    pre_ptr,  # [T, B, G*H] input side (biases folded; gru: b_ih only)
    stash_ptr,  # [T, B, P] stash out (lstm stash: pre_ptr itself; gru: 4H)
    h_ptr,  # [T+1, B, HS]: h_{t-1} in h[t], h_t out to h[t+1] (rows padded: module doc)
    w_ptr,  # W_hh [G*H, H]
    bhh_ptr,  # gru: b_hh [3H]
    cells_ptr,  # lstm: [T+1, B, H] fp32
    y_ptr,  # [T, B, H]
    len_ptr,  # [B] int64
    count_ptr,  # int32 [groups], zero: the barriers' counters
    probe_ptr,  # PROBE: int64 [groups, programs, T, STAMPS] (``_probe_start``)
    T,
    B,
    clip_lo,
    clip_hi,
    H: tl.constexpr,
    HS: tl.constexpr,  # row stride of h_ptr
    MODE: tl.constexpr,  # 0 lstm, 1 gru, 2 rnn_tanh, 3 rnn_relu
    G: tl.constexpr,
    P: tl.constexpr,  # stash width per row
    HAS_LENGTHS: tl.constexpr,
    CLIP: tl.constexpr,
    WRITE_STASH: tl.constexpr,
    HAS_HB: tl.constexpr,
    PREC: tl.constexpr,
    RESIDENT: tl.constexpr,
    BB: tl.constexpr,
    BN: tl.constexpr,
    KA: tl.constexpr,
    KB: tl.constexpr,
    BK: tl.constexpr,
    SPIN_LOAD: tl.constexpr,
    PROBE: tl.constexpr,  # 0; 1: stamp start, arrival; 2: and the phases; 3: and loads
    SPLIT: tl.constexpr,  # streamed: K of each chunk in SPLIT slices, one MMA chain each
    RS: tl.constexpr,  # resident, fused gates: K in RS slices (KA + KB rows each), one chain each
    FUSE_GATES: tl.constexpr,  # one [BB, 4*BN] dot for all gates (G >= 3), split after
):
    # Axis 0: blocks of hidden units; axis 1: groups of batch tiles, independent of each
    # other (no state crosses batch rows): each group meets at its own barrier.
    programs = tl.num_programs(0)
    group, groups = tl.program_id(1), tl.num_programs(1)
    count_ptr += group
    rn = tl.program_id(0) * BN + tl.arange(0, BN)  # [BN] this program's hidden units
    mn = rn < H
    GH: tl.constexpr = G * H
    # Fused gates: column c of the [K, 4*BN] tile is W_hh row (c // BN) * H + unit.
    c4 = tl.arange(0, 4 * BN)
    r4 = (c4 // BN) * H + tl.program_id(0) * BN + c4 % BN
    m4 = ((c4 // BN) < G) & (tl.program_id(0) * BN + c4 % BN < H)
    # Resident W_hh^T: one [K, 4*BN] tile (fused gates), else one [K, BN] per gate
    # (W_hh[g*H + rn, k]); each as two K pieces.
    wa0, wb0, wa1, wb1, wa2, wb2, wa3, wb3 = 0, 0, 0, 0, 0, 0, 0, 0
    if RESIDENT and FUSE_GATES and RS > 1:
        wa0, wb0 = _slice_tiles(w_ptr, 1, H, r4, m4, H, RS, KA, KB)
    elif RESIDENT and FUSE_GATES:
        wa0 = _wtile(w_ptr, 1, H, r4, m4, 0, KA, H)
        if KB > 0:
            wb0 = _wtile(w_ptr, 1, H, r4, m4, KA, KB, H)
    elif RESIDENT:
        wa0, wb0, wa1, wb1, wa2, wb2, wa3, wb3 = _gate_tiles(w_ptr, 1, H, rn, mn, H, G, KA, KB)
    # gru: b_hh stays on the hidden side (r * (W_hn h + b_hn)); loaded once.
    bhr = tl.zeros([BN], dtype=tl.float32)
    bhz = tl.zeros([BN], dtype=tl.float32)
    bhn = tl.zeros([BN], dtype=tl.float32)
    if HAS_HB:
        bhr = tl.load(bhh_ptr + rn, mask=mn, other=0.0).to(tl.float32)
        bhz = tl.load(bhh_ptr + H + rn, mask=mn, other=0.0).to(tl.float32)
        bhn = tl.load(bhh_ptr + 2 * H + rn, mask=mn, other=0.0).to(tl.float32)
    t = tl.program_id(0) * 0  # a tensor from the start (the interpreter wants one)
    while t < T:
        t64 = t.to(tl.int64)
        probe = probe_ptr + ((group * programs + tl.program_id(0)) * T + t64) * STAMPS
        if PROBE:
            _probe_start(probe)
        h_in = h_ptr + t64 * B * HS
        h_out = h_in + B * HS
        b0 = group * BB
        while b0 < B:
            rb = (b0 + tl.arange(0, BB)).to(tl.int64)
            mb = rb < B
            x0, x1, x2, x3, c_old, h_old, valid = _fwd_inputs(
                pre_ptr + t64 * B * GH, cells_ptr + t64 * B * H, h_in, len_ptr, rb, mb, rn, mn,
                t, H, HS, MODE, G, HAS_LENGTHS,
            )  # fmt: skip
            if PROBE >= 3:
                tl.store(probe + 2, _clock_after(x0 + c_old + h_old.to(tl.float32)))
            if FUSE_GATES:
                accf = _fused_hidden(h_in, w_ptr, rb, mb, r4, m4, wa0, wb0, H, HS, KA, KB, BK,
                                     BB, BN, SPLIT, RS, RESIDENT, PREC)  # fmt: skip
                acc0, acc1, acc2, acc3 = _split_gates(accf, BB, BN)
            elif RESIDENT:
                acc1 = tl.zeros([BB, BN], dtype=tl.float32)
                acc2, acc3 = acc1, acc1
                acc0 = _resident_dot(h_in, rb, mb, HS, 0, wa0, wb0, H, KA, KB, PREC)
                if G >= 3:
                    acc1 = _resident_dot(h_in, rb, mb, HS, 0, wa1, wb1, H, KA, KB, PREC)
                    acc2 = _resident_dot(h_in, rb, mb, HS, 0, wa2, wb2, H, KA, KB, PREC)
                if G == 4:
                    acc3 = _resident_dot(h_in, rb, mb, HS, 0, wa3, wb3, H, KA, KB, PREC)
            else:
                acc0 = tl.zeros([BB, BN], dtype=tl.float32)
                acc1, acc2, acc3 = acc0, acc0, acc0
                for k0 in range(0, H, BK):
                    hk = _rows(h_in, rb, mb, HS, 0, k0, BK, H)
                    acc0 += _mma(hk, _wtile(w_ptr, 1, H, rn, mn, k0, BK, H), PREC)
                    if G >= 3:
                        w1 = _wtile(w_ptr + H * H, 1, H, rn, mn, k0, BK, H)
                        w2 = _wtile(w_ptr + 2 * H * H, 1, H, rn, mn, k0, BK, H)
                        acc1 += _mma(hk, w1, PREC)
                        acc2 += _mma(hk, w2, PREC)
                    if G == 4:
                        w3 = _wtile(w_ptr + 3 * H * H, 1, H, rn, mn, k0, BK, H)
                        acc3 += _mma(hk, w3, PREC)
            if PROBE >= 2:
                tl.store(probe + 3, _clock_after(acc0 + acc1 + acc2 + acc3))
            h_new = _fwd_update(
                stash_ptr + t64 * B * P, h_out, cells_ptr + t64 * B * H, y_ptr + t64 * B * H,
                x0, x1, x2, x3, acc0, acc1, acc2, acc3, c_old, h_old, valid, bhr, bhz, bhn,
                rb, mb, rn, mn, B, clip_lo, clip_hi, H, HS, MODE, G, CLIP, WRITE_STASH,
            )  # fmt: skip
            if PROBE >= 2:
                tl.store(probe + 4, _clock_after(h_new))
            b0 += BB * groups
        t += 1
        grid_barrier(count_ptr, t * programs, SPIN_LOAD, probe, PROBE)


@triton.jit
def _fused_hidden(h_in, w_ptr, rb, mb, r4, m4, wa, wb, H: tl.constexpr, HS: tl.constexpr,
                  KA: tl.constexpr, KB: tl.constexpr, BK: tl.constexpr, BB: tl.constexpr,
                  BN: tl.constexpr, SPLIT: tl.constexpr, RS: tl.constexpr,
                  RESIDENT: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """h_{t-1}[rb] @ W_hh[r4]^T: [BB, 4*BN], every gate in one dot (resident W in two K
    pieces or in RS slices of two pieces, or streamed in BK chunks, optionally in SPLIT
    independent chains)."""
    if RESIDENT and RS > 1:
        acc = _sliced_dot(h_in, rb, mb, HS, wa, wb, H, RS, KA, KB, PREC)
    elif RESIDENT:
        acc = _resident_dot(h_in, rb, mb, HS, 0, wa, wb, H, KA, KB, PREC)
    elif SPLIT > 1:  # a batched dot over the slices, summed after
        ks: tl.constexpr = BK // SPLIT
        accs = tl.zeros([SPLIT, BB, 4 * BN], dtype=tl.float32)
        for k0 in range(0, H, BK):
            hk = _split_rows(h_in, rb, mb, HS, k0, SPLIT, ks, ks, H)
            accs += _mma(hk, _split_wtile(w_ptr, 1, H, r4, m4, k0, SPLIT, ks, ks, H), PREC)
        acc = tl.sum(accs, axis=0)
    else:
        acc = tl.zeros([BB, 4 * BN], dtype=tl.float32)
        for k0 in range(0, H, BK):
            hk = _rows(h_in, rb, mb, HS, 0, k0, BK, H)
            acc += _mma(hk, _wtile(w_ptr, 1, H, r4, m4, k0, BK, H), PREC)
    return acc


@triton.jit
def _fwd_inputs(pre_ptr, cell_ptr, h_in, len_ptr, rb, mb, rn, mn, t, H: tl.constexpr,
                HS: tl.constexpr, MODE: tl.constexpr, G: tl.constexpr,
                HAS_LENGTHS: tl.constexpr):  # fmt: skip
    """What step t's update of one [BB, BN] tile reads besides the hidden GEMM: loaded
    before it, so that their latency hides behind the K loop (ptxas for sm_90 issues
    these loads together, unlike the backward's: ``_bwd_gathered``). Returns the
    input-side pre-activations of the G gates (zeros beyond), c_{t-1} (lstm), h_{t-1},
    valid."""
    mask = mb[:, None] & mn[None, :]
    valid = mask
    if HAS_LENGTHS:
        valid = mask & (t < tl.load(len_ptr + rb, mask=mb, other=0))[:, None]
    h_old = tl.load(h_in + rb[:, None] * HS + rn[None, :], mask=mask, other=0.0)
    x0 = _tile(pre_ptr, rb, rn, mask, G * H, 0)
    x1 = tl.zeros_like(x0)
    x2 = tl.zeros_like(x0)
    x3 = tl.zeros_like(x0)
    c_old = tl.zeros_like(x0)
    if G >= 3:
        x1 = _tile(pre_ptr, rb, rn, mask, G * H, H)
        x2 = _tile(pre_ptr, rb, rn, mask, G * H, 2 * H)
    if G == 4:
        x3 = _tile(pre_ptr, rb, rn, mask, G * H, 3 * H)
    if MODE == 0:
        c_old = tl.load(cell_ptr + rb[:, None] * H + rn[None, :], mask=mask, other=0.0)
    return x0, x1, x2, x3, c_old, h_old, valid


@triton.jit
def _fwd_update(stash_ptr, h_out, cell_ptr, y_ptr, x0, x1, x2, x3, acc0, acc1, acc2, acc3,
                c_old, h_old, valid, bhr, bhz, bhn, rb, mb, rn, mn, B, clip_lo, clip_hi,
                H: tl.constexpr, HS: tl.constexpr, MODE: tl.constexpr, G: tl.constexpr,
                CLIP: tl.constexpr, WRITE_STASH: tl.constexpr):  # fmt: skip
    """Gates and state update of one [BB, BN] tile of step t (kernels.py's formulas):
    x* the input side, acc* the hidden side of each gate, bh* gru's hidden biases.
    Returns the new h (stored)."""
    mask = mb[:, None] & mn[None, :]
    GH: tl.constexpr = G * H
    idx = rb[:, None] * H + rn[None, :]
    sty = stash_ptr.dtype.element_ty
    if MODE == 0:
        p_i, p_f, p_g, p_o = x0 + acc0, x1 + acc1, x2 + acc2, x3 + acc3
        if WRITE_STASH:
            srow = stash_ptr + rb[:, None] * GH + rn[None, :]
            tl.store(srow, p_i.to(sty), mask=mask)
            tl.store(srow + H, p_f.to(sty), mask=mask)
            tl.store(srow + 2 * H, p_g.to(sty), mask=mask)
            tl.store(srow + 3 * H, p_o.to(sty), mask=mask)
        c = _sigmoid(p_f) * c_old + _sigmoid(p_i) * _tanh(p_g)
        if CLIP:
            c = tl.minimum(tl.maximum(c, clip_lo), clip_hi)
        h = _sigmoid(p_o) * _tanh(c)
        tl.store(cell_ptr + B * H + idx, tl.where(valid, c, c_old), mask=mask)
    elif MODE == 1:
        hr, hz, hn = acc0 + bhr[None, :], acc1 + bhz[None, :], acc2 + bhn[None, :]
        r_pre = x0 + hr
        z_pre = x1 + hz
        r = _sigmoid(r_pre)
        z = _sigmoid(z_pre)
        n = _tanh(x2 + r * hn)
        h = (1.0 - z) * n + z * h_old.to(tl.float32)
        if WRITE_STASH:
            srow = stash_ptr + rb[:, None] * 4 * H + rn[None, :]
            tl.store(srow, r_pre.to(sty), mask=mask)
            tl.store(srow + H, z_pre.to(sty), mask=mask)
            tl.store(srow + 2 * H, x2.to(sty), mask=mask)
            tl.store(srow + 3 * H, hn.to(sty), mask=mask)
    elif MODE == 2:
        h = _tanh(x0 + acc0)
    else:
        h = tl.maximum(x0 + acc0, 0.0)
    h = h.to(h_out.dtype.element_ty)
    tl.store(h_out + rb[:, None] * HS + rn[None, :], tl.where(valid, h, h_old), mask=mask)
    tl.store(y_ptr + idx, tl.where(valid, h, 0.0), mask=mask)
    return h


@triton.jit
def _bwd_kernel(
    pre_ptr,  # [T, B, P] pre-activations (stash layout; rnn: unused)
    cells_ptr,  # lstm: [T+1, B, H] fp32
    h0_ptr,  # gru: [B, H] h_{-1}
    y_ptr,  # gru, rnn: [T, B, H]
    dy_ptr,  # [T, B, H]
    dh_ptr,  # [B, H] in: grad of h_{T-1}; out: direct part of grad of h_{-1} (add dG_0 @ W_hh)
    dc_ptr,  # lstm: [B, H] fp32 in: grad of c_{T-1}; out: grad of c_{-1}
    dg_ptr,  # [T, B, G*H] out (rows DS apart, padded): grad of the input-side pre-activations
    dgh_ptr,  # gru: [T, B, 3H] out (rows DS apart): grad of the hidden-side pre-activations
    w_ptr,  # W_hh [G*H, H]
    len_ptr,  # [B] int64
    count_ptr,  # int32 [groups], zero
    probe_ptr,  # PROBE: int64 [groups, programs, T, STAMPS]
    T,
    B,
    clip_lo,
    clip_hi,
    H: tl.constexpr,
    DS: tl.constexpr,  # row stride of dg_ptr and dgh_ptr
    MODE: tl.constexpr,
    G: tl.constexpr,
    P: tl.constexpr,
    HAS_LENGTHS: tl.constexpr,
    HAS_DY: tl.constexpr,
    CLIP: tl.constexpr,
    PREC: tl.constexpr,
    RESIDENT: tl.constexpr,
    BB: tl.constexpr,
    BN: tl.constexpr,
    KA: tl.constexpr,
    KB: tl.constexpr,
    BK: tl.constexpr,
    SPIN_LOAD: tl.constexpr,
    PROBE: tl.constexpr,  # 0; 1: stamp start, arrival; 2: and the phases; 3: and loads
    SPLIT: tl.constexpr,  # streamed: K of each chunk in SPLIT slices, one MMA chain each
    RS: tl.constexpr,  # resident: K (G*H) in parts of GP gates, each in RS slices (KA + KB
    GP: tl.constexpr,  # rows), one MMA chain per slice; the parts one after another
    GATHER: tl.constexpr,  # the step's other inputs in one load per dtype (``_bwd_inputs``)
):
    # Axis 0: blocks of hidden units; axis 1: groups of batch tiles, independent of each
    # other (no state crosses batch rows): each group meets at its own barrier.
    programs = tl.num_programs(0)
    group, groups = tl.program_id(1), tl.num_programs(1)
    count_ptr += group
    rn = tl.program_id(0) * BN + tl.arange(0, BN)  # [BN] this program's columns of dh
    mn = rn < H
    wa0, wb0, wa1, wb1, wa2, wb2, wa3, wb3 = 0, 0, 0, 0, 0, 0, 0, 0
    if RESIDENT:
        wa0, wb0, wa1, wb1, wa2, wb2, wa3, wb3 = _bwd_weights(w_ptr, rn, mn, H, G, RS, GP, KA,
                                                              KB)  # fmt: skip
    dgw_ptr = dgh_ptr if MODE == 1 else dg_ptr  # what flows back through W_hh
    s = tl.program_id(0) * 0
    while s < T:
        t = T - 1 - s
        t64 = t.to(tl.int64)
        probe = probe_ptr + ((group * programs + tl.program_id(0)) * T + s) * STAMPS
        if PROBE:
            _probe_start(probe)
        nxt = dgw_ptr + (t64 + 1) * B * DS  # dG_{t+1}: written by every program last step
        b0 = group * BB
        while b0 < B:
            rb = (b0 + tl.arange(0, BB)).to(tl.int64)
            mb = rb < B
            # Sliced: the first part's dG rows are loaded before the inputs, so that their
            # round trips overlap (each load's first use waits for it, module doc).
            a0, a1 = 0, 0
            if RESIDENT and RS > 1:
                a0, a1 = _slice_rows(nxt, rb, mb & (s > 0), DS, min(GP, G) * H, RS, KA, KB)
            x0, x1, x2, x3, s0, s1, s2, dh_own, dy, valid = _bwd_inputs(
                pre_ptr + t64 * B * P, cells_ptr + t64 * B * H, h0_ptr, y_ptr + t64 * B * H,
                dy_ptr + t64 * B * H, dh_ptr, dc_ptr, len_ptr, rb, mb, rn, mn, t, B, H, MODE,
                P, HAS_LENGTHS, HAS_DY, GATHER, BB, BN,
            )  # fmt: skip
            if PROBE >= 3:
                tl.store(probe + 2, _clock_after(x0 + s0 + dh_own + dy))
            acc = tl.zeros([BB, BN], dtype=tl.float32)
            if s > 0:
                if RESIDENT:
                    acc += _resident_back(nxt, rb, mb, a0, a1, wa0, wb0, wa1, wb1, wa2, wb2, wa3,
                                          wb3, H, G, DS, RS, GP, KA, KB, PREC)  # fmt: skip
                else:
                    acc += _streamed_back(nxt, w_ptr, rb, mb, rn, mn, G * H, H, DS, BK, BB, BN,
                                          SPLIT, PREC)  # fmt: skip
            if PROBE >= 2:
                tl.store(probe + 3, _clock_after(acc))
            dh_new = _bwd_update(
                dh_ptr, dc_ptr, dg_ptr + t64 * B * DS, dgh_ptr + t64 * B * DS,
                x0, x1, x2, x3, s0, s1, s2, dh_own, dy, valid, acc, rb, mb, rn, mn,
                clip_lo, clip_hi, H, DS, MODE, CLIP,
            )  # fmt: skip
            if PROBE >= 2:
                tl.store(probe + 4, _clock_after(dh_new))
            b0 += BB * groups
        s += 1
        grid_barrier(count_ptr, s * programs, SPIN_LOAD, probe, PROBE)


@triton.jit
def _bwd_weights(w_ptr, rn, mn, H: tl.constexpr, G: tl.constexpr, RS: tl.constexpr,
                 GP: tl.constexpr, KA: tl.constexpr, KB: tl.constexpr):  # fmt: skip
    """Resident W_hh[:, rn] of the backward: one block per gate, W_hh[g*H + k, rn], in two
    K pieces; or (RS > 1) its G*H rows in parts of GP gates, each part in RS slices."""
    if RS == 1:  # (one return: Triton builds every return of a function)
        wa0, wb0, wa1, wb1, wa2, wb2, wa3, wb3 = _gate_tiles(w_ptr, H, 1, rn, mn, H, G, KA, KB)
    else:
        wa1, wb1, wa2, wb2, wa3, wb3 = 0, 0, 0, 0, 0, 0
        wa0, wb0 = _slice_tiles(w_ptr, H, 1, rn, mn, min(GP, G) * H, RS, KA, KB)
        if GP < G:
            wa1, wb1 = _slice_tiles(w_ptr + GP * H * H, H, 1, rn, mn, min(GP, G - GP) * H, RS,
                                    KA, KB)  # fmt: skip
        if 2 * GP < G:
            wa2, wb2 = _slice_tiles(w_ptr + 2 * GP * H * H, H, 1, rn, mn, H, RS, KA, KB)
        if 3 * GP < G:
            wa3, wb3 = _slice_tiles(w_ptr + 3 * GP * H * H, H, 1, rn, mn, H, RS, KA, KB)
    return wa0, wb0, wa1, wb1, wa2, wb2, wa3, wb3


@triton.jit
def _resident_back(nxt, rb, mb, a0, a1, wa0, wb0, wa1, wb1, wa2, wb2, wa3, wb3,
                   H: tl.constexpr, G: tl.constexpr, DS: tl.constexpr, RS: tl.constexpr,
                   GP: tl.constexpr, KA: tl.constexpr, KB: tl.constexpr,
                   PREC: tl.constexpr):  # fmt: skip
    """dG_{t+1}[rb] @ W_hh[:, rn] with W resident (``_bwd_weights``): a gate at a time, or
    (RS > 1) a part at a time, the first part's rows (a0, a1) loaded by the caller."""
    if RS == 1:
        acc = _resident_dot(nxt, rb, mb, DS, 0, wa0, wb0, H, KA, KB, PREC)
        if G >= 3:
            acc += _resident_dot(nxt, rb, mb, DS, H, wa1, wb1, H, KA, KB, PREC)
            acc += _resident_dot(nxt, rb, mb, DS, 2 * H, wa2, wb2, H, KA, KB, PREC)
        if G == 4:
            acc += _resident_dot(nxt, rb, mb, DS, 3 * H, wa3, wb3, H, KA, KB, PREC)
    else:
        acc = _sliced_mma(a0, a1, wa0, wb0, KB, PREC)  # parts reuse A's shared memory
        if GP < G:
            acc += _sliced_dot(nxt + GP * H, rb, mb, DS, wa1, wb1, min(GP, G - GP) * H, RS, KA,
                               KB, PREC)  # fmt: skip
        if 2 * GP < G:
            acc += _sliced_dot(nxt + 2 * GP * H, rb, mb, DS, wa2, wb2, H, RS, KA, KB, PREC)
        if 3 * GP < G:
            acc += _sliced_dot(nxt + 3 * GP * H, rb, mb, DS, wa3, wb3, H, RS, KA, KB, PREC)
    return acc


@triton.jit
def _streamed_back(nxt, w_ptr, rb, mb, rn, mn, GH: tl.constexpr, H: tl.constexpr,
                   DS: tl.constexpr, BK: tl.constexpr, BB: tl.constexpr, BN: tl.constexpr,
                   SPLIT: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """dG_{t+1}[rb] @ W_hh[:, rn], W streamed: the gates one after another (W_hh's rows
    are contiguous across them), one K loop over G*H, optionally in SPLIT chains."""
    if SPLIT > 1:  # a batched dot over the slices, summed after
        ks: tl.constexpr = BK // SPLIT
        accs = tl.zeros([SPLIT, BB, BN], dtype=tl.float32)
        for k0 in range(0, GH, BK):
            a = _split_rows(nxt, rb, mb, DS, k0, SPLIT, ks, ks, GH)
            accs += _mma(a, _split_wtile(w_ptr, H, 1, rn, mn, k0, SPLIT, ks, ks, GH), PREC)
        acc = tl.sum(accs, axis=0)
    else:
        acc = tl.zeros([BB, BN], dtype=tl.float32)
        for k0 in range(0, GH, BK):
            a = _rows(nxt, rb, mb, DS, 0, k0, BK, GH)
            acc += _mma(a, _wtile(w_ptr, H, 1, rn, mn, k0, BK, GH), PREC)
    return acc


@triton.jit
def _bwd_inputs(pre_ptr, cell_ptr, h0_ptr, y_ptr, dy_ptr, dh_ptr, dc_ptr, len_ptr, rb, mb, rn,
                mn, t, B, H: tl.constexpr, MODE: tl.constexpr, P: tl.constexpr,
                HAS_LENGTHS: tl.constexpr, HAS_DY: tl.constexpr, GATHER: tl.constexpr,
                BB: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    """What step t's gate gradients of one [BB, BN] tile read besides dG_{t+1} @ W_hh,
    loaded before that K loop (their latency hides behind it): the stashed
    pre-activations x0..x3, per mode s0..s2 (lstm: c_{t-1}, c_t, dc; gru: h_{t-1};
    rnn: y_t), the direct part of dh (this program's own), dy_t and the valid mask.
    GATHER: the tiles of the layer's dtype in one load, lstm's fp32 ones in another."""
    mask = mb[:, None] & mn[None, :]
    valid = mask
    if HAS_LENGTHS:
        valid = mask & (t < tl.load(len_ptr + rb, mask=mb, other=0))[:, None]
    if GATHER:
        return _bwd_gathered(pre_ptr, cell_ptr, h0_ptr, y_ptr, dy_ptr, dh_ptr, dc_ptr, rb, mb,
                             rn, mn, t, B, H, MODE, P, HAS_DY, BB, BN, valid)  # fmt: skip
    idx = rb[:, None] * H + rn[None, :]
    dh_own = tl.load(dh_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    dy = tl.zeros_like(dh_own)
    if HAS_DY:
        dy = tl.load(dy_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    x0, x1, x2, x3 = dy, dy, dy, dy  # placeholders where the mode reads none
    s0, s1, s2 = dy, dy, dy
    if MODE <= 1:
        x0 = _tile(pre_ptr, rb, rn, mask, P, 0)
        x1 = _tile(pre_ptr, rb, rn, mask, P, H)
        x2 = _tile(pre_ptr, rb, rn, mask, P, 2 * H)
        x3 = _tile(pre_ptr, rb, rn, mask, P, 3 * H)
    if MODE == 0:
        s0 = tl.load(cell_ptr + idx, mask=mask, other=0.0)
        s1 = tl.load(cell_ptr + B * H + idx, mask=mask, other=0.0)
        s2 = tl.load(dc_ptr + idx, mask=mask, other=0.0)
    elif MODE == 1:
        # h_{t-1}: h0 at the first step, else y_{t-1} (equal wherever step t is valid).
        h_first = tl.load(h0_ptr + idx, mask=mask & (t == 0), other=0.0).to(tl.float32)
        h_before = tl.load(y_ptr - B * H + idx, mask=mask & (t > 0), other=0.0).to(tl.float32)
        s0 = h_first + h_before
    else:
        s0 = tl.load(y_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    return x0, x1, x2, x3, s0, s1, s2, dh_own, dy, valid


@triton.jit
def _bwd_gathered(pre_ptr, cell_ptr, h0_ptr, y_ptr, dy_ptr, dh_ptr, dc_ptr, rb, mb, rn, mn, t,
                  B, H: tl.constexpr, MODE: tl.constexpr, P: tl.constexpr,
                  HAS_DY: tl.constexpr, BB: tl.constexpr, BN: tl.constexpr, valid):  # fmt: skip
    """``_bwd_inputs`` in two loads: slots 0-3 the stashed gates (lstm, gru), 4 dh, 5 dy,
    6 y_t (rnn) or y_{t-1} (gru, t > 0), 7 h0 (gru, t == 0); lstm: c_{t-1}, c_t, dc."""
    slot, rows, cols = _slot_grid(rb, rn)
    idx = rows * H + cols
    y_at = y_ptr - B * H if MODE == 1 else y_ptr  # gru: y_{t-1}
    ptrs = tl.where(slot < 4, pre_ptr + rows * P + slot * H + cols,
                    tl.where(slot == 4, dh_ptr + idx, tl.where(slot == 5, dy_ptr + idx,
                             tl.where(slot == 6, y_at + idx, h0_ptr + idx))))  # fmt: skip
    use = ((slot < 4) & (MODE <= 1)) | (slot == 4) | ((slot == 5) & HAS_DY)
    use = use | ((slot == 6) & ((MODE >= 2) | ((MODE == 1) & (t > 0))))
    use = use | ((slot == 7) & (MODE == 1) & (t == 0))
    vals = tl.load(ptrs, mask=mb[:, None, None] & mn[None, None, :] & use, other=0.0)
    x0, x1, x2, x3, dh_own, dy, y_t, h_first = _unpack8(vals.to(tl.float32), BB, BN)
    s0, s1, s2 = y_t + h_first, dy, dy  # gru: h_{t-1}; rnn: y_t
    if MODE == 0:
        cslot = tl.arange(0, 4)[None, :, None]
        cptrs = tl.where(cslot < 2, cell_ptr + cslot * B * H + idx, dc_ptr + idx)
        cells = tl.load(cptrs, mask=mb[:, None, None] & mn[None, None, :] & (cslot < 3),
                        other=0.0)  # fmt: skip
        s0, s1, s2, _ = _unpack4(cells, BB, BN)
    return x0, x1, x2, x3, s0, s1, s2, dh_own, dy, valid


@triton.jit
def _slot_grid(rb, rn):
    """[1, 8, 1] slot index, [BB, 1, 1] rows, [1, 1, BN] columns: one load of 8 tiles."""
    return tl.arange(0, 8)[None, :, None], rb[:, None, None], rn[None, None, :]


@triton.jit
def _unpack8(v, BB: tl.constexpr, BN: tl.constexpr):
    """[BB, 8, BN] -> its eight [BB, BN] slots."""
    a = tl.reshape(tl.permute(v, (0, 2, 1)), (BB, BN, 2, 2, 2))  # slot 4i + 2j + k
    k0, k1 = tl.split(a)
    j00, j01 = tl.split(k0)  # slots 4i, 4i + 2
    j10, j11 = tl.split(k1)  # slots 4i + 1, 4i + 3
    s0, s4 = tl.split(j00)
    s2, s6 = tl.split(j01)
    s1, s5 = tl.split(j10)
    s3, s7 = tl.split(j11)
    return s0, s1, s2, s3, s4, s5, s6, s7


@triton.jit
def _unpack4(v, BB: tl.constexpr, BN: tl.constexpr):
    """[BB, 4, BN] -> its four [BB, BN] slots."""
    a = tl.reshape(tl.permute(v, (0, 2, 1)), (BB, BN, 2, 2))  # slot 2i + j
    j0, j1 = tl.split(a)
    s0, s2 = tl.split(j0)
    s1, s3 = tl.split(j1)
    return s0, s1, s2, s3


@triton.jit
def _bwd_update(dh_ptr, dc_ptr, dg_ptr, dgh_ptr, x0, x1, x2, x3, s0, s1, s2, dh_own, dy,
                valid, acc, rb, mb, rn, mn, clip_lo, clip_hi, H: tl.constexpr,
                DS: tl.constexpr, MODE: tl.constexpr, CLIP: tl.constexpr):  # fmt: skip
    """Gate gradients of one [BB, BN] tile of step t and the state gradients carried to
    step t-1 (kernels.py's formulas; acc = dG_{t+1} @ W_hh, the part via the weights).
    Returns the dh carried (stored)."""
    mask = mb[:, None] & mn[None, :]
    idx = rb[:, None] * H + rn[None, :]
    dh_in = dh_own + acc
    dh = dh_in + dy
    gty = dg_ptr.dtype.element_ty
    drow = dg_ptr + rb[:, None] * DS + rn[None, :]
    if MODE == 0:
        i, f, g, o = _sigmoid(x0), _sigmoid(x1), _tanh(x2), _sigmoid(x3)
        c_old, c, dc_in = s0, s1, s2
        tc = _tanh(c)
        dc = dc_in + dh * o * (1.0 - tc * tc)
        if CLIP:
            c_pre = f * c_old + i * g
            dc = tl.where((c_pre >= clip_lo) & (c_pre <= clip_hi), dc, 0.0)
        tl.store(drow, tl.where(valid, dc * g * i * (1.0 - i), 0.0).to(gty), mask=mask)
        tl.store(drow + H, tl.where(valid, dc * c_old * f * (1.0 - f), 0.0).to(gty), mask=mask)
        tl.store(drow + 2 * H, tl.where(valid, dc * i * (1.0 - g * g), 0.0).to(gty), mask=mask)
        tl.store(drow + 3 * H, tl.where(valid, dh * tc * o * (1.0 - o), 0.0).to(gty), mask=mask)
        tl.store(dc_ptr + idx, tl.where(valid, dc * f, dc_in), mask=mask)
        dh_direct = tl.zeros_like(dh)
    elif MODE == 1:
        r, z, xn, hn, h_old = _sigmoid(x0), _sigmoid(x1), x2, x3, s0
        n = _tanh(xn + r * hn)
        dn = dh * (1.0 - z) * (1.0 - n * n)
        dr = tl.where(valid, dn * hn * r * (1.0 - r), 0.0).to(gty)
        dz = tl.where(valid, dh * (h_old - n) * z * (1.0 - z), 0.0).to(gty)
        hrow = dgh_ptr + rb[:, None] * DS + rn[None, :]
        tl.store(drow, dr, mask=mask)
        tl.store(drow + H, dz, mask=mask)
        tl.store(drow + 2 * H, tl.where(valid, dn, 0.0).to(gty), mask=mask)
        tl.store(hrow, dr, mask=mask)
        tl.store(hrow + H, dz, mask=mask)
        tl.store(hrow + 2 * H, tl.where(valid, dn * r, 0.0).to(gty), mask=mask)
        dh_direct = dh * z
    else:
        # The activation's derivative comes from its output: nothing stashed.
        h = s0
        dp = dh * (1.0 - h * h) if MODE == 2 else tl.where(h > 0.0, dh, 0.0)
        tl.store(drow, tl.where(valid, dp, 0.0).to(gty), mask=mask)
        dh_direct = tl.zeros_like(dh)
    # Rows past their length pass the state gradient through unchanged.
    dh_new = tl.where(valid, dh_direct, dh_in)
    tl.store(dh_ptr + idx, dh_new.to(dh_ptr.dtype.element_ty), mask=mask)
    return dh_new


# ---- host side ---------------------------------------------------------------------


@dataclass(kw_only=True, slots=True, frozen=True)
class Plan:
    """How one layer's launch is laid out."""

    programs: int  # blocks of hidden units (grid axis 0)
    groups: int  # groups of batch tiles (grid axis 1); programs * groups <= SMs
    bn: int  # hidden units per program (all G gates of them)
    bb: int  # batch rows per tile (a program loops over its group's tiles)
    ka: int  # resident W: K split into two power-of-two pieces ka + kb >= H
    kb: int
    bk: int  # streamed W: K chunk per load
    resident: bool  # W_hh slice kept in registers across steps (else streamed from L2)
    num_warps: int  # forward
    bwd_warps: int
    num_stages: int  # software pipelining of the streamed K loop
    spin_load: bool = SPIN_LOAD  # barrier polls with loads (else with atomics)
    fuse_gates: bool = FUSE_GATES  # forward: one dot for all gates (lstm, gru)
    split: int = 1  # streamed K chunks in this many slices (independent MMA chains)
    bwd_bk: int = BWD_BLOCK_K
    bwd_split: int = BWD_SPLIT_K
    rsplit: int = RESIDENT_SPLIT  # resident: K slices of the forward (fused gates) and
    bwd_rsplit: int = BWD_RESIDENT_SPLIT  # the backward
    gather: bool = GATHER_LOADS  # backward: each step's other inputs in one load per dtype
    streamed_bb: int = 16  # bb and groups of the streamed fallback of a resident plan
    streamed_groups: int = 1

    def streamed(self) -> Plan:
        """This layout with W streamed (where the resident one does not fit)."""
        if not self.resident:
            return self
        return replace(self, resident=False, bb=self.streamed_bb, groups=self.streamed_groups,
                       num_warps=NUM_WARPS, bwd_warps=BWD_NUM_WARPS)  # fmt: skip

    def w_bytes(self, mode: str, dtype: torch.dtype) -> int:
        """W_hh bytes one program holds when resident."""
        return GATES[mode] * self.bn * (self.ka + self.kb) * dtype.itemsize


def _k_pieces(H: int) -> tuple[int, int]:
    """(ka, kb): powers of two (>= 16, kb may be 0) with ka + kb >= H and little padding."""
    ka = max(16, 1 << (H.bit_length() - 1))
    rest = H - ka
    return ka, (0 if rest <= 0 else max(16, triton.next_power_of_2(rest)))


@functools.cache
def _programs_at_once(device: torch.device) -> int:
    """Programs that are surely resident together: one per SM."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan(mode: str, B: int, H: int, dtype: torch.dtype, device: torch.device) -> Plan | None:
    """The launch layout of a layer, or None where the persistent kernel does not run it
    (kernels.py does): an empty batch, or a grid beyond the SMs even at BN = MAX_BN."""
    if B == 0 or mode not in MODES:
        return None
    interpreting = kernels._interpreting()
    if not interpreting and device.type != "cuda":
        return None
    sms = 0 if interpreting else _programs_at_once(device)
    return _plan(mode, B, H, dtype, interpreting, sms, _knobs())


def _knobs() -> tuple:
    """The module knobs ``plan`` reads (benchmarks and tests set them): its cache key."""
    return (RESIDENT_BYTES, BLOCK_N, MAX_BN, NUM_WARPS, NUM_STAGES, RESIDENT_WARPS, BLOCK_K,
            SPLIT_K, BWD_BLOCK_K, BWD_SPLIT_K, BWD_NUM_WARPS, RESIDENT_SPLIT,
            BWD_RESIDENT_SPLIT, GATHER_LOADS, MAX_BB, SPIN_LOAD, FUSE_GATES)  # fmt: skip


# Cached: a layer call asks twice per step of training, and building the frozen Plans
# costs host time that a launch-bound step pays in full.
@functools.lru_cache(maxsize=256)
def _plan(mode: str, B: int, H: int, dtype: torch.dtype, interpreting: bool, sms: int,
          knobs: tuple) -> Plan | None:  # fmt: skip
    """``plan`` for a non-empty batch on ``sms`` SMs (0: the interpreter's layout)."""
    ka, kb = _k_pieces(H)
    if interpreting:  # programs run in turn: one program owns every unit
        bn = max(16, triton.next_power_of_2(H))
        return Plan(programs=1, groups=1, bn=bn, bb=16, ka=ka, kb=kb, bk=16, resident=True,
                    num_warps=4, bwd_warps=4, num_stages=1, spin_load=SPIN_LOAD,
                    rsplit=RESIDENT_SPLIT, bwd_rsplit=BWD_RESIDENT_SPLIT,
                    gather=GATHER_LOADS)  # fmt: skip
    bn = BLOCK_N
    while triton.cdiv(H, bn) > sms:
        bn *= 2
    if bn > MAX_BN:
        return None
    programs = triton.cdiv(H, bn)
    bb, groups = _batch_tiles(B, sms // programs, MAX_BB)
    streamed = Plan(programs=programs, groups=groups, bn=bn, ka=ka, kb=kb, bk=BLOCK_K, bb=bb,
                    resident=False, num_warps=NUM_WARPS, bwd_warps=BWD_NUM_WARPS,
                    num_stages=NUM_STAGES, spin_load=SPIN_LOAD, fuse_gates=FUSE_GATES,
                    split=SPLIT_K, bwd_bk=BWD_BLOCK_K, bwd_split=BWD_SPLIT_K,
                    rsplit=RESIDENT_SPLIT, bwd_rsplit=BWD_RESIDENT_SPLIT,
                    gather=GATHER_LOADS)  # fmt: skip
    if streamed.w_bytes(mode, dtype) > RESIDENT_BYTES:
        return streamed
    fwd_warps, bwd_warps = RESIDENT_WARPS
    return replace(streamed, bb=16, groups=_batch_tiles(B, sms // programs, 16)[1],
                   resident=True, num_warps=fwd_warps, bwd_warps=bwd_warps, streamed_bb=bb,
                   streamed_groups=streamed.groups)  # fmt: skip


def _batch_tiles(B: int, max_groups: int, max_bb: int) -> tuple[int, int]:
    """(rows per tile, groups): the smallest tile (>= 16 rows, <= max_bb) that gives every
    group one tile within max_groups groups; tiles beyond that are looped over."""
    bb = 16
    while bb < max_bb and triton.cdiv(B, bb) > max_groups:
        bb *= 2
    return bb, max(1, min(max_groups, triton.cdiv(B, bb)))


def supports_persistent(
    mode: str, *, proj: bool, dtype: torch.dtype, device: torch.device | str, hidden: int,
    batch: int,
) -> bool:  # fmt: skip
    """Whether ``layer_forward`` / ``layer_backward`` run the persistent kernel for this
    layer (else they run kernels.py): the cases ``supports`` takes, a non-empty batch,
    and a hidden size whose grid fits the SMs (at most MAX_BN units per program: on an
    H100's 132 SMs, H <= 8448)."""
    device = torch.device(device)
    return supports(mode, proj=proj, dtype=dtype, device=device) and (
        plan(mode, batch, hidden, dtype, device) is not None
    )


# Set to a dict to record per-step timestamps of the next launches (GPU only, benchmarks):
# kind ("fwd" / "bwd") -> int64 [groups, programs, T, STAMPS] of the last such launch
# (backward: steps in the order run, T-1 first); PROBE_LEVEL 1-3: which stamps (STAMPS).
PROBES: dict[str, Tensor] | None = None
PROBE_LEVEL = 1
# Compiled kernels by (kind, mode, dtype, plan): registers, spills, shared memory (bench).
COMPILED: dict[tuple, dict[str, int]] = {}
# Resident layouts compiled on this GPU: "fits", "spills" (run streamed unless
# ALLOW_SPILLS) or "too big" (more shared memory or registers than an SM has: streamed).
_RESIDENT: dict[tuple, str] = {}


def _launch(kind: str, kernel, config: kernels.LoopConfig, layout: Plan, args: tuple,
            constants: dict, count: Tensor | None = None) -> None:  # fmt: skip
    """Launch ``kernel`` on ``layout``'s grid. A resident layout is compiled first (once
    per shape) and runs only if ptxas kept W without spilling and the SM has room;
    else the streamed layout runs. ``count``: the barriers' zeroed int32 counters (at
    least ``_counters(layout)``; None: allocated here)."""
    key = (kind, config.mode, config.H, config.dtype, layout)
    if count is None:
        count = torch.zeros(_counters(layout), dtype=torch.int32, device=config.device)
    probe = count  # read only when PROBE
    if PROBES is not None and not kernels._interpreting():
        shape = (layout.groups, layout.programs, config.T, STAMPS.value)
        probe = PROBES[kind] = torch.zeros(shape, dtype=torch.int64, device=config.device)
    call = (*args, count, probe, *_runtime(config))
    if layout.resident and not kernels._interpreting():
        if key not in _RESIDENT:
            _RESIDENT[key] = _resident_check(kernel, call, layout, constants, kind, config)
        if _RESIDENT[key] == "too big" or (_RESIDENT[key] == "spills" and not ALLOW_SPILLS):
            layout = layout.streamed()
    tiles = _tile_constants(kind, config, layout)
    compiled = kernel[(layout.programs, layout.groups)](*call, **constants, **tiles)
    if compiled is not None and hasattr(compiled, "n_spills"):
        COMPILED[(kind, config.mode, config.dtype, layout)] = {
            "n_regs": compiled.n_regs,
            "n_spills": compiled.n_spills,
            "shared": compiled.metadata.shared,
        }


def _counters(layout: Plan) -> int:
    """Barrier counters a launch of ``layout`` uses: one per batch group, of the plan or
    of the streamed layout it may fall back to."""
    return max(layout.groups, layout.streamed_groups)


def _resident_check(kernel, call, layout: Plan, constants, kind, config) -> str:
    """Compile (and load) the resident variant without launching it."""
    try:
        compiled = kernel.warmup(*call, grid=(layout.programs, layout.groups), **constants,
                                 **_tile_constants(kind, config, layout))  # fmt: skip
        compiled._init_handles()  # loads it: n_spills, and OutOfResources if too big
    except triton.runtime.errors.OutOfResources:
        return "too big"
    return "spills" if compiled.n_spills > SPILL_WORDS else "fits"


def _runtime(config: kernels.LoopConfig) -> tuple:
    lo, hi = kernels._clip_args(config)
    return (config.T, config.B, lo, hi)


def _precision(config: kernels.LoopConfig) -> str:
    """tl.dot's input precision (kernels.py's rule), "upcast" for 16-bit operands under
    the interpreter (its dot is wrong for them)."""
    interpreted_16_bit = kernels._interpreting() and config.dtype.itemsize == 2
    return "upcast" if interpreted_16_bit else config.precision


def _tile_constants(kind: str, config: kernels.LoopConfig, layout: Plan) -> dict:
    """The launch's constexprs and compile options (a cached dict: do not change it)."""
    probe = PROBE_LEVEL if PROBES is not None and not kernels._interpreting() else 0
    return _constants(kind, config, layout, probe, _precision(config), BWD_PART_BYTES)


@functools.lru_cache(maxsize=1024)
def _constants(kind: str, config: kernels.LoopConfig, layout: Plan, probe: int, precision: str,
               part_bytes: int) -> dict:  # fmt: skip
    fused = layout.fuse_gates and GATES[config.mode] >= 3
    return dict(
        H=config.H,
        MODE=_MODE_ID[config.mode],
        G=GATES[config.mode],
        P=config.stash_width,
        HAS_LENGTHS=config.has_lengths,
        CLIP=config.clip is not None,
        PREC=precision,
        RESIDENT=layout.resident,
        BB=layout.bb,
        BN=layout.bn,
        BK=layout.bk if kind == "fwd" else layout.bwd_bk,
        SPIN_LOAD=layout.spin_load,
        PROBE=probe,
        SPLIT=layout.split if kind == "fwd" else layout.bwd_split,
        **({"FUSE_GATES": fused} if kind == "fwd" else {"GATHER": layout.gather}),
        **_resident_slices(kind, config, layout, fused),
        num_warps=layout.num_warps if kind == "fwd" else layout.bwd_warps,
        num_stages=layout.num_stages,
    )


def _resident_slices(kind: str, config: kernels.LoopConfig, layout: Plan, fused: bool) -> dict:
    """RS, and with it KA and KB a slice's two pieces: the resident hidden GEMM's K in RS
    slices (RS 1: K in the plan's two pieces, as before). Forward: K = H, all gates in one
    dot. Backward: K = G*H in parts of GP gates, one after another; each part's dG rows
    pass through shared memory beside W, so GP is the most gates whose part fits
    BWD_PART_BYTES with W (fewer parts: fewer dependent L2 round trips per step)."""
    rs = layout.rsplit if kind == "fwd" else layout.bwd_rsplit
    if not layout.resident or rs == 1 or (kind == "fwd" and not fused):
        return {"RS": 1, "KA": layout.ka, "KB": layout.kb, **({} if kind == "fwd" else {"GP": 1})}
    if kind == "fwd":
        return {"RS": rs, **dict(zip(("KA", "KB"), _k_pieces(triton.cdiv(config.H, rs))))}
    G, size = GATES[config.mode], config.dtype.itemsize
    for gp in (4, 2, 1):
        ka, kb = _k_pieces(triton.cdiv(min(gp, G) * config.H, rs))
        part = rs * (ka + kb) * size  # bytes per row of a part (W: BN rows, dG: BB)
        if gp == 1 or part * (layout.bn * triton.cdiv(G, gp) + layout.bb) <= BWD_PART_BYTES:
            return {"RS": rs, "KA": ka, "KB": kb, "GP": gp}


# ---- The layer functions -------------------------------------------------------------
# Each phase of a layer-direction is one body (``_fwd_body``, ``_bwd_body``) that reads
# its inputs in place, writes its outputs and workspace, and allocates nothing: on CUDA
# it is captured once in a CUDA Graph and replayed (cuda_graphs.py), so a call costs one
# replay instead of a dozen torch ops and a Triton launch on the host; elsewhere (CPU,
# inside another capture, benchmarks' probes) the same body runs plainly on fresh
# buffers, so captured and plain calls do the same arithmetic.


def _config(mode, x, w_hh, b_ih, b_hh, lengths, memory, state_clip) -> kernels.LoopConfig:
    return kernels._loop_config(mode, x, w_hh, b_ih, b_hh, lengths, memory, state_clip, False)


def _plan_of(config: kernels.LoopConfig, layout: Plan | None) -> Plan | None:
    return layout or plan(config.mode, config.B, config.H, config.dtype, config.device)


def _graphed(config: kernels.LoopConfig, steps: int, use_graph: bool | None) -> bool:
    """Whether a phase runs as a CUDA Graph: cuda_graphs.py's rule (sized as kernels.py's loop
    of ``steps`` steps), never while probes record the launches (they allocate)."""
    elements = steps * config.B * config.stash_width
    return PROBES is None and cuda_graphs.use_graph(config.device, elements, use_graph)


def _run(key: tuple, config: kernels.LoopConfig, buf, body) -> None:
    """``body(buf)`` as the captured entry of ``key`` for ``buf``'s addresses (captured
    now if there is none), or plainly where cuda_graphs.py skips this capture."""
    if config.device.type == "cuda":
        # This thread's cuBLAS handle, made now: its GEMMs all run on the capturing thread
        # here, and an outer capture (a user's torch.cuda.graph) in which they run plainly
        # cannot create one (w A: CUBLAS_STATUS_NOT_INITIALIZED in the bench's capture).
        torch.cuda.current_blas_handle()
    entry = cuda_graphs.acquire(key, config.device, buf, body)
    if entry is not None:
        entry.replay(buf)
    else:
        body(buf)


def _gates_bytes(config: kernels.LoopConfig) -> int:
    """What this config asks of the "gates" arena, forward (pre-activations where they
    are not the stash) or backward (a chunk's padded gate gradients)."""
    d, B, gh = config.dtype.itemsize, config.B, config.gh
    forward = 0 if config.mode == "lstm" and config.memory == "stash" else config.T * B * gh
    backward = kernels._chunk_steps(config.T, B) * B * _padded(gh, config.dtype)
    return max(forward, backward) * d


@dataclass(kw_only=True, slots=True)
class _FwdBuffers:
    """Everything one forward reads and writes: inputs read in place (a captured entry
    replays on the addresses it was captured with), workspace (cuda_graphs.py's arenas where
    captured, else fresh) and this call's fresh outputs."""

    x: Tensor  # [T, B, I] contiguous
    h0: Tensor
    c0: Tensor | None
    w_ih: Tensor
    w_hh: Tensor
    b_ih: Tensor | None
    b_hh: Tensor | None
    lengths: Tensor | None  # int64
    bias: Tensor | None  # workspace: b_ih + b_hh for the input GEMM (both given, not gru)
    h: Tensor  # workspace: [T+1, B, HS] every step's h (module doc)
    count: Tensor  # workspace: zeroed barrier counters
    pre: Tensor  # [T, B, G*H] input GEMM: an LSTM's stash (an output), else workspace
    stash: Tensor | None  # gru "stash": [T, B, 4H]
    cells: Tensor | None  # lstm: [T+1, B, H] fp32
    y: Tensor
    h_n: Tensor
    c_n: Tensor | None


def _fwd_buffers(config: kernels.LoopConfig, layout: Plan, inputs: dict, workspace=None):
    """A forward's buffers; ``workspace(key, name, make)``, when given, supplies those
    that are no output (fresh ones otherwise)."""
    T, B, H, gh = config.T, config.B, config.H, config.gh
    lstm, gru = config.mode == "lstm", config.mode == "gru"

    def scratch(name: str, make):
        return make() if workspace is None else workspace((config, layout), name, make)

    def make_pre():
        return config.empty(T, B, gh)

    folded = inputs["b_ih"] is not None and inputs["b_hh"] is not None and not gru
    counters = _counters(layout)
    return _FwdBuffers(
        **inputs,
        bias=scratch("persistent.bias", lambda: config.empty(gh)) if folded else None,
        h=scratch("persistent.h", lambda: config.empty(T + 1, B, _padded(H, config.dtype))),
        count=scratch("persistent.count", lambda: config.empty(counters, dtype=torch.int32)),
        pre=make_pre() if lstm and config.memory == "stash" else scratch("pre", make_pre),
        stash=config.empty(T, B, 4 * H) if gru and config.memory == "stash" else None,
        cells=config.empty(T + 1, B, H, dtype=torch.float32) if lstm else None,
        y=config.empty(T, B, H),
        **_final_states(config),
    )


def _final_states(config: kernels.LoopConfig) -> dict:
    """h_n (and an LSTM's c_n) as views of one fresh buffer: one address fewer for a
    captured entry to find again."""
    lstm = config.mode == "lstm"
    states = config.empty(2 if lstm else 1, config.B, config.H)
    return dict(h_n=states[0], c_n=states[1] if lstm else None)


# Small inputs copied into workspace before a captured phase runs: a replay then reads
# them where it was captured to, wherever the caller's tensors live (the module's zero
# states and autograd's zero-filled gradients are fresh small tensors every call, and
# small blocks are where the caching allocator repeats itself least). The large inputs
# (x, y, dy, the stash) are read in place: copying them would cost their bandwidth.
_COPIED_IN = ("h0", "c0", "lengths", "grad_hn", "grad_cn")


def _copy_in(config: kernels.LoopConfig, layout: Plan, inputs: dict, workspace) -> dict:
    """``inputs`` with those named in _COPIED_IN replaced by views of workspace holding
    their values."""
    out = dict(inputs)
    for name in _COPIED_IN:
        value = inputs.get(name)
        if value is not None:
            make = functools.partial(torch.empty_like, value, memory_format=torch.contiguous_format)
            view = workspace((config, layout), f"persistent.in.{name}", make)
            view.copy_(value)
            out[name] = view
    return out


def _input_bias(buf) -> Tensor | None:
    """The bias of the input GEMM (kernels._input_bias), folded into ``buf.bias`` here."""
    if buf.bias is not None:
        torch.add(buf.b_ih, buf.b_hh, out=buf.bias)
        return buf.bias
    return buf.b_ih if buf.b_ih is not None else buf.b_hh


def _fwd_body(config: kernels.LoopConfig, layout: Plan, buf: _FwdBuffers) -> None:
    """The input GEMM over all steps, the initial states, ONE persistent launch, the
    final states."""
    T, B, H = config.T, config.B, config.H
    gru = config.mode == "gru"
    bias = buf.b_ih if gru else _input_bias(buf)
    kernels._input_gemm(buf.x.view(T * B, -1), buf.w_ih, bias, buf.pre.view(T * B, -1))
    buf.h[0, :, :H].copy_(buf.h0)
    if buf.cells is not None:
        buf.cells[0].copy_(buf.c0)
    buf.count.zero_()
    stash = buf.pre if config.mode == "lstm" and config.memory == "stash" else buf.stash
    dummy = buf.y
    has_hb = buf.b_hh is not None and gru
    args = (
        buf.pre, stash if stash is not None else dummy, buf.h, buf.w_hh,
        buf.b_hh if has_hb else dummy, buf.cells if buf.cells is not None else dummy, buf.y,
        buf.lengths if buf.lengths is not None else dummy,
    )  # fmt: skip
    constants = dict(WRITE_STASH=stash is not None, HAS_HB=has_hb, HS=buf.h.shape[-1])
    _launch("fwd", _fwd_kernel, config, layout, args, constants, buf.count)
    buf.h_n.copy_(buf.h[T, :, :H])
    if buf.c_n is not None:
        buf.c_n.copy_(buf.cells[T])


def _saved(config: kernels.LoopConfig, buf: _FwdBuffers) -> tuple[Tensor, ...]:
    """What ``layer_forward`` saves for backward (saved_layout)."""
    if config.mode == "lstm":
        return (buf.pre, buf.cells) if config.memory == "stash" else (buf.cells,)
    return (buf.stash,) if buf.stash is not None else ()


@torch.no_grad()
def layer_forward(
    mode: str,
    x: Tensor,
    h0: Tensor,
    c0: Tensor | None,
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor | None,
    b_hh: Tensor | None,
    w_hr: Tensor | None,
    *,
    lengths: Tensor | None = None,
    memory: str = "stash",
    state_clip: tuple[float, float] | None = None,
    layout: Plan | None = None,
    use_graph: bool | None = None,
) -> tuple[Tensor, Tensor, Tensor | None, tuple[Tensor, ...]]:
    """One layer, one direction: ``(y [T,B,H], h_n, c_n, saved)`` (kernels.py's
    contract); ``layout`` overrides ``plan``'s (tests, benchmarks); ``use_graph``:
    capture the layer in a CUDA Graph (None: by size, cuda_graphs.py)."""
    kernels._check(mode, x, w_hr, memory, state_clip)
    config = _config(mode, x, w_hh, b_ih, b_hh, lengths, memory, state_clip)
    layout = _plan_of(config, layout)
    if layout is None:
        return kernels.layer_forward(
            mode, x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr,
            lengths=lengths, memory=memory, state_clip=state_clip, use_graph=use_graph,
        )  # fmt: skip
    lengths = lengths.to(device=x.device, dtype=torch.int64) if lengths is not None else None
    inputs = dict(x=x.contiguous(), h0=h0.contiguous(),
                  c0=c0.contiguous() if c0 is not None else None, w_ih=w_ih, w_hh=w_hh,
                  b_ih=b_ih, b_hh=b_hh,
                  lengths=lengths.contiguous() if lengths is not None else None)  # fmt: skip
    body = functools.partial(_fwd_body, config, layout)
    if _graphed(config, config.T, use_graph):
        # The "gates" arena large enough for the backward before views of it are taken.
        cuda_graphs.reserve(config.device, "pre", _gates_bytes(config))
        inputs = _copy_in(config, layout, inputs, cuda_graphs.workspace)
        buf = _fwd_buffers(config, layout, inputs, cuda_graphs.workspace)
        _run(((config, layout), "persistent.fwd", *_addresses(w_ih, w_hh, b_ih, b_hh)),
             config, buf, body)  # fmt: skip
    else:
        buf = _fwd_buffers(config, layout, inputs)
        body(buf)
    return buf.y, buf.h_n, buf.c_n, _saved(config, buf)


def _addresses(*tensors: Tensor | None) -> tuple[int, ...]:
    return tuple(0 if t is None else t.data_ptr() for t in tensors)


@dataclass(kw_only=True, slots=True)
class _BwdBuffers:
    """Everything one backward (all its chunks) reads and writes, as ``_FwdBuffers``."""

    stash: Tensor | None  # saved [T, B, P] (memory "stash"; not rnn)
    cells: Tensor | None  # lstm: saved [T+1, B, H] fp32
    x: Tensor
    h0: Tensor
    w_ih: Tensor
    w_hh: Tensor
    b_ih: Tensor | None
    b_hh: Tensor | None
    y: Tensor
    dy: Tensor | None
    grad_hn: Tensor | None
    grad_cn: Tensor | None
    lengths: Tensor | None
    # workspace, a chunk's worth (each chunk runs on views of it)
    bias: Tensor | None  # recompute (not gru): b_ih + b_hh
    pre: Tensor | None  # recompute: [steps, B, P]
    dg: Tensor  # [steps, B, padded G*H]
    dgh: Tensor | None  # gru: [steps, B, padded 3H]
    ones: Tensor | None  # [steps * B]: the bias gradients as GEMVs
    chunk_lengths: Tensor | None  # [chunks, B]: lengths - t0 of each chunk
    # outputs
    state: Tensor  # zeroed first: the counters and dh, dc below are views of it
    count: Tensor  # [chunks, >= _counters]
    dh: Tensor  # running grad of h (grad h0 at the end)
    dc: Tensor | None  # lstm: running grad of c, fp32
    grad_x: Tensor | None
    grad_wih: Tensor | None
    grad_whh: Tensor | None
    grad_bih: Tensor | None
    grad_bhh: Tensor | None
    grad_c0: Tensor | None


def _state_block(config: kernels.LoopConfig, layout: Plan, launches: int, needs: tuple) -> dict:
    """(state, count, dh, dc) and the small gradients (grad_c0, grad_bih, grad_bhh, where
    ``needs`` asks) as views of one buffer: the backward's barrier counters per launch
    ([launches, >= _counters], rows 16 bytes apart) and running state gradients (dh in
    the layer's dtype, dc fp32 for an LSTM, else None) zeroed in one fill (every torch op
    costs tens of microseconds of host time where it is not captured); one allocation
    where there were four, so one address for a captured entry to find again."""
    B, H, gh, lstm = config.B, config.H, config.gh, config.mode == "lstm"
    _, need_c0, _, _, need_bih, need_bhh = needs
    d = config.dtype.itemsize
    per_launch = -(-_counters(layout) // 4) * 4
    sizes = {"count": launches * per_launch * 4, "dh": B * H * d, "dc": B * H * 4 if lstm else 0,
             "grad_c0": B * H * d if need_c0 else 0, "grad_bih": gh * d if need_bih else 0,
             "grad_bhh": gh * d if need_bhh else 0}  # fmt: skip
    offsets, total = {}, 0
    for name, n in sizes.items():  # each view 16-byte aligned, as the kernels' pointers
        offsets[name], total = total, total + -(-n // 16) * 16
    state = config.empty(total, dtype=torch.uint8)

    def view(name: str, dtype: torch.dtype, *shape: int) -> Tensor:
        return state[offsets[name] : offsets[name] + sizes[name]].view(dtype).view(shape)

    def grad(name: str, *shape: int) -> Tensor | None:
        return view(name, config.dtype, *shape) if sizes[name] else None

    dc = view("dc", torch.float32, B, H) if lstm else None
    return dict(state=state, count=view("count", torch.int32, launches, per_launch),
                dh=view("dh", config.dtype, B, H), dc=dc, grad_c0=grad("grad_c0", B, H),
                grad_bih=grad("grad_bih", gh), grad_bhh=grad("grad_bhh", gh))  # fmt: skip


def _bwd_buffers(config: kernels.LoopConfig, layout: Plan, inputs: dict, needs: tuple,
                 workspace=None) -> _BwdBuffers:  # fmt: skip
    """A backward's buffers (``_fwd_buffers``'s rules); ``needs``: (x, c0, w_ih, w_hh,
    b_ih, b_hh) gradients wanted."""
    T, B, H, gh, mode = config.T, config.B, config.H, config.gh, config.mode
    steps = kernels._chunk_steps(T, B)
    launches = -(-T // steps)
    need_x, _, need_wih, need_whh, need_bih, need_bhh = needs
    recompute = config.memory == "recompute" and not mode.startswith("rnn")

    def scratch(name: str, make):
        return make() if workspace is None else workspace((config, layout), name, make)

    def gate_grads(name: str) -> Tensor:
        width = _padded(gh, config.dtype)
        return scratch(name, lambda: config.empty(steps, B, width))

    folded = recompute and mode != "gru" and inputs["b_ih"] is not None
    folded = folded and inputs["b_hh"] is not None
    chunked_lengths = inputs["lengths"] is not None and launches > 1
    n_in = inputs["x"].shape[-1]
    return _BwdBuffers(
        **inputs,
        bias=scratch("persistent.bias", lambda: config.empty(gh)) if folded else None,
        pre=scratch("persistent.bwd.pre", lambda: config.empty(steps, B, config.stash_width))
        if recompute else None,
        dg=gate_grads("persistent.bwd.dg"),
        dgh=gate_grads("persistent.bwd.dgh") if mode == "gru" else None,
        ones=scratch("persistent.ones", lambda: config.empty(steps * B))
        if need_bih or need_bhh else None,
        chunk_lengths=scratch("persistent.lengths",
                              lambda: config.empty(launches, B, dtype=torch.int64))
        if chunked_lengths else None,
        **_state_block(config, layout, launches, needs),
        grad_x=config.empty(T, B, n_in) if need_x else None,
        grad_wih=config.empty(gh, n_in) if need_wih else None,
        grad_whh=config.empty(gh, H) if need_whh else None,
    )  # fmt: skip


def _bwd_body(config: kernels.LoopConfig, layout: Plan, buf: _BwdBuffers) -> None:
    """Chunks of steps from the end, each: (recomputed pre-activations,) ONE persistent
    launch, the chunk's GEMMs of the input and weight gradients; the state gradients
    carried between chunks in ``buf.dh``, ``buf.dc``."""
    T, B = config.T, config.B
    buf.state.zero_()
    if buf.grad_hn is not None:
        buf.dh.copy_(buf.grad_hn)
    if buf.grad_cn is not None:
        buf.dc.copy_(buf.grad_cn)
    if buf.ones is not None:
        buf.ones.fill_(1)
    bias = _input_bias(buf) if buf.pre is not None and config.mode != "gru" else None
    steps = kernels._chunk_steps(T, B)
    for launch, t1 in enumerate(range(T, 0, -steps)):
        t0 = max(0, t1 - steps)
        chunk = kernels._with_steps(config, t1 - t0)
        loop = _chunk_buffers(chunk, buf, t0, t1, launch)
        if buf.pre is not None:
            _recompute(chunk, buf, t0, t1, bias, out=loop.pre)
        _bwd_launch(chunk, layout, loop, buf.count[launch])
        _chunk_grads(chunk, buf, loop, t0, t1, first=launch == 0)
    if buf.grad_c0 is not None:
        buf.grad_c0.copy_(buf.dc)


def _chunk_buffers(chunk: kernels.LoopConfig, buf: _BwdBuffers, t0: int, t1: int, launch: int):
    """kernels.py's loop buffers of the chunk of steps [t0, t1): views of ``buf``."""
    n, gh, mode = t1 - t0, chunk.gh, chunk.mode
    lengths = buf.lengths
    if lengths is not None and t0 > 0:
        lengths = torch.sub(lengths, t0, out=buf.chunk_lengths[launch])
    pre = buf.pre[:n] if buf.pre is not None else None
    if buf.stash is not None:
        pre = buf.stash[t0:t1]
    grads = {"dg": buf.dg[:n, :, :gh], "dgh": buf.dgh[:n, :, :gh] if buf.dgh is not None else None}
    return kernels._bwd_buffers(
        chunk, pre=pre, cells=buf.cells[t0 : t1 + 1] if buf.cells is not None else None,
        h0=(buf.h0 if t0 == 0 else buf.y[t0 - 1]) if mode == "gru" else None,
        y=buf.y[t0:t1] if mode != "lstm" else None,
        dy=buf.dy[t0:t1] if buf.dy is not None else None, w_hh=buf.w_hh, lengths=lengths,
        dh=buf.dh, dc=buf.dc, workspace=lambda _config, name, _make: grads[name[len("bwd."):]],
    )  # fmt: skip


def _recompute(chunk: kernels.LoopConfig, buf: _BwdBuffers, t0: int, t1: int,
               bias: Tensor | None, *, out: Tensor) -> None:  # fmt: skip
    """The chunk's pre-activations from x and h_{t-1} (h0, then y) written into ``out``
    [n, B, P] in place (kernels._recompute_pre's result, with no temporary)."""
    B, H, n = chunk.B, chunk.H, (t1 - t0) * chunk.B
    x2d = buf.x.view(-1, buf.x.shape[-1])[t0 * B : t1 * B]
    pre = out.view(n, out.shape[-1])
    # h_{t-1} of the chunk's first step, then of the others
    prev = ((slice(0, B), buf.h0 if t0 == 0 else buf.y[t0 - 1]),
            (slice(B, n), buf.y[t0 : t1 - 1].reshape(-1, H)))  # fmt: skip
    prev = [(rows, h) for rows, h in prev if h.numel()]
    if chunk.mode != "gru":
        kernels._input_gemm(x2d, buf.w_ih, bias, pre)
        for rows, h in prev:
            pre[rows].addmm_(h, buf.w_hh.t())
        return
    # gru: [r, z: input + hidden side | n: input side | n: hidden side]
    kernels._input_gemm(x2d, buf.w_ih, buf.b_ih, pre[:, : 3 * H])
    b_hn = buf.b_hh[2 * H :] if buf.b_hh is not None else None
    for rows, h in prev:
        pre[rows, : 2 * H].addmm_(h, buf.w_hh[: 2 * H].t())
        kernels._input_gemm(h, buf.w_hh[2 * H :], b_hn, pre[rows, 3 * H :])
    if buf.b_hh is not None:
        pre[:, : 2 * H].add_(buf.b_hh[: 2 * H])


def _chunk_grads(chunk: kernels.LoopConfig, buf: _BwdBuffers, loop, t0: int, t1: int,
                 *, first: bool) -> None:  # fmt: skip
    """The chunk's share of the input and weight gradients: GEMMs over its stored gate
    gradients, written by the first chunk and added to by the others."""
    B, H, gh = chunk.B, chunk.H, chunk.gh
    n = (t1 - t0) * B
    dg = loop.dg.view(n, gh)
    dgh = loop.dgh.view(n, gh) if loop.dgh is not None else dg
    x2d = buf.x.view(-1, buf.x.shape[-1])[t0 * B : t1 * B]
    if buf.grad_x is not None:
        torch.mm(dg, buf.w_ih, out=buf.grad_x[t0:t1].view(n, -1))
    if buf.grad_wih is not None:
        _mm_into(buf.grad_wih, first, dg.t(), x2d)
    for out, g in ((buf.grad_bih, dg), (buf.grad_bhh, dgh)):
        if out is not None:  # a GEMV: kernels._add_sum's reason
            if first:
                torch.mv(g.t(), buf.ones[:n], out=out)
            else:
                out.addmv_(g.t(), buf.ones[:n])
    if buf.grad_whh is not None:  # dG_hidden^T @ h_{t-1}: h0 for step 0, then y
        done = 0
        if t0 == 0:
            _mm_into(buf.grad_whh, first, dgh[:B].t(), buf.h0)
            first, done = False, B
        if n > done:
            hprev = buf.y[max(t0 - 1, 0) : t1 - 1].reshape(-1, H)
            _mm_into(buf.grad_whh, first, dgh[done:].t(), hprev)


def _mm_into(out: Tensor, first: bool, a: Tensor, b: Tensor) -> None:
    """out = a @ b (first) or out += a @ b."""
    if first:
        torch.mm(a, b, out=out)
    else:
        out.addmm_(a, b)


def _bwd_launch(config: kernels.LoopConfig, layout: Plan, buf, count: Tensor) -> None:
    """One chunk's reverse loop, then the last step's ``dh += dG_0 @ W_hh``; ``count``:
    its zeroed barrier counters."""
    dummy = buf.dh
    args = (
        buf.pre if buf.pre is not None else dummy,
        buf.cells if buf.cells is not None else dummy,
        buf.h0 if buf.h0 is not None else dummy,
        buf.y if buf.y is not None else dummy,
        buf.dy if buf.dy is not None else dummy,
        buf.dh,
        buf.dc if buf.dc is not None else dummy,
        buf.dg,
        buf.dgh if buf.dgh is not None else dummy,
        buf.w_hh,
        buf.lengths if buf.lengths is not None else dummy,
    )
    constants = dict(HAS_DY=buf.dy is not None, DS=buf.dg.stride(1))
    _launch("bwd", _bwd_kernel, config, layout, args, constants, count)
    buf.dh.addmm_((buf.dgh if buf.dgh is not None else buf.dg)[0], buf.w_hh)


@torch.no_grad()
def layer_backward(
    mode: str,
    saved: tuple[Tensor, ...],
    x: Tensor,
    h0: Tensor,
    c0: Tensor | None,
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor | None,
    b_hh: Tensor | None,
    w_hr: Tensor | None,
    y: Tensor,
    grad_y: Tensor | None,
    grad_hn: Tensor | None,
    grad_cn: Tensor | None,
    *,
    lengths: Tensor | None = None,
    memory: str = "stash",
    state_clip: tuple[float, float] | None = None,
    needs_input_grad: tuple[bool, ...] = (True,) * 8,
    layout: Plan | None = None,
    use_graph: bool | None = None,
) -> tuple[Tensor | None, ...]:
    """Gradients of x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr (kernels.py's contract and
    chunks of steps: one persistent launch per chunk, the weight gradients as GEMMs over
    its stored gate gradients); ``use_graph`` as ``layer_forward``'s."""
    kernels._check(mode, x, w_hr, memory, state_clip)
    config = _config(mode, x, w_hh, b_ih, b_hh, lengths, memory, state_clip)
    layout = _plan_of(config, layout)
    if layout is None:
        return kernels.layer_backward(
            mode, saved, x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, y, grad_y, grad_hn, grad_cn,
            lengths=lengths, memory=memory, state_clip=state_clip,
            needs_input_grad=needs_input_grad, use_graph=use_graph,
        )  # fmt: skip
    need_x, need_h0, need_c0, need_wih, need_whh, need_bih, need_bhh, _ = needs_input_grad
    needs = (need_x, need_c0 and c0 is not None, need_wih, need_whh,
             need_bih and b_ih is not None, need_bhh and b_hh is not None)  # fmt: skip
    if not (need_h0 or any(needs)):
        return (None,) * 8
    lengths = lengths.to(device=x.device, dtype=torch.int64) if lengths is not None else None
    stashed = memory == "stash" and not mode.startswith("rnn")

    def own(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.contiguous()

    inputs = dict(stash=own(saved[0]) if stashed else None,
                  cells=own(saved[-1]) if mode == "lstm" else None, x=x.contiguous(),
                  h0=h0.contiguous(), w_ih=w_ih, w_hh=w_hh, b_ih=b_ih, b_hh=b_hh,
                  y=y.contiguous(), dy=own(grad_y), grad_hn=own(grad_hn),
                  grad_cn=own(grad_cn) if mode == "lstm" else None,
                  lengths=own(lengths))  # fmt: skip
    body = functools.partial(_bwd_body, config, layout)
    if _graphed(config, kernels._chunk_steps(config.T, config.B), use_graph):
        cuda_graphs.reserve(config.device, "pre", _gates_bytes(config))
        inputs = _copy_in(config, layout, inputs, cuda_graphs.workspace)
        buf = _bwd_buffers(config, layout, inputs, needs, cuda_graphs.workspace)
        key = ((config, layout), "persistent.bwd", *_addresses(w_ih, w_hh, b_ih, b_hh))
        _run(key, config, buf, body)
    else:
        buf = _bwd_buffers(config, layout, inputs, needs)
        body(buf)
    # grad_h0, grad_c0 and the bias gradients are views of the state block (one address
    # for a captured entry to find again): the small ones leave it as copies of their own,
    # since a custom op's outputs may share no storage (the stack stacks dh and grad_c0).
    return (buf.grad_x, buf.dh if need_h0 else None, buf.grad_c0, buf.grad_wih, buf.grad_whh,
            _own(buf.grad_bih), _own(buf.grad_bhh), None)  # fmt: skip


def _own(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.clone()


# ---- What the captured layers hold (the op's formulas) -------------------------------


def loop_captured(mode: str, T: int, B: int, H: int, device: torch.device, *,
                  backward: bool) -> bool:  # fmt: skip
    """Whether a layer's forward (or backward) runs as a CUDA Graph when the caller asks
    nothing, outside another capture: kernels.py's rule, sized alike (``_graphed``)."""
    return kernels.loop_captured(mode, T, B, H, device, backward=backward)


def held_arenas(
    mode: str,
    memory: str,
    T: int,
    B: int,
    H: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    has_lengths: bool,
    has_bias: bool,
    backward: bool,
    has_grad_y: bool = True,
) -> dict[tuple, int]:
    """Bytes of each shared arena (cuda_graphs.py) that one layer-direction's captured forward
    (or backward) asks for and the cache keeps between calls, keyed as
    ``kernels.held_arenas`` (whose layers run where the persistent kernel does not): the
    same buffer builders as the capture, on the meta device, and the "gates" arena
    reserved for both phases. Bias gradients are assumed wanted (their GEMV's vector of
    ones: rows elements)."""
    device = torch.device(device)
    layout = _formula_plan(mode, B, H, dtype, device)
    if layout is None:
        return kernels.held_arenas(mode, memory, T, B, H, dtype, device, has_lengths=has_lengths,
                                   has_bias=has_bias, backward=backward,
                                   has_grad_y=has_grad_y)  # fmt: skip
    if device.type != "cuda" or not loop_captured(mode, T, B, H, device, backward=backward):
        return {}
    config = kernels._config(mode, T, B, H, dtype, torch.device("meta"), has_lengths, None,
                             memory, has_bias, False, "ieee")  # fmt: skip
    sizes = {cuda_graphs.arena_name("pre"): _gates_bytes(config)}

    def record(_key, name: str, make) -> Tensor:
        like = make()
        arena = cuda_graphs.arena_name(name)
        sizes[arena] = max(sizes.get(arena, 0), cuda_graphs.arena_bytes(like))
        return like

    empty, gh = config.empty, config.gh
    weights = dict(w_ih=empty(gh, 1), w_hh=empty(gh, H), b_ih=empty(gh) if has_bias else None,
                   b_hh=empty(gh) if has_bias else None)  # fmt: skip
    lstm_state = empty(B, H) if mode == "lstm" else None
    common = dict(x=empty(T, B, 1), h0=empty(B, H), **weights,
                  lengths=empty(B, dtype=torch.int64) if has_lengths else None)  # fmt: skip
    if backward:  # the state gradients given (autograd fills the unused ones with zeros)
        inputs = dict(stash=None, cells=None, y=empty(T, B, H), dy=None, grad_hn=empty(B, H),
                      grad_cn=lstm_state, **common)  # fmt: skip
        inputs = _copy_in(config, layout, inputs, record)
        _bwd_buffers(config, layout, inputs, (True,) * 4 + (has_bias,) * 2, record)
    else:
        inputs = _copy_in(config, layout, dict(c0=lstm_state, **common), record)
        _fwd_buffers(config, layout, inputs, record)
    return {("mirrorgrad.rnn arena", str(device), name): n for name, n in sizes.items()}


def _formula_plan(mode: str, B: int, H: int, dtype: torch.dtype, device: torch.device):
    """``plan`` where the op's formulas ask; None (kernels.py's layers) also where no GPU
    is here to size the grid by."""
    try:
        return plan(mode, B, H, dtype, device)
    except (AssertionError, RuntimeError):  # torch.cuda without a device
        return None
