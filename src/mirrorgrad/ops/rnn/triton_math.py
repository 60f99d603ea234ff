"""Device functions the kernels of both Triton layers (kernels.py, persistent_kernels.py)
share: the gate nonlinearities, a masked fp32 tile load, and each cell's step forward
and its gate gradients (one formula for both layers)."""

import triton
import triton.language as tl


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def tanh(x):
    # tanh via sigmoid: exact enough in fp32 and available in the interpreter too.
    return 2.0 * sigmoid(2.0 * x) - 1.0


@triton.jit
def tile(ptr, rows, cols, mask, width, offset):
    """fp32 tile ``ptr[rows, offset + cols]`` of a row-major matrix ``width`` wide."""
    return tl.load(ptr + rows[:, None] * width + offset + cols[None, :], mask=mask, other=0.0).to(
        tl.float32
    )


@triton.jit
def store_gates(row, g0, g1, g2, g3, H, mask):
    """Four [BB, BN] gate tiles at ``row``, ``row + H``, ... in ``row``'s dtype."""
    ty = row.dtype.element_ty
    tl.store(row, g0.to(ty), mask=mask)
    tl.store(row + H, g1.to(ty), mask=mask)
    tl.store(row + 2 * H, g2.to(ty), mask=mask)
    tl.store(row + 3 * H, g3.to(ty), mask=mask)


@triton.jit
def lstm_cell(p_i, p_f, p_g, p_o, c_old, clip_lo, clip_hi, CLIP: tl.constexpr):
    """An LSTM step from its gates' pre-activations: (c_t, h_t)."""
    c = sigmoid(p_f) * c_old + sigmoid(p_i) * tanh(p_g)
    if CLIP:
        c = tl.minimum(tl.maximum(c, clip_lo), clip_hi)
    return c, sigmoid(p_o) * tanh(c)


@triton.jit
def gru_cell(r_pre, z_pre, xn, hn, h_old):
    """A GRU step's h_t: ``xn`` the input side of n, ``hn`` its hidden side (with b_hn)."""
    r = sigmoid(r_pre)
    z = sigmoid(z_pre)
    n = tanh(xn + r * hn)
    return (1.0 - z) * n + z * h_old.to(tl.float32)


@triton.jit
def gate_grads(drow, hrow, dc_ptr, idx, x0, x1, x2, x3, s0, s1, s2, dh, valid, mask,
               clip_lo, clip_hi, H, MODE: tl.constexpr, CLIP: tl.constexpr):  # fmt: skip
    """Step t's gate gradients of one [BB, BN] tile, stored at ``drow`` (gru: also the
    hidden side's at ``hrow``), zero on rows past their length; an LSTM's dc carried to
    step t-1 stored at ``dc_ptr + idx``. x0..x3: the stashed pre-activations; s0..s2:
    lstm c_{t-1}, c_t, dc; gru h_{t-1}; rnn y_t. dh: the gradient of h_t. Returns the
    part of dh_{t-1} that does not flow through W_hh."""
    gty = drow.dtype.element_ty
    if MODE == 0:
        i, f, g, o = sigmoid(x0), sigmoid(x1), tanh(x2), sigmoid(x3)
        c_old, c, dc_in = s0, s1, s2
        tc = tanh(c)
        dc = dc_in + dh * o * (1.0 - tc * tc)
        if CLIP:
            c_pre = f * c_old + i * g
            dc = tl.where((c_pre >= clip_lo) & (c_pre <= clip_hi), dc, 0.0)
        store_gates(drow, tl.where(valid, dc * g * i * (1.0 - i), 0.0),
                    tl.where(valid, dc * c_old * f * (1.0 - f), 0.0),
                    tl.where(valid, dc * i * (1.0 - g * g), 0.0),
                    tl.where(valid, dh * tc * o * (1.0 - o), 0.0), H, mask)  # fmt: skip
        tl.store(dc_ptr + idx, tl.where(valid, dc * f, dc_in), mask=mask)
        dh_direct = tl.zeros_like(dh)
    elif MODE == 1:
        r, z, xn, hn, h_old = sigmoid(x0), sigmoid(x1), x2, x3, s0
        n = tanh(xn + r * hn)
        dn = dh * (1.0 - z) * (1.0 - n * n)
        dr = tl.where(valid, dn * hn * r * (1.0 - r), 0.0).to(gty)
        dz = tl.where(valid, dh * (h_old - n) * z * (1.0 - z), 0.0).to(gty)
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
    return dh_direct
