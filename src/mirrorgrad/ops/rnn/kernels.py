"""Triton kernels of the RNN layer and their host launchers (the GPU path).

Fused pointwise kernels around cuBLAS GEMMs.

Per layer and direction (time-major, x [T, B, I]):

* forward: one input GEMM ``X @ W_ih^T + b`` over all steps; per step one hidden
  GEMM accumulated in place (``addmm_``) and one fused pointwise kernel (gate
  nonlinearities, cell update, state clip, lengths mask; writes y_t, h, c, stash);
* backward: reverse loop with one fused pointwise kernel (writes the gate gradient
  dG_t and the direct state gradient) and one ``dG_t @ W_hh`` GEMM per step into a
  reused buffer; dW_ih, dW_hh, db and dx are GEMMs / reductions over the steps of a
  chunk (at most ``StepTuning.bwd_chunk_rows`` rows), so backward's extra memory is flat in T.
  The input GEMM and these on operands padded to 16 bytes where that pays
  (padded_operands.py).
* ``fused=True`` moves the hidden GEMM into the step kernel (one launch per step);
  slower than cuBLAS on an H200 so far (docs/rnn-op.md), hence off by default.

On CUDA the step loops are captured in CUDA Graphs and replayed (``cuda_graphs.py``).

Stash layout (``saved``), pre-activations P per step (biases folded):
  lstm:     stash (P [T,B,4H], cells [T+1,B,H] fp32)  recompute (cells,)
  gru:      stash (P [T,B,4H] = r_pre, z_pre, W_in x + b_in, W_hn h + b_hn,)  recompute ()
  rnn_*:    () in both modes: the activation's derivative is read from y
``cells[0]`` is c0 and ``cells[t+1]`` is c_t.  ``recompute`` rebuilds P in backward
from x and h_{t-1} (= h0, then y) with GEMMs over all steps at once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from mirrorgrad.ops.rnn import cuda_graphs, padded_operands, step_loop
from mirrorgrad.ops.rnn.cell_modes import GATES, MODE_ID, MODES
from mirrorgrad.ops.rnn.layer_call import LayerCall
from mirrorgrad.ops.rnn.step_loop import (
    DTYPES,
    BwdLoopBuffers,
    LoopConfig,
    add_chunk_grads,
    bwd_loop_buffers,
    check_layer,
    chunk_steps,
    clip_args,
    default_fused,
    input_bias,
    input_gemm,
    loop_config,
    make_config,
    with_steps,
)
from mirrorgrad.ops.rnn.triton_math import gate_grads, gru_cell, lstm_cell, store_gates, tanh, tile

_BLOCK = 512


# One compile for every step: Triton would specialise t on its divisibility by 16.
@triton.jit(do_not_specialize=["t"])
def _rnn_fwd_kernel(
    pre_ptr,  # [B, G*H] input-side pre-activations of step t (split lstm/rnn: hidden part added)
    hh_ptr,  # split gru: [B, 3H] hidden side W_hh h + b_hh
    stash_ptr,  # [B, P] stash out (gru: 4H; fused lstm: pre_ptr itself)
    hin_ptr,  # [B, H] h_{t-1}
    hout_ptr,  # [B, H] h_t (split: hin_ptr itself; fused: the other ping-pong buffer)
    w_ptr,  # fused: W_hh^T [H, G*H] row-major
    bhh_ptr,  # fused gru: b_hh [3H]
    cprev_ptr,  # lstm: [B, H] fp32 c_{t-1}
    cnext_ptr,  # lstm: [B, H] fp32 c_t out
    y_ptr,  # [B, H] output of step t
    len_ptr,  # [B] int64
    t,
    B,
    H: tl.constexpr,  # constant per model: lets the GEMM loop bounds be static
    clip_lo,
    clip_hi,
    MODE: tl.constexpr,  # 0 lstm, 1 gru, 2 rnn_tanh, 3 rnn_relu
    G: tl.constexpr,
    HAS_LENGTHS: tl.constexpr,
    CLIP: tl.constexpr,
    WRITE_STASH: tl.constexpr,
    FUSED: tl.constexpr,  # the hidden GEMM h_{t-1} @ W_hh^T runs in this kernel
    HAS_HB: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BB: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    rb = tl.program_id(0).to(tl.int64) * BB + tl.arange(0, BB).to(tl.int64)  # [BB]
    rn = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN).to(tl.int64)  # [BN]
    mb = rb < B
    mask = mb[:, None] & (rn < H)[None, :]  # [BB, BN]
    GH = G * H
    acc0 = tl.zeros([BB, BN], dtype=tl.float32)
    acc1 = tl.zeros([BB, BN], dtype=tl.float32)
    acc2 = tl.zeros([BB, BN], dtype=tl.float32)
    acc3 = tl.zeros([BB, BN], dtype=tl.float32)
    if FUSED:
        for k0 in range(0, H, BK):
            rk = k0 + tl.arange(0, BK).to(tl.int64)  # [BK]
            mk = rk < H
            hk = tl.load(
                hin_ptr + rb[:, None] * H + rk[None, :], mask=mb[:, None] & mk[None, :], other=0.0
            )
            wp = w_ptr + rk[:, None] * GH + rn[None, :]  # [BK, BN] of gate 0
            wm = mk[:, None] & (rn < H)[None, :]
            acc0 += tl.dot(
                hk, tl.load(wp, mask=wm, other=0.0), input_precision=DOT_PRECISION
            )  # [BB, BK] @ [BK, BN]
            if G >= 3:
                acc1 += tl.dot(
                    hk, tl.load(wp + H, mask=wm, other=0.0), input_precision=DOT_PRECISION
                )
                acc2 += tl.dot(
                    hk, tl.load(wp + 2 * H, mask=wm, other=0.0), input_precision=DOT_PRECISION
                )
            if G == 4:
                acc3 += tl.dot(
                    hk, tl.load(wp + 3 * H, mask=wm, other=0.0), input_precision=DOT_PRECISION
                )
    valid = mask
    if HAS_LENGTHS:
        valid = mask & (t < tl.load(len_ptr + rb, mask=mb, other=0))[:, None]
    idx = rb[:, None] * H + rn[None, :]  # [BB, BN]
    h_old = tl.load(hin_ptr + idx, mask=mask, other=0.0)
    if MODE == 0:
        p_i = tile(pre_ptr, rb, rn, mask, GH, 0) + acc0
        p_f = tile(pre_ptr, rb, rn, mask, GH, H) + acc1
        p_g = tile(pre_ptr, rb, rn, mask, GH, 2 * H) + acc2
        p_o = tile(pre_ptr, rb, rn, mask, GH, 3 * H) + acc3
        if WRITE_STASH:
            store_gates(stash_ptr + rb[:, None] * GH + rn[None, :], p_i, p_f, p_g, p_o, H, mask)
        c_old = tl.load(cprev_ptr + idx, mask=mask, other=0.0)
        c, h = lstm_cell(p_i, p_f, p_g, p_o, c_old, clip_lo, clip_hi, CLIP)
        tl.store(cnext_ptr + idx, tl.where(valid, c, c_old), mask=mask)
    elif MODE == 1:
        if FUSED:
            hr, hz, hn = acc0, acc1, acc2
            if HAS_HB:
                hr += tl.load(bhh_ptr + rn, mask=rn < H, other=0.0).to(tl.float32)[None, :]
                hz += tl.load(bhh_ptr + H + rn, mask=rn < H, other=0.0).to(tl.float32)[None, :]
                hn += tl.load(bhh_ptr + 2 * H + rn, mask=rn < H, other=0.0).to(tl.float32)[None, :]
        else:
            hr = tile(hh_ptr, rb, rn, mask, GH, 0)
            hz = tile(hh_ptr, rb, rn, mask, GH, H)
            hn = tile(hh_ptr, rb, rn, mask, GH, 2 * H)
        r_pre = tile(pre_ptr, rb, rn, mask, GH, 0) + hr
        z_pre = tile(pre_ptr, rb, rn, mask, GH, H) + hz
        xn = tile(pre_ptr, rb, rn, mask, GH, 2 * H)
        h = gru_cell(r_pre, z_pre, xn, hn, h_old)
        if WRITE_STASH:
            store_gates(stash_ptr + rb[:, None] * 4 * H + rn[None, :], r_pre, z_pre, xn, hn, H,
                        mask)  # fmt: skip
    elif MODE == 2:
        h = tanh(tile(pre_ptr, rb, rn, mask, H, 0) + acc0)
    else:
        h = tl.maximum(tile(pre_ptr, rb, rn, mask, H, 0) + acc0, 0.0)
    h = h.to(hout_ptr.dtype.element_ty)
    tl.store(hout_ptr + idx, tl.where(valid, h, h_old), mask=mask)
    tl.store(y_ptr + idx, tl.where(valid, h, 0.0), mask=mask)


# One compile for every step: Triton would specialise t on its divisibility by 16.
@triton.jit(do_not_specialize=["t"])
def _rnn_bwd_kernel(
    pre_ptr,  # [B, P] pre-activations of step t (stash layout)
    cprev_ptr,  # lstm: [B, H] fp32 c_{t-1}
    cnext_ptr,  # lstm: [B, H] fp32 c_t
    hprev_ptr,  # gru: [B, H] h_{t-1}
    hnext_ptr,  # rnn: [B, H] y_t
    dy_ptr,  # [B, H] grad of y_t
    dh_ptr,  # [B, H] in: grad of h_t (fused: its direct part); out: direct part of grad of h_{t-1}
    dc_ptr,  # lstm: [B, H] fp32 in: grad of c_t; out: grad of c_{t-1}
    dg_ptr,  # [B, G*H] out (rows DGS apart): grad of the input-side pre-activations
    dgh_ptr,  # gru: [B, 3H] out: grad of the hidden-side pre-activations
    dgnext_ptr,  # fused: [B, G*H] hidden-side gate grads of step t+1
    w_ptr,  # fused: W_hh [G*H, H] row-major
    len_ptr,  # [B] int64
    t,
    B,
    H: tl.constexpr,  # constant per model: lets the GEMM loop bounds be static
    clip_lo,
    clip_hi,
    DGS,  # row stride of dg_ptr: G*H, or a GRU's 4H where it overwrites the pre-activations
    MODE: tl.constexpr,
    G: tl.constexpr,
    HAS_LENGTHS: tl.constexpr,
    HAS_DY: tl.constexpr,
    CLIP: tl.constexpr,
    FUSED: tl.constexpr,  # the GEMM dG_{t+1} @ W_hh runs in this kernel
    HAS_NEXT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BB: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    rb = tl.program_id(0).to(tl.int64) * BB + tl.arange(0, BB).to(tl.int64)  # [BB]
    rn = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN).to(tl.int64)  # [BN]
    mb = rb < B
    mask = mb[:, None] & (rn < H)[None, :]  # [BB, BN]
    GH = G * H
    acc = tl.zeros([BB, BN], dtype=tl.float32)
    if FUSED and HAS_NEXT:
        for gk in tl.static_range(0, G * H, H):
            for k0 in range(0, H, BK):
                rk = gk + k0 + tl.arange(0, BK).to(tl.int64)  # [BK]
                mk = rk < gk + H
                dgk = tl.load(
                    dgnext_ptr + rb[:, None] * GH + rk[None, :],
                    mask=mb[:, None] & mk[None, :],
                    other=0.0,
                )
                wk = tl.load(
                    w_ptr + rk[:, None] * H + rn[None, :],
                    mask=mk[:, None] & (rn < H)[None, :],
                    other=0.0,
                )
                acc += tl.dot(dgk, wk, input_precision=DOT_PRECISION)  # [BB, BK] @ [BK, BN]
    valid = mask
    if HAS_LENGTHS:
        valid = mask & (t < tl.load(len_ptr + rb, mask=mb, other=0))[:, None]
    idx = rb[:, None] * H + rn[None, :]  # [BB, BN]
    dh_in = tl.load(dh_ptr + idx, mask=mask, other=0.0).to(tl.float32) + acc
    dh = dh_in
    if HAS_DY:
        dh += tl.load(dy_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    x0, x1, x2, x3 = dh, dh, dh, dh  # placeholders where the mode reads none
    s0, s1, s2 = dh, dh, dh
    if MODE <= 1:
        P = 4 * H if MODE == 1 else GH
        x0 = tile(pre_ptr, rb, rn, mask, P, 0)
        x1 = tile(pre_ptr, rb, rn, mask, P, H)
        x2 = tile(pre_ptr, rb, rn, mask, P, 2 * H)
        x3 = tile(pre_ptr, rb, rn, mask, P, 3 * H)
    if MODE == 0:
        s0 = tl.load(cprev_ptr + idx, mask=mask, other=0.0)
        s1 = tl.load(cnext_ptr + idx, mask=mask, other=0.0)
        s2 = tl.load(dc_ptr + idx, mask=mask, other=0.0)
    elif MODE == 1:
        s0 = tl.load(hprev_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    else:
        s0 = tl.load(hnext_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    drow = dg_ptr + rb[:, None] * DGS + rn[None, :]
    hrow = dgh_ptr + rb[:, None] * GH + rn[None, :]
    dh_direct = gate_grads(drow, hrow, dc_ptr, idx, x0, x1, x2, x3, s0, s1, s2, dh, valid, mask,
                           clip_lo, clip_hi, H, MODE, CLIP)  # fmt: skip
    # Rows past their length pass the state gradient through unchanged.
    tl.store(dh_ptr + idx, tl.where(valid, dh_direct, dh_in).to(dh_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dropout_kernel(x_ptr, out_ptr, n, p, seed_ptr, offset, BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)  # [BLOCK]
    mask = idx < n
    x = tl.load(x_ptr + idx, mask=mask, other=0.0)
    # The seed is read on the device: no host sync, and CUDA Graphs replay fresh seeds.
    keep = tl.rand(tl.load(seed_ptr), offset + idx) >= p
    out = tl.where(keep, x.to(tl.float32) / (1.0 - p), 0.0)
    tl.store(out_ptr + idx, out.to(out_ptr.dtype.element_ty), mask=mask)


def saved_layout(
    mode: str, memory: str, T: int, B: int, H: int, dtype: torch.dtype
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of each tensor in ``saved`` from ``layer_forward`` (module docstring)."""
    cell_dtype = torch.float32
    if mode == "lstm":
        cells = ((T + 1, B, H), cell_dtype)
        return [((T, B, 4 * H), dtype), cells] if memory == "stash" else [cells]
    if mode == "gru" and memory == "stash":
        return [((T, B, 4 * H), dtype)]
    return []


def workspace_bytes(
    mode: str,
    memory: str,
    T: int,
    B: int,
    H: int,
    dtype: torch.dtype,
    *,
    backward: bool,
    captured: bool = False,
    dg_over_pre: bool = True,
    n_in: int | None = None,
    device: torch.device | str = "cpu",
) -> int:
    """Peak bytes one ``layer_forward`` (or ``layer_backward``) allocates beyond its inputs
    and outputs: the pre-activations where they are not the stash, and per backward
    chunk the gate gradients (and the recomputed pre-activations); beside them the
    input and weight GEMMs' padded operands (padded_operands.py, for an input of
    ``n_in`` features, None: H, on ``device``), allocated per call even where the loop
    is captured. [B, H]-sized buffers are left out. ``captured``: the loop runs as a
    CUDA Graph, whose buffers are arenas held between calls (``held_arenas``), not
    allocated per call. ``dg_over_pre=False``: an LSTM's gate gradients have a buffer of
    their own (persistent.py's backward)."""
    d = dtype.itemsize
    gh = GATES[mode] * H
    steps = chunk_steps(T, B)
    pads = padded_operands.operand_bytes(T, B, steps, H if n_in is None else n_in, H, gh, dtype,
                                         device, backward=backward)  # fmt: skip
    if not backward:
        pre_is_saved = mode == "lstm" and memory == "stash"
        per_call = (0 if pre_is_saved else T * B * gh * d) + (B * gh * d if mode == "gru" else 0)
        return pads + (0 if captured else per_call)
    rows = steps * B
    dg = rows * gh * d * (2 if mode == "gru" else 1)
    if memory == "stash" or mode.startswith("rnn"):
        return pads + (0 if captured else dg)
    if mode == "lstm":  # the gate gradients overwrite the recomputed pre-activations
        return pads + (0 if captured else rows * gh * d + (0 if dg_over_pre else dg))
    # gru: h_prev, both [rows, 3H] GEMM outputs and the [rows, 4H] result at once.
    recompute = rows * H * d + 2 * rows * gh * d
    if captured:
        return max(recompute, pads)
    pre = rows * 4 * H * d
    return max(recompute + pre, pre + dg + pads)


def loop_captured(
    mode: str, T: int, B: int, H: int, device: torch.device, *, backward: bool
) -> bool:
    """Whether a layer's forward (or backward chunk) loop runs as a CUDA Graph when the
    caller asks nothing (``use_graph=None``), outside another capture."""
    steps = chunk_steps(T, B) if backward else T
    stash_width = 4 * H if mode == "gru" else GATES[mode] * H
    on_cuda = torch.device(device).type == "cuda"
    return on_cuda and cuda_graphs.captures_by_size(steps * B * stash_width)


def supports(mode: str, *, proj: bool, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether this GPU path runs ``mode`` for these tensors (no projection: reference path)."""
    device = torch.device(device)
    on_device = device.type == "cuda" or (device.type == "cpu" and step_loop.interpreting())
    return mode in MODES and not proj and dtype in DTYPES and on_device


def dropout(x: Tensor, p: float, seed: Tensor | int, offset: int = 0) -> Tensor:
    """Inverted dropout with a Philox mask drawn in-kernel from (seed, offset + index).

    ``seed``: a 0-dim int64 tensor, read by the kernel (on ``x``'s device: no host sync);
    an int is copied to one. The mask is never stored: the backward is
    ``dropout(grad, p, seed, offset)``.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability has to be in [0, 1), got {p}")
    if p == 0.0:
        return x.clone()
    if not isinstance(seed, Tensor):
        seed = torch.tensor(seed, dtype=torch.int64, device=x.device)
    elif seed.device != x.device:
        seed = seed.to(x.device)
    src = x.contiguous()
    out = torch.empty_like(src)
    n = src.numel()
    _dropout_kernel[(triton.cdiv(n, _BLOCK),)](
        src, out, n, float(p), seed, int(offset), BLOCK=_BLOCK
    )
    return out


def _tiles(config: LoopConfig) -> tuple[int, int, int]:
    """(BB, BN, BK): rows of the batch, hidden columns and GEMM depth per program."""
    if config.fused:
        # NOTE: small column tiles give more programs to stream W_hh at small batch.
        return min(64, max(16, triton.next_power_of_2(config.B))), 16 if config.B <= 32 else 32, 64
    return min(4, triton.next_power_of_2(config.B)), 128, 16


def _grid(config: LoopConfig) -> tuple[int, int]:
    bb, bn, _ = _tiles(config)
    return (triton.cdiv(config.B, bb), triton.cdiv(config.H, bn))


@dataclass(kw_only=True, slots=True)
class _FwdBuffers:
    pre: Tensor  # [T, B, G*H] input-side pre-activations; split lstm/rnn: hidden GEMM adds in place
    hh: Tensor | None  # split gru: [B, 3H] hidden side of the current step
    stash: Tensor | None  # gru stash: [T, B, 4H]
    h: Tensor  # [2, B, H] ping-pong (split: only h[0], updated in place)
    cells: Tensor | None  # lstm: [T+1, B, H] fp32
    y: Tensor  # [T, B, H]
    lengths: Tensor | None
    w: Tensor  # split: W_hh [G*H, H]; fused: W_hh^T [H, G*H] contiguous
    b_hh: Tensor | None  # gru only: b_hh stays on the hidden side (r gates W_hn h + b_hn)


def _fwd_buffers(
    config: LoopConfig,
    w: Tensor,
    b_hh: Tensor | None,
    lengths: Tensor | None,
    workspace=None,
) -> _FwdBuffers:
    """Buffers of one forward loop; ``workspace(name, make)``, when given, supplies those
    that are not outputs (shared between captured loops of one config)."""
    gru, lstm = config.mode == "gru", config.mode == "lstm"
    gru_stash = gru and config.memory == "stash"
    pre_is_stash = lstm and config.memory == "stash"

    def scratch(name: str, make):
        return make() if workspace is None else workspace(name, make)

    def make_pre():
        return config.empty(config.T, config.B, config.gh)

    return _FwdBuffers(
        pre=make_pre() if pre_is_stash else scratch("pre", make_pre),
        hh=scratch("hh", lambda: config.empty(config.B, config.gh))
        if gru and not config.fused
        else None,
        stash=config.empty(config.T, config.B, 4 * config.H) if gru_stash else None,
        h=scratch("h", lambda: config.empty(2, config.B, config.H)),
        cells=config.empty(config.T + 1, config.B, config.H, dtype=torch.float32) if lstm else None,
        y=config.empty(config.T, config.B, config.H),
        lengths=lengths,
        w=w,
        b_hh=b_hh if gru else None,
    )


def _final_h(config: LoopConfig, buf: _FwdBuffers) -> Tensor:
    return buf.h[config.T % 2] if config.fused else buf.h[0]


def _fwd_loop(config: LoopConfig, buf: _FwdBuffers) -> None:
    """The sequential part of the forward: per step one fused kernel (split: plus one GEMM)."""
    lo, hi = clip_args(config)
    bb, bn, bk = _tiles(config)
    dummy = buf.y
    lstm_stash = config.mode == "lstm" and config.memory == "stash"
    if config.B == 0:  # an empty batch: nothing to launch
        return
    for t in range(config.T):
        if config.fused:
            h_in, h_out = buf.h[t % 2], buf.h[(t + 1) % 2]
        else:
            h_in = h_out = buf.h[0]
            if config.mode != "gru":
                buf.pre[t].addmm_(h_in, buf.w.t())
            elif buf.b_hh is not None:
                torch.addmm(buf.b_hh, h_in, buf.w.t(), out=buf.hh)
            else:
                torch.mm(h_in, buf.w.t(), out=buf.hh)
        cells = buf.cells
        stash = (
            buf.stash[t]
            if buf.stash is not None
            else (buf.pre[t] if config.fused and lstm_stash else None)
        )
        _rnn_fwd_kernel[_grid(config)](
            buf.pre[t],
            buf.hh if buf.hh is not None else dummy,
            stash if stash is not None else dummy,
            h_in,
            h_out,
            buf.w,
            buf.b_hh if buf.b_hh is not None else dummy,
            cells[t] if cells is not None else dummy,
            cells[t + 1] if cells is not None else dummy,
            buf.y[t],
            buf.lengths if buf.lengths is not None else dummy,
            t,
            config.B,
            config.H,
            lo,
            hi,
            MODE=MODE_ID[config.mode],
            G=GATES[config.mode],
            HAS_LENGTHS=buf.lengths is not None,
            CLIP=config.clip is not None,
            WRITE_STASH=stash is not None,
            FUSED=config.fused,
            HAS_HB=buf.b_hh is not None,
            DOT_PRECISION=config.precision,
            BB=bb,
            BN=bn,
            BK=bk,
        )


def _bwd_loop(config: LoopConfig, buf: BwdLoopBuffers) -> None:
    """The sequential part of the backward: per step one fused kernel (split: plus one GEMM)."""
    lo, hi = clip_args(config)
    bb, bn, bk = _tiles(config)
    dummy = buf.dh
    dg_hidden = buf.dgh if buf.dgh is not None else buf.dg  # what flows through W_hh
    if config.B == 0:  # an empty batch: nothing to launch
        return
    for t in reversed(range(config.T)):
        cells = buf.cells
        has_next = config.fused and t + 1 < config.T
        _rnn_bwd_kernel[_grid(config)](
            buf.pre[t] if buf.pre is not None else dummy,
            cells[t] if cells is not None else dummy,
            cells[t + 1] if cells is not None else dummy,
            (buf.y[t - 1] if t > 0 else buf.h0) if config.mode == "gru" else dummy,
            buf.y[t] if config.mode.startswith("rnn") else dummy,
            buf.dy[t] if buf.dy is not None else dummy,
            buf.dh,
            buf.dc if buf.dc is not None else dummy,
            buf.dg[t],
            buf.dgh[t] if buf.dgh is not None else dummy,
            dg_hidden[t + 1] if has_next else dummy,
            buf.w_hh,
            buf.lengths if buf.lengths is not None else dummy,
            t,
            config.B,
            config.H,
            lo,
            hi,
            buf.dg.stride(1),
            MODE=MODE_ID[config.mode],
            G=GATES[config.mode],
            HAS_LENGTHS=buf.lengths is not None,
            HAS_DY=buf.dy is not None,
            CLIP=config.clip is not None,
            FUSED=config.fused,
            HAS_NEXT=has_next,
            DOT_PRECISION=config.precision,
            BB=bb,
            BN=bn,
            BK=bk,
        )
        if not config.fused or t == 0:
            buf.dh.addmm_(dg_hidden[t], buf.w_hh)


def _graphed(config: LoopConfig, use_graph: bool | None) -> bool:
    """Whether this loop runs as a captured CUDA Graph (sized by its stash)."""
    return cuda_graphs.use_graph(config.device, config.T * config.B * config.stash_width, use_graph)


@torch.no_grad()
def layer_forward(
    call: LayerCall, *, use_graph: bool | None = None, fused: bool | None = None
) -> tuple[Tensor, Tensor, Tensor | None, tuple[Tensor, ...]]:
    """One layer, one direction: returns ``(y [T,B,H], h_n, c_n, saved)``.

    ``use_graph``: capture the step loop in a CUDA Graph (None: by size).
    ``fused``: run the hidden GEMM inside the step kernel (None: by batch size).
    """
    check_layer(call)
    config = loop_config(call, fused)
    mode, x, h0, c0, lengths = call.mode, call.x, call.h0, call.c0, call.lengths
    w_ih, w_hh, b_ih, b_hh, _ = call.weights
    w = w_hh.t().contiguous() if config.fused else w_hh
    T, B = config.T, config.B
    lengths = lengths.to(device=x.device, dtype=torch.int64) if lengths is not None else None
    bias = input_bias(mode, b_ih, b_hh)
    x2d = x.reshape(T * B, x.shape[2])
    graphed = _graphed(config, use_graph)
    if graphed:
        # Fresh outputs (y, cells, stash) and the shared workspace: the entry captured
        # with these addresses replays, else one is captured on them (cuda_graphs.py). The
        # "gates" arena is made large enough for the backward before views are taken.
        cuda_graphs.reserve(config.device, "pre", _gates_bytes(config))
        buf = _fwd_entry_buffers(config, w, b_hh, lengths, cuda_graphs.workspace)
        entry = _forward_entry(config, buf)
    else:
        buf, entry = _fwd_buffers(config, w, b_hh, lengths), None
    pads = padded_operands.forward_operands(T, B, x2d.shape[1], config.gh, x.dtype, x.device,
                                            _fresh(config))  # fmt: skip
    x2d_in, w_ih_in = padded_operands.input_operands(pads, x2d, w_ih)
    input_gemm(x2d_in, w_ih_in, bias, buf.pre.view(T * B, config.gh))
    del pads, x2d_in, w_ih_in  # the padded copies: freed before the loop runs
    buf.h[0].copy_(h0)
    if buf.cells is not None:
        buf.cells[0].copy_(c0)
    if graphed:
        if buf.lengths is not None:
            buf.lengths.copy_(lengths)
        if config.fused:
            buf.w.copy_(w)
    if entry is not None:
        entry.replay(buf)
    else:
        _fwd_loop(config, buf)
    h_n = _final_h(config, buf)
    h_n = h_n.clone() if graphed else h_n  # h is shared workspace there
    c_n = buf.cells[T].to(x.dtype, copy=True) if buf.cells is not None else None
    return buf.y, h_n, c_n, saved_tensors(config, buf)


def _fresh(config: LoopConfig):
    """``make(name, shape)`` of padded_operands.py: a fresh buffer."""
    return lambda _name, shape: config.empty(*shape)


def saved_tensors(config: LoopConfig, buf) -> tuple[Tensor, ...]:
    """What ``layer_forward`` saves for backward (saved_layout), from its buffers (this
    module's or persistent.py's: the same fields)."""
    if config.mode == "lstm":
        return (buf.pre, buf.cells) if config.memory == "stash" else (buf.cells,)
    return (buf.stash,) if buf.stash is not None else ()


def _forward_entry(config: LoopConfig, buf: _FwdBuffers) -> cuda_graphs.Entry | None:
    """The captured forward loop for these buffers (None: run it uncaptured).

    W_hh and b_hh are read in place (their addresses are in the key); the transposed
    copy of the fused path, the pre-activations where they are not the stash, the
    hidden state and the lengths are per-config workspace; the outputs are this call's."""

    in_place = None if config.fused else buf.w.data_ptr()
    key = (config, "fwd", in_place, buf.b_hh.data_ptr() if buf.b_hh is not None else None)
    return cuda_graphs.acquire(key, config.device, buf, lambda b: _fwd_loop(config, b))


def _gates_bytes(config: LoopConfig) -> int:
    """What this config's loops ask of the "gates" arena, forward and backward: the
    forward's pre-activations where they are not the stash, the backward chunk's gate
    gradients, or its recomputed pre-activations where the gradients overwrite them."""
    d, rows = config.dtype.itemsize, chunk_steps(config.T, config.B) * config.B
    forward = 0 if config.mode == "lstm" and config.memory == "stash" else config.T * config.B
    chunk = with_steps(config, rows // max(config.B, 1))
    width = config.stash_width if dg_overwrites_pre(chunk, captured=True) else config.gh
    return max(forward * config.gh, rows * width) * d


def _fwd_entry_buffers(config: LoopConfig, w, b_hh, lengths, workspace) -> _FwdBuffers:
    """A captured forward loop's buffers: this call's fresh outputs (y, cells, stash);
    ``workspace(config, name, make)`` supplies the rest."""

    def shared(name: str, make):
        return workspace(config, name, make)

    buf = _fwd_buffers(config, w, b_hh, lengths, workspace=shared)
    if config.fused:
        buf.w = shared("w", lambda: torch.empty_like(w))
    if lengths is not None:
        buf.lengths = shared("lengths", lambda: torch.empty_like(lengths))
    return buf


def _recompute_pre(
    config: LoopConfig, x2d: Tensor, h0: Tensor, y: Tensor, w_ih, w_hh, b_ih, b_hh, *, out: Tensor
) -> None:
    """All pre-activations at once from x and h_{t-1} (= h0, then y), written into ``out``
    [T,B,P]: no sequential step. (The stacked h_{t-1} is freed here, not kept for dW_hh:
    the op's declared temporaries (``workspace_bytes``) do not hold it past the recompute.)"""
    T, B, H = config.T, config.B, config.H
    n = T * B
    hprev = torch.cat([h0.unsqueeze(0), y[:-1]]).view(n, H)
    pre = out.view(n, out.shape[-1])
    if config.mode != "gru":
        input_gemm(x2d, w_ih, input_bias(config.mode, b_ih, b_hh), pre)
        pre.addmm_(hprev, w_hh.t())
        return
    gi = config.empty(n, 3 * H)
    gh = config.empty(n, 3 * H)
    input_gemm(x2d, w_ih, b_ih, gi)
    input_gemm(hprev, w_hh, b_hh, gh)
    torch.add(gi[:, : 2 * H], gh[:, : 2 * H], out=pre[:, : 2 * H])
    pre[:, 2 * H : 3 * H] = gi[:, 2 * H :]
    pre[:, 3 * H :] = gh[:, 2 * H :]


def _set_state(buffer: Tensor, value: Tensor | None) -> None:
    """A running state gradient's start: zeros (None), or ``value`` unless it is already
    ``buffer`` (carried over from the previous chunk of the same graph)."""
    if value is None:
        buffer.zero_()
    elif value is not buffer:
        buffer.copy_(value)


def _owned_state(config: LoopConfig, value: Tensor | None, dtype: torch.dtype) -> Tensor:
    """A running state gradient of our own to update in place (the caller's is read only)."""
    if value is None:
        return torch.zeros(config.B, config.H, dtype=dtype, device=config.device)
    return value.to(dtype, copy=True, memory_format=torch.contiguous_format)


def _bwd_chunk(
    config: LoopConfig, fields: dict, recompute, dh, dc, carried: bool, graphed: bool, t0: int = 0
) -> BwdLoopBuffers:
    """Runs one chunk's reverse loop; returns its buffers (``dg``, ``dgh``, and ``dh``,
    ``dc``: the state gradients at the chunk's first step). ``recompute(out=...)``, if
    given, writes the pre-activations (else ``fields["pre"]`` holds them) straight into
    the loop's buffer. dh, dc: the state gradients at the chunk's last step, None for
    zeros; ``carried``: they are the previous chunk's results, ours to overwrite.
    Graphed, the buffers are the config's shared workspace but for the inputs read in
    place: the caller reads them (in stream order) before a loop of that config runs
    again. ``t0``: the chunk's first step (its captured loops are a key of their own).
    """
    lstm = config.mode == "lstm"
    pre_width = config.stash_width
    if graphed:
        if recompute is not None:
            fields = {**fields, "pre": _recomputed_pre(config, cuda_graphs.workspace)}
        state = {"dh": dh, "dc": dc}

        def keep_state() -> None:
            # Carried, the state gradients are the previous chunk's workspace buffers,
            # which a capture's warm-up (one run of the loop) would overwrite first.
            if carried:
                state.update({k: v.clone() for k, v in state.items() if v is not None})

        buf, copied = _bwd_entry_buffers(config, fields, cuda_graphs.workspace)
        entry = _backward_entry(config, buf, copied, t0, keep_state)
        dh, dc = state["dh"], state["dc"]
        if recompute is not None:
            recompute(out=buf.pre)
        for name in copied:
            getattr(buf, name).copy_(fields[name])
        _set_state(buf.dh, dh)
        if lstm:
            _set_state(buf.dc, dc)
        if entry is not None:
            entry.replay(buf)
        else:
            _bwd_loop(config, buf)
        return buf
    if recompute is not None:  # before the gate gradients exist: a lower peak
        pre = config.empty(config.T, config.B, pre_width)
        recompute(out=pre)
        fields = {**fields, "pre": pre}
    dh = dh if carried else _owned_state(config, dh, config.dtype)
    if lstm:
        dc = dc if carried else _owned_state(config, dc, torch.float32)
    buf = bwd_loop_buffers(config, **fields, dh=dh, dc=dc if lstm else None,
                       dg_over_pre=dg_overwrites_pre(config, captured=False))  # fmt: skip
    _bwd_loop(config, buf)
    return buf


def _backward_entry(
    config: LoopConfig, buf: BwdLoopBuffers, copied: list[str], t0: int, before_capture=None
) -> cuda_graphs.Entry | None:
    """The captured backward loop for these buffers (None: run it uncaptured).

    W_hh's address is in the key, with the chunk's first step and the names of the
    inputs copied into workspace; the inputs read in place (stash, cells, y, dy) are
    found by their addresses, as the workspace is."""
    key = (config, "bwd", t0, buf.w_hh.data_ptr(), tuple(copied))
    return cuda_graphs.acquire(
        key, config.device, buf, lambda b: _bwd_loop(config, b), before_capture=before_capture
    )


# A backward loop's inputs read where they are (the large ones; a replay finds them by
# address); the others (h0, lengths) are copied into workspace.
READ_IN_PLACE = ("pre", "cells", "y", "dy", "w_hh")


def _read_in_place(name: str, value: Tensor) -> bool:
    return name in READ_IN_PLACE and (name == "w_hh" or value.is_contiguous())


def _bwd_entry_buffers(config: LoopConfig, fields: dict, workspace) -> tuple[BwdLoopBuffers, list]:
    """A captured backward loop's buffers, and the names of the ``fields`` to copy into
    them before each run: the fields read in place as they are, the rest views of
    workspace; ``workspace(config, name, make)`` supplies the workspace."""
    copied = [n for n, v in fields.items() if isinstance(v, Tensor) and not _read_in_place(n, v)]

    def shared(name: str, value: Tensor) -> Tensor:
        key = _recomputed_pre_name(config) if name == "pre" else f"bwd.{name}"
        contiguous = torch.contiguous_format
        return workspace(config, key, lambda: torch.empty_like(value, memory_format=contiguous))

    inputs = {n: (shared(n, v) if n in copied else v) for n, v in fields.items()}
    dh = workspace(config, "bwd.dh", lambda: config.empty(config.B, config.H))
    dc = None
    if config.mode == "lstm":
        dc = workspace(
            config, "bwd.dc", lambda: config.empty(config.B, config.H, dtype=torch.float32)
        )
    buf = bwd_loop_buffers(config, **inputs, dh=dh, dc=dc, workspace=workspace,
                       dg_over_pre=dg_overwrites_pre(config, captured=True))  # fmt: skip
    return buf, copied


def dg_overwrites_pre(config: LoopConfig, *, captured: bool) -> bool:
    """Whether the backward loop writes the gate gradients over the pre-activations it
    reads: an LSTM's or GRU's recomputed ones (our own buffer; the step kernel loads a
    tile's gates before it stores their gradients at the same places, the GRU's in the
    first 3H of its 4H-wide rows, and no step reads another step's). A GRU's only where
    the loop is captured (its buffers held as arenas): uncaptured, the recompute's own
    temporaries are its peak. Never the stash: a saved tensor, which a retained graph
    reads again."""
    if config.memory != "recompute":
        return False
    return config.mode == "lstm" or (config.mode == "gru" and captured)


def _recomputed_pre(config: LoopConfig, workspace) -> Tensor:
    """The captured backward loop's buffer for recomputed pre-activations (its gate
    gradients too, ``dg_overwrites_pre``: then its own arena name, which shares "gates"
    with the forward's)."""
    width = config.stash_width
    return workspace(config, _recomputed_pre_name(config),
                     lambda: config.empty(config.T, config.B, width))  # fmt: skip


def _recomputed_pre_name(config: LoopConfig) -> str:
    """The workspace name of a backward loop's pre-activations where they are copied in
    (recomputed, or a stash not read in place)."""
    return "bwd.pre_dg" if dg_overwrites_pre(config, captured=True) else "bwd.pre"


@torch.no_grad()
def layer_backward(
    call: LayerCall,
    saved: tuple[Tensor, ...],
    y: Tensor,
    grad_y: Tensor | None,
    grad_hn: Tensor | None,
    grad_cn: Tensor | None,
    *,
    needs_input_grad: tuple[bool, ...] = (True,) * 8,
    use_graph: bool | None = None,
    fused: bool | None = None,
) -> tuple[Tensor | None, ...]:
    """Gradients of x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr (None where not needed).

    Runs in chunks of steps from the end; each chunk's weight gradients are GEMMs over
    its steps, so backward's extra memory does not grow with T.
    """
    check_layer(call)
    mode, x, h0, c0, memory = call.mode, call.x, call.h0, call.c0, call.memory
    lengths = call.lengths
    w_ih, w_hh, b_ih, b_hh, _ = call.weights
    need_x, need_h0, need_c0, need_wih, need_whh, need_bih, need_bhh, _ = needs_input_grad
    need_c0 = need_c0 and c0 is not None
    need_bih, need_bhh = need_bih and b_ih is not None, need_bhh and b_hh is not None
    if not any((need_x, need_h0, need_c0, need_wih, need_whh, need_bih, need_bhh)):
        return (None,) * 8
    config = loop_config(call, fused)
    T, B, gh = config.T, config.B, config.gh
    lengths = lengths.to(device=x.device, dtype=torch.int64) if lengths is not None else None
    x2d = x.reshape(T * B, x.shape[2])
    y = y.contiguous()
    dy = grad_y.contiguous() if grad_y is not None else None
    cells = saved[-1] if mode == "lstm" else None
    n_in = x.shape[2]
    grads = dict(grad_x=x.new_empty(T, B, n_in) if need_x else None)
    dh, dc = grad_hn, grad_cn if mode == "lstm" else None
    any_graphed = False
    steps = chunk_steps(T, B)
    for t1 in range(T, 0, -steps):
        t0 = max(0, t1 - steps)
        n, rows = t1 - t0, slice(t0 * B, t1 * B)
        chunk = with_steps(config, n)
        graphed = _graphed(chunk, use_graph)
        any_graphed |= graphed
        h_first = h0 if t0 == 0 else y[t0 - 1]
        recompute = None
        if memory == "recompute" and not mode.startswith("rnn"):
            recompute = functools.partial(
                _recompute_pre, chunk, x2d[rows], h_first, y[t0:t1], w_ih, w_hh, b_ih, b_hh
            )
        # Only gru's kernel reads h_{t-1} and only rnn's reads y_t: copy no more into a graph.
        fields = dict(
            pre=saved[0][t0:t1] if memory == "stash" and not mode.startswith("rnn") else None,
            cells=cells[t0 : t1 + 1] if cells is not None else None,
            h0=h_first if mode == "gru" else None,
            y=y[t0:t1] if mode != "lstm" else None,
            dy=dy[t0:t1] if dy is not None else None,
            w_hh=w_hh,
            lengths=lengths - t0 if lengths is not None else None,
        )
        buf = _bwd_chunk(chunk, fields, recompute, dh, dc, t1 < T, graphed, t0)
        dh, dc = buf.dh, buf.dc
        dg = buf.dg.view(n * B, gh)
        dgh = buf.dgh.view(n * B, gh) if buf.dgh is not None else dg
        if t1 == T:  # after the first chunk's loop, not during it: no addition to its peak
            grads |= dict(grad_wih=x.new_empty(gh, n_in) if need_wih else None,
                          grad_whh=x.new_empty(gh, config.H) if need_whh else None,
                          grad_bih=x.new_empty(gh) if need_bih else None,
                          grad_bhh=x.new_empty(gh) if need_bhh else None)  # fmt: skip
            pads = padded_operands.backward_operands(
                T, B, steps, n_in, config.H, gh, x.dtype, x.device,
                (need_x, need_wih, need_whh), _fresh(config))  # fmt: skip
            padded_operands.start_backward(pads, w_ih)
        add_chunk_grads(dg, dgh, x2d, w_ih, h0, y, t0, t1, first=t1 == T, ones=None, pads=pads,
                        **grads)  # fmt: skip
    padded_operands.finish_backward(pads, grads["grad_wih"], grads["grad_whh"])
    # A static buffer is overwritten by the loop's next run: hand out a copy.
    grad_h0 = (dh.clone() if any_graphed else dh) if need_h0 else None
    grad_c0 = dc.to(x.dtype, copy=True) if need_c0 else None
    return (grads["grad_x"], grad_h0, grad_c0, grads["grad_wih"], grads["grad_whh"],
            grads["grad_bih"], grads["grad_bhh"], None)


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
    (or backward) loop asks for and the cache keeps between calls, keyed
    ``("mirrorgrad.rnn arena", device, arena name)`` as the cache shares them (an arena
    is as large as the largest request): the same buffer builders as the capture, run
    on the meta device. Empty where the loop would not be captured (off CUDA, too large).
    The loops' outputs and the backward's large inputs are not held: they are each
    call's own tensors (READ_IN_PLACE)."""
    config = make_config(mode, T, B, H, dtype, torch.device("meta"), has_lengths, None, memory,
                         has_bias, default_fused(B), "ieee")  # fmt: skip
    forward_captured = cuda_graphs.captures_by_size(T * B * config.stash_width)
    if torch.device(device).type != "cuda":
        return {}
    record = cuda_graphs.ArenaSizes(device)
    if not backward and forward_captured:
        lengths = config.empty(B, dtype=torch.int64) if has_lengths else None
        w = config.empty(H, config.gh) if config.fused else config.empty(config.gh, H)
        _fwd_entry_buffers(config, w, config.empty(config.gh), lengths, record)
    chunk = with_steps(config, chunk_steps(T, B))
    if backward and cuda_graphs.captures_by_size(chunk.T * B * config.stash_width):
        fields = _bwd_fields_like(chunk, has_lengths, has_grad_y)
        if memory == "recompute" and not mode.startswith("rnn"):
            fields["pre"] = _recomputed_pre(chunk, record)
        _bwd_entry_buffers(chunk, fields, record)
    return record.held()


def _bwd_fields_like(config: LoopConfig, has_lengths: bool, has_grad_y: bool) -> dict:
    """Empty stand-ins (on ``config.device``) for a backward chunk's fields, as
    ``layer_backward`` passes them."""
    T, B, H, mode = config.T, config.B, config.H, config.mode
    stash = config.memory == "stash" and not mode.startswith("rnn")
    return dict(
        pre=config.empty(T, B, config.stash_width) if stash else None,
        cells=config.empty(T + 1, B, H, dtype=torch.float32) if mode == "lstm" else None,
        h0=config.empty(B, H) if mode == "gru" else None,
        y=config.empty(T, B, H) if mode != "lstm" else None,
        dy=config.empty(T, B, H) if has_grad_y else None,
        w_hh=config.empty(config.gh, H),
        lengths=config.empty(B, dtype=torch.int64) if has_lengths else None,
    )
