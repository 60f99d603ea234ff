"""The persistent kernels' device code (persistent.py launches them; its docstring
describes the layout): ``persistent_fwd_kernel`` and ``persistent_bwd_kernel`` run all
steps of a layer's chunk in one launch, program p owning hidden units [p*BN, (p+1)*BN),
a grid-wide barrier (``grid_barrier``) between steps; PROBE stamps each step's phases
(benchmarks, persistent_probes.py)."""

import triton
import triton.language as tl

from mirrorgrad.ops.rnn.triton_math import gate_grads, gru_cell, lstm_cell, store_gates, tanh, tile


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
def persistent_fwd_kernel(
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
    x0 = tile(pre_ptr, rb, rn, mask, G * H, 0)
    x1 = tl.zeros_like(x0)
    x2 = tl.zeros_like(x0)
    x3 = tl.zeros_like(x0)
    c_old = tl.zeros_like(x0)
    if G >= 3:
        x1 = tile(pre_ptr, rb, rn, mask, G * H, H)
        x2 = tile(pre_ptr, rb, rn, mask, G * H, 2 * H)
    if G == 4:
        x3 = tile(pre_ptr, rb, rn, mask, G * H, 3 * H)
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
    if MODE == 0:
        p_i, p_f, p_g, p_o = x0 + acc0, x1 + acc1, x2 + acc2, x3 + acc3
        if WRITE_STASH:
            store_gates(stash_ptr + rb[:, None] * GH + rn[None, :], p_i, p_f, p_g, p_o, H, mask)
        c, h = lstm_cell(p_i, p_f, p_g, p_o, c_old, clip_lo, clip_hi, CLIP)
        tl.store(cell_ptr + B * H + idx, tl.where(valid, c, c_old), mask=mask)
    elif MODE == 1:
        hr, hz, hn = acc0 + bhr[None, :], acc1 + bhz[None, :], acc2 + bhn[None, :]
        r_pre, z_pre = x0 + hr, x1 + hz
        h = gru_cell(r_pre, z_pre, x2, hn, h_old)
        if WRITE_STASH:
            store_gates(stash_ptr + rb[:, None] * 4 * H + rn[None, :], r_pre, z_pre, x2, hn, H,
                        mask)  # fmt: skip
    elif MODE == 2:
        h = tanh(x0 + acc0)
    else:
        h = tl.maximum(x0 + acc0, 0.0)
    h = h.to(h_out.dtype.element_ty)
    tl.store(h_out + rb[:, None] * HS + rn[None, :], tl.where(valid, h, h_old), mask=mask)
    tl.store(y_ptr + idx, tl.where(valid, h, 0.0), mask=mask)
    return h


@triton.jit
def persistent_bwd_kernel(
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
        x0 = tile(pre_ptr, rb, rn, mask, P, 0)
        x1 = tile(pre_ptr, rb, rn, mask, P, H)
        x2 = tile(pre_ptr, rb, rn, mask, P, 2 * H)
        x3 = tile(pre_ptr, rb, rn, mask, P, 3 * H)
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
    drow = dg_ptr + rb[:, None] * DS + rn[None, :]
    hrow = dgh_ptr + rb[:, None] * DS + rn[None, :]
    dh_direct = gate_grads(drow, hrow, dc_ptr, idx, x0, x1, x2, x3, s0, s1, s2, dh, valid, mask,
                           clip_lo, clip_hi, H, MODE, CLIP)  # fmt: skip
    # Rows past their length pass the state gradient through unchanged.
    dh_new = tl.where(valid, dh_direct, dh_in)
    tl.store(dh_ptr + idx, dh_new.to(dh_ptr.dtype.element_ty), mask=mask)
    return dh_new
