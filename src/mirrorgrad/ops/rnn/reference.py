"""Plain-PyTorch RNN layer with an explicit backward: the CPU path and the test oracle.

Per-layer contract, shared with ``kernels.py`` and ``persistent.py`` (same names, same
meaning). One layer, one direction, time-major; ``call`` a ``LayerCall``
(layer_call.py: the mode, the tensors, lengths, memory mode and state clip)::

    mode in {"lstm", "gru", "rnn_tanh", "rnn_relu"};  G = cell_modes.GATES[mode] = 4, 3, 1, 1

    layer_forward(call) -> (y, h_n, c_n, saved)
      call.lengths: int64 [B] on x.device, or None. Steps t >= lengths[b] leave row b's
        (h, c) unchanged and write y = 0 there.
      call.memory: "stash" or "recompute" (see SAVED LAYOUT).
      call.state_clip: (lo, hi) or None: c_t is clamped each step (lstm); its gradient
        is zero where the clamp was active (torch.clamp's rule: bounds count as inside).
      y [T,B,Hr]; h_n [B,Hr]; c_n [B,H] or None; saved: tuple laid out as saved_layout says.

    layer_backward(call, saved, y, grad_y, grad_hn, grad_cn, *, needs_input_grad=(8 bools))
        -> (grad_x, grad_h0, grad_c0, grad_w_ih, grad_w_hh, grad_b_ih, grad_b_hh, grad_w_hr)
      needs_input_grad follows the order of the outputs; a gradient not needed is None
      (and its GEMM is skipped). grad_y, grad_hn, grad_cn may be None (= zeros).

    dropout(x, p, seed, offset=0) -> Tensor
      Deterministic mask from (seed, offset); its backward is dropout(grad, p, seed, offset).
      Masks need not agree between implementations: forward and backward of one op
      call always run the same implementation.

    supports(mode, *, proj, dtype, device) -> bool: what this implementation handles.

    workspace_bytes(mode, memory, T, B, H, dtype, *, backward) -> int
      Peak bytes one layer_forward / layer_backward allocates beyond its inputs and
      outputs; the op's memory formula composes it over layers and directions. The GPU
      layers also take ``n_in`` (the layer's input features) and ``device``: their
      products' padded operands depend on them (padded_operands.py).

    saved_layout(mode, memory, T, B, H, dtype) -> [(shape, dtype), ...]
      Exactly what ``saved`` holds; the op's fake kernel builds its outputs from it.
      Each implementation defines its own layout (only its own backward reads it).

The reference's SAVED LAYOUT (all in the input dtype):

    lstm  stash      gates [T,B,4H] pre-activation (i, f, g, o; both biases added),
                     cells [T,B,H] (c after step t, after clipping, carried over padding)
    lstm  recompute  cells [T,B,H]; backward recomputes all gates with ONE GEMM
                     [x_t, h_{t-1}] @ [W_ih, W_hh]^T, h_{t-1} read from y (h0 at t=0)
    gru   stash      gates [T,B,4H]: r and z pre-activation (input + hidden parts),
                     then the input part of n (with b_in) and the hidden part (with b_hn)
    gru   recompute  nothing: gates come back from x and y in backward
    rnn_* (both)     nothing: the activation's derivative is read from y
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mirrorgrad.ops.rnn.cell_modes import GATES, MODES
from mirrorgrad.ops.rnn.layer_call import LayerCall

# Odd multipliers of the 32-bit integer hash below: under 2**31, so that a 32-bit value
# times one stays inside int64 (tensors have no unsigned 64-bit arithmetic).
_HASH_MULTIPLIERS = (0x7FEB352D, 0x2C1B3C6D, 0x297A2D39)
_LOW32 = 0xFFFFFFFF
_MASK_CHUNK = 1 << 16  # elements hashed at a time


def saved_layout(
    mode: str, memory: str, T: int, B: int, H: int, dtype: torch.dtype
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of each tensor in ``saved`` from ``layer_forward`` (layout above)."""
    if mode == "lstm":
        shapes = [(T, B, 4 * H), (T, B, H)] if memory == "stash" else [(T, B, H)]
    elif mode == "gru" and memory == "stash":
        shapes = [(T, B, 4 * H)]
    else:
        shapes = []
    return [(shape, dtype) for shape in shapes]


def workspace_bytes(
    mode: str, memory: str, T: int, B: int, H: int, dtype: torch.dtype, *, backward: bool
) -> int:
    """Estimated peak bytes one ``layer_forward`` (``layer_backward``) allocates beyond
    its inputs and outputs, in units of [T, B, H]: forward the input GEMM's output (G
    units) and a step's temporaries; backward every gate activation and per-step factor
    at once, computed for all steps before the loop (lstm 14 units, gru 11, rnn 2;
    recompute adds the rebuilt pre-activations)."""
    unit = T * B * H * dtype.itemsize
    gates = GATES[mode]
    if not backward:
        return gates * unit + 3 * B * gates * H * dtype.itemsize
    per_step = {"lstm": 14, "gru": 11}.get(mode, 2)
    rebuilt = {"lstm": 4, "gru": 4}.get(mode, 0) if memory == "recompute" else 0
    return (per_step + rebuilt) * unit


def supports(mode: str, *, proj: bool, dtype: torch.dtype, device: torch.device) -> bool:
    """The reference handles every mode, dtype and device."""
    return mode in MODES and (not proj or mode == "lstm")


def dropout(x: Tensor, p: float, seed: int, offset: int = 0) -> Tensor:
    """Inverted dropout with a mask that (seed, offset) fully determine."""
    if p == 0.0:
        return x
    if p >= 1.0:  # torch.nn's dropout(p=1): zeros, not 0/0
        return x * 0.0
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    flat_in, flat_out = x.reshape(-1), out.view(-1)
    threshold = int(p * 2**32)  # kept where the element's 32-bit hash reaches it
    key = _hash32(_hash32(_hash32((seed >> 32) & _LOW32) ^ (seed & _LOW32)) ^ (offset & _LOW32))
    for start in range(0, flat_in.numel(), _MASK_CHUNK):  # the hash's scratch stays small
        end = min(start + _MASK_CHUNK, flat_in.numel())
        keep = _hash(start, end, key, x.device) >= threshold
        torch.mul(flat_in[start:end], keep, out=flat_out[start:end])
    return out.div_(1.0 - p)


def dropout_scratch_bytes(numel: int) -> int:
    """Bytes ``dropout`` allocates beside its output: a chunk's two int64 hashes and mask."""
    return 17 * min(numel, _MASK_CHUNK)


def _hash32(z):
    """A 32-bit integer hash (xor-shift-multiply rounds) of an int, or in place of an int64
    tensor of values in [0, 2**32)."""
    if isinstance(z, int):
        for multiplier in _HASH_MULTIPLIERS:
            z = ((z ^ (z >> 16)) * multiplier) & _LOW32
        return z ^ (z >> 16)
    for multiplier in _HASH_MULTIPLIERS:
        z.bitwise_xor_(z >> 16).mul_(multiplier).bitwise_and_(_LOW32)
    return z.bitwise_xor_(z >> 16)


def _hash(start: int, end: int, key: int, device) -> Tensor:
    """32-bit hashes of elements [start, end) that ``key`` (of the seed and offset) and
    each element's index determine: a mask drawn this way, not from a generator, has no
    random op, so it can be recomputed under vmap (batched gradients, torch.func), which
    refuses them."""
    index = torch.arange(start, end, dtype=torch.int64, device=device)
    return _hash32(_hash32(index).bitwise_xor_(key))


def _active_steps(T: int, lengths: Tensor | None) -> Tensor | None:
    """[T,B,1] bool: step t of row b is inside its sequence."""
    if lengths is None:
        return None
    steps = torch.arange(T, device=lengths.device)
    return (steps[:, None] < lengths[None, :]).unsqueeze(-1)


def _lstm_cell(pre: Tensor, c: Tensor, state_clip) -> tuple[Tensor, Tensor]:
    """One LSTM step from pre-activation gates: (h before projection, c)."""
    i, f, g, o = pre.chunk(4, dim=-1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    if state_clip is not None:
        c = c.clamp(state_clip[0], state_clip[1])
    return torch.sigmoid(o) * torch.tanh(c), c


def _gru_cell(pre: Tensor, h: Tensor) -> Tensor:
    """One GRU step from [r_pre, z_pre, n_input, n_hidden] (PyTorch's formula)."""
    r_pre, z_pre, n_in, n_hid = pre.chunk(4, dim=-1)
    r, z = torch.sigmoid(r_pre), torch.sigmoid(z_pre)
    n = torch.tanh(n_in + r * n_hid)
    return (1 - z) * n + z * h


def _gru_pre(gi: Tensor, gh: Tensor) -> Tensor:
    """[.., 3H] input and hidden parts -> the stashed [.., 4H] layout."""
    H = gi.shape[-1] // 3
    return torch.cat([gi[..., : 2 * H] + gh[..., : 2 * H], gi[..., 2 * H :], gh[..., 2 * H :]], -1)


def layer_forward(call: LayerCall) -> tuple[Tensor, Tensor, Tensor | None, tuple[Tensor, ...]]:
    mode, x, h0, c0 = call.mode, call.x, call.h0, call.c0
    w_ih, w_hh, b_ih, b_hh, w_hr = call.weights
    lengths, memory, state_clip = call.lengths, call.memory, call.state_clip
    T, B, _ = x.shape
    H = w_hh.shape[0] // GATES[mode]
    active = _active_steps(T, lengths)
    gi = F.linear(x, w_ih, b_ih)  # [T,B,G*H]: one GEMM over all steps
    y = x.new_empty(T, B, h0.shape[1])
    stash_gates = memory == "stash" and mode in ("lstm", "gru")
    gates = x.new_empty(T, B, 4 * H) if stash_gates else None
    cells = x.new_empty(T, B, H) if mode == "lstm" else None
    h, c = h0, c0
    for t in range(T):
        gh = F.linear(h, w_hh, b_hh)
        if mode == "lstm":
            pre = gi[t] + gh
            h_new, c_new = _lstm_cell(pre, c, state_clip)
            if w_hr is not None:
                h_new = F.linear(h_new, w_hr)
        elif mode == "gru":
            pre = _gru_pre(gi[t], gh)
            h_new = _gru_cell(pre, h)
        else:
            pre = gi[t] + gh
            h_new = torch.tanh(pre) if mode == "rnn_tanh" else torch.relu(pre)
        if gates is not None:
            gates[t] = pre
        if active is None:
            h, y[t] = h_new, h_new
            c = c_new if mode == "lstm" else None
        else:
            h = torch.where(active[t], h_new, h)
            y[t] = torch.where(active[t], h_new, 0)
            c = torch.where(active[t], c_new, c) if mode == "lstm" else None
        if cells is not None:
            cells[t] = c
    saved = tuple(s for s in (gates, cells) if s is not None)
    return y, h, c, saved


def _previous_h(h0: Tensor, y: Tensor) -> Tensor:
    """[T,B,Hr] h_{t-1} for every step: h0, then the layer's own outputs."""
    return torch.cat([h0.unsqueeze(0), y[:-1]], 0)


def _lstm_backward(saved, x, h_prev, c0, w_ih, w_hh, b_ih, b_hh, w_hr, grad_y, dh, dc, *,
                   active, memory, state_clip):  # fmt: skip
    """Reverse-time loop; returns (dgates [T,B,4H], dy_total [T,B,Hr] or None, dh0, dc0)."""
    if memory == "stash":
        pre, cells = saved
    else:
        (cells,) = saved
        # One batched GEMM for all steps: every h_{t-1} is already known.
        bias = None if b_ih is None else b_ih + b_hh
        pre = F.linear(torch.cat([x, h_prev], -1), torch.cat([w_ih, w_hh], 1), bias)
    i, f, g, o = pre.chunk(4, dim=-1)
    i, f, g, o = torch.sigmoid(i), torch.sigmoid(f), torch.tanh(g), torch.sigmoid(o)
    c_prev = torch.cat([c0.unsqueeze(0), cells[:-1]], 0)
    tanh_c = torch.tanh(cells)
    # Per-step factors that do not depend on the recurrence, computed for all steps at once.
    dc_from_h = o * (1 - tanh_c * tanh_c)
    d_o = tanh_c * o * (1 - o)
    d_i = g * i * (1 - i)
    d_f = c_prev * f * (1 - f)
    d_g = i * (1 - g * g)
    if state_clip is not None:
        raw = f * c_prev + i * g
        inside = (raw >= state_clip[0]) & (raw <= state_clip[1])
    T = x.shape[0]
    dgates = pre.new_empty(pre.shape)
    dy_total = grad_y.new_empty(grad_y.shape) if w_hr is not None else None
    for t in reversed(range(T)):
        dh_t = dh + grad_y[t]
        if dy_total is not None:
            dy_total[t] = dh_t if active is None else dh_t * active[t]
            dh_t = dh_t @ w_hr
        dc_t = dc + dh_t * dc_from_h[t]
        if state_clip is not None:
            dc_t = dc_t * inside[t]
        torch.cat([dc_t * d_i[t], dc_t * d_f[t], dc_t * d_g[t], dh_t * d_o[t]], -1, out=dgates[t])
        if active is not None:
            dgates[t] *= active[t]
            torch.where(active[t], dgates[t] @ w_hh, dh, out=dh)
            torch.where(active[t], dc_t * f[t], dc, out=dc)
        else:
            torch.mm(dgates[t], w_hh, out=dh)
            torch.mul(dc_t, f[t], out=dc)
    return dgates, dgates, dy_total, o * tanh_c, dh, dc


def _gru_backward(saved, x, h_prev, w_ih, w_hh, b_ih, b_hh, grad_y, dh, *, active, memory):
    """Reverse-time loop; returns (d input gates, d hidden gates), both [T,B,3H], and dh0."""
    if memory == "stash":
        (pre,) = saved
    else:
        pre = _gru_pre(F.linear(x, w_ih, b_ih), F.linear(h_prev, w_hh, b_hh))
    r_pre, z_pre, n_in, n_hid = pre.chunk(4, dim=-1)
    r, z = torch.sigmoid(r_pre), torch.sigmoid(z_pre)
    n = torch.tanh(n_in + r * n_hid)
    d_z = (h_prev - n) * z * (1 - z)
    d_n = (1 - z) * (1 - n * n)
    d_r = n_hid * r * (1 - r)
    T, B = x.shape[:2]
    dgi = pre.new_empty(T, B, 3 * r.shape[-1])
    dgh = pre.new_empty(T, B, 3 * r.shape[-1])
    for t in reversed(range(T)):
        dh_t = dh + grad_y[t]
        dn = dh_t * d_n[t]
        dr = dn * d_r[t]
        dz = dh_t * d_z[t]
        torch.cat([dr, dz, dn], -1, out=dgi[t])
        torch.cat([dr, dz, dn * r[t]], -1, out=dgh[t])
        if active is not None:
            dgi[t] *= active[t]
            dgh[t] *= active[t]
            torch.where(active[t], torch.addcmul(dgh[t] @ w_hh, dh_t, z[t]), dh, out=dh)
        else:
            torch.addcmul(dgh[t] @ w_hh, dh_t, z[t], out=dh)
    return dgi, dgh, dh


def _rnn_backward(mode, y, w_hh, grad_y, dh, *, active):
    """Reverse-time loop; returns (d pre-activation [T,B,H], dh0)."""
    d_act = 1 - y * y if mode == "rnn_tanh" else (y > 0).to(y.dtype)
    dpre = y.new_empty(y.shape)
    for t in reversed(range(y.shape[0])):
        torch.mul(dh + grad_y[t], d_act[t], out=dpre[t])
        if active is not None:
            dpre[t] *= active[t]
            torch.where(active[t], dpre[t] @ w_hh, dh, out=dh)
        else:
            torch.mm(dpre[t], w_hh, out=dh)
    return dpre, dh


def _outer_sum(a: Tensor, b: Tensor) -> Tensor:
    """sum_t a_t^T b_t over all steps and rows as one GEMM: [T,B,M], [T,B,N] -> [M,N]."""
    return a.reshape(-1, a.shape[-1]).T @ b.reshape(-1, b.shape[-1])


def layer_backward(
    call: LayerCall,
    saved: tuple[Tensor, ...],
    y: Tensor,
    grad_y: Tensor | None,
    grad_hn: Tensor | None,
    grad_cn: Tensor | None,
    *,
    needs_input_grad: tuple[bool, ...] = (True,) * 8,
) -> tuple[Tensor | None, ...]:
    mode, x, h0, c0 = call.mode, call.x, call.h0, call.c0
    w_ih, w_hh, b_ih, b_hh, w_hr = call.weights
    lengths, memory, state_clip = call.lengths, call.memory, call.state_clip
    need_x, need_h0, need_c0, need_w_ih, need_w_hh, need_b_ih, need_b_hh, need_w_hr = (
        needs_input_grad
    )
    if not any(needs_input_grad):
        return (None,) * 8
    T = x.shape[0]
    active = _active_steps(T, lengths)
    # y is constant (zero) on padded steps: their incoming gradient goes nowhere.
    if grad_y is None:
        grad_y = y.new_zeros(y.shape)
    elif active is not None:
        grad_y = grad_y * active
    # State-gradient buffers, updated in place step to step (no per-step state allocation).
    dh = grad_hn.clone() if grad_hn is not None else h0.new_zeros(h0.shape)
    h_prev = _previous_h(h0, y)
    grad_c0 = grad_w_hr = None
    if mode == "lstm":
        dc = grad_cn.clone() if grad_cn is not None else c0.new_zeros(c0.shape)
        dgi, dgh, dy_total, h_full, grad_h0, grad_c0 = _lstm_backward(
            saved, x, h_prev, c0, w_ih, w_hh, b_ih, b_hh, w_hr, grad_y, dh, dc,
            active=active, memory=memory, state_clip=state_clip,
        )  # fmt: skip
        if need_w_hr and w_hr is not None:
            grad_w_hr = _outer_sum(dy_total, h_full)
    elif mode == "gru":
        dgi, dgh, grad_h0 = _gru_backward(
            saved, x, h_prev, w_ih, w_hh, b_ih, b_hh, grad_y, dh, active=active, memory=memory
        )
    else:
        dgi, grad_h0 = _rnn_backward(mode, y, w_hh, grad_y, dh, active=active)
        dgh = dgi
    # Weight gradients after the loop, each one GEMM (or reduction) over all steps.
    grad_x = (dgi @ w_ih) if need_x else None
    grad_w_ih = _outer_sum(dgi, x) if need_w_ih else None
    grad_w_hh = _outer_sum(dgh, h_prev) if need_w_hh else None
    grad_b_ih = dgi.sum((0, 1)) if need_b_ih and b_ih is not None else None
    grad_b_hh = dgh.sum((0, 1)) if need_b_hh and b_hh is not None else None
    return (
        grad_x,
        grad_h0 if need_h0 else None,
        grad_c0 if need_c0 else None,
        grad_w_ih,
        grad_w_hh,
        grad_b_ih,
        grad_b_hh,
        grad_w_hr,
    )
