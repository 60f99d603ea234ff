"""A CPU model of cuda_lstm.cu's work split, checked against the float64 reference.

``kernel_model`` (forward) and ``backward_kernel_model`` run the kernels' arithmetic as
the kernels lay it out: per CTA, warp, k-step and tile, every lane gathers the operand
words the kernel's formulas name; the MMA is modelled from PTX's fragment definitions
(which tile element each register of each lane holds), not from the kernel's; the
partial sums go where the kernel stores them and the cell reads them back as the kernel
does. Everything is float64, so any disagreement with the reference is a misplaced
element, not rounding. Keep it in step with cuda_lstm.cu.
"""

import math

import pytest
import torch
from benchmarks.persistent_cuda import prototype

from mirrorgrad.ops.rnn import cuda_lstm_kernel

WARPS = 8
LANE = torch.arange(32)
GROUP, QUAD = LANE // 4, LANE % 4


def _word(matrix: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, per_word: int):
    """[32, per_word]: the operand word of each lane (elements k..k+per_word-1 of its
    row), zero past the matrix's columns or rows (the kernel's guards)."""
    H = matrix.shape[1]
    out = torch.zeros(32, per_word, dtype=matrix.dtype)
    for e in range(per_word):
        inside = (k + e < H) & (rows >= 0) & (rows < matrix.shape[0])
        out[inside, e] = matrix[rows[inside], (k + e)[inside]]
    return out


def _add_tile(partial: torch.Tensor, mt: int, nt: int, acc: torch.Tensor) -> None:
    """Adds the C registers ``acc`` [32, 4] of tile (mt, nt) into a warp's ``partial``
    sums, by C's fragment layout (see ``_mma``)."""
    for j in range(4):
        partial[mt * 16 + GROUP + 8 * (j // 2), nt * 8 + 2 * QUAD + j % 2] += acc[:, j]


def _mma(a_regs, b_regs, per_word: int, k_step: int) -> torch.Tensor:
    """[32, 4] C registers of m16n8k{k_step} from the lanes' A registers [32, 4, w] and B
    registers [32, 2, w], placed by PTX's fragment layouts: A register r of lane l is
    row l//4 + 8*(r%2), word l%4 + 4*(r//2); B register r is word l%4 + 4*r of column
    l//4; C register j is row l//4 + 8*(j//2), column 2*(l%4) + j%2."""
    a = torch.zeros(16, k_step, dtype=a_regs.dtype)
    b = torch.zeros(k_step, 8, dtype=b_regs.dtype)
    for r in range(4):
        for e in range(per_word):
            a[GROUP + 8 * (r % 2), (QUAD + 4 * (r // 2)) * per_word + e] = a_regs[:, r, e]
    for r in range(2):
        for e in range(per_word):
            b[(QUAD + 4 * r) * per_word + e, GROUP] = b_regs[:, r, e]
    d = a @ b
    return torch.stack([d[GROUP + 8 * (j // 2), 2 * QUAD + j % 2] for j in range(4)], 1)


def kernel_model(xw, w_hh, b_hh, h0, c0, *, units: int, bf16: bool):
    """(y, h_n, c_n, stash) as cuda_lstm.cu's forward computes them, one CTA of ``units``
    units at a time; stash [T,B,5H]: the gates' pre-activations i, f, g, o and c_t."""
    T, B, _ = xw.shape
    H = w_hh.shape[1]
    per_word, k_step = (2, 16) if bf16 else (1, 8)
    rows_per_cta = 4 * units
    m_tiles, n_tiles = rows_per_cta // 16, math.ceil(B / 8)
    k_steps = math.ceil(H / k_step)
    k_per_warp = math.ceil(k_steps / WARPS)
    ctas = math.ceil(H / units)
    y = torch.zeros(T, B, H, dtype=xw.dtype)
    stash = torch.zeros(T, B, 5 * H, dtype=xw.dtype)
    c = c0.clone()
    for t in range(T):
        h_prev = h0 if t == 0 else y[t - 1]
        h_next = torch.zeros(B, H, dtype=xw.dtype)
        for cta in range(ctas):
            unit0 = cta * units
            partial = torch.zeros(WARPS, rows_per_cta, n_tiles * 8, dtype=xw.dtype)
            for warp in range(WARPS):
                for kk in range(k_per_warp):
                    step = warp + kk * WARPS
                    if step >= k_steps:
                        continue
                    ka = step * k_step + 2 * per_word * QUAD  # a lane's words: ka, ka + per_word
                    for nt in range(n_tiles):
                        n = nt * 8 + GROUP
                        b_regs = torch.stack([_word(h_prev, n, k, per_word)
                                              for k in (ka, ka + per_word)], 1)  # fmt: skip
                        for mt in range(m_tiles):
                            rows = []  # W_hh rows of local rows mt*16 + group (+ 8)
                            for half in range(2):
                                r = mt * 16 + GROUP + 8 * half
                                unit = unit0 + r % units
                                rows.append(torch.where(unit < H, (r // units) * H + unit, -1))
                            # w_frag[mt][kk]: [half] at ka, [2 + half] at ka + PER_WORD
                            a_regs = torch.stack([_word(w_hh, rows[half], k, per_word)
                                                  for k in (ka, ka + per_word)
                                                  for half in range(2)], 1)  # fmt: skip
                            _add_tile(partial[warp], mt, nt, _mma(a_regs, b_regs, per_word, k_step))
            for cell in range(units * B):
                unit, b = unit0 + cell % units, cell // units
                if unit >= H:
                    continue
                pre = [xw[t, b, q * H + unit] + b_hh[q * H + unit]
                       + partial[:, q * units + unit - unit0, b].sum()
                       for q in range(4)]  # fmt: skip
                gate = [torch.sigmoid(pre[0]), torch.sigmoid(pre[1]), torch.tanh(pre[2]),
                        torch.sigmoid(pre[3])]  # fmt: skip
                c[b, unit] = gate[1] * c[b, unit] + gate[0] * gate[2]
                h_next[b, unit] = gate[3] * torch.tanh(c[b, unit])
                stash[t, b, unit::H] = torch.stack([*pre, c[b, unit]])
        y[t] = h_next
    return y, y[-1], c, stash


def backward_kernel_model(w_hh, stash, c0, dy, dh_n, dc_n, *, units: int, bf16: bool):
    """(dgates, dh0, dc0) as cuda_lstm.cu's backward computes them, one CTA of ``units``
    units at a time: dgates_{t+1} [B, 4H] is the A operand (batch rows as M), the CTA's
    columns of W_hh the B operand (units as N), K the 4H gate rows."""
    T, B, H = dy.shape
    G = 4 * H
    per_word, k_step = (2, 16) if bf16 else (1, 8)
    m_tiles, n_tiles = math.ceil(B / 16), math.ceil(units / 8)
    k_steps = G // k_step
    k_per_warp = math.ceil(k_steps / WARPS)
    ctas = math.ceil(H / units)
    w_t = w_hh.t()  # [H, 4H]: a unit's column of W_hh as a row
    dgates = torch.zeros(T, B, G, dtype=dy.dtype)
    dh0, dc = torch.zeros(B, H, dtype=dy.dtype), dc_n.clone()
    for t in range(T - 1, -2, -1):
        for cta in range(ctas):
            unit0 = cta * units
            partial = torch.zeros(WARPS, m_tiles * 16, n_tiles * 8, dtype=dy.dtype)
            for warp in range(WARPS if t + 1 < T else 0):
                for kk in range(k_per_warp):
                    step = warp + kk * WARPS
                    if step >= k_steps:
                        continue
                    ka = step * k_step + 2 * per_word * QUAD  # a lane's words: ka, ka + per_word
                    for mt in range(m_tiles):
                        m = mt * 16 + GROUP
                        # a[0..3]: rows m, m + 8 at ka, then at ka + PER_WORD
                        a_regs = torch.stack([_word(dgates[t + 1], m + 8 * half, k, per_word)
                                              for k in (ka, ka + per_word)
                                              for half in range(2)], 1)  # fmt: skip
                        for nt in range(n_tiles):
                            n = nt * 8 + GROUP
                            unit = torch.where((n < units) & (unit0 + n < H), unit0 + n, -1)
                            b_regs = torch.stack([_word(w_t, unit, k, per_word)
                                                  for k in (ka, ka + per_word)], 1)  # fmt: skip
                            _add_tile(partial[warp], mt, nt, _mma(a_regs, b_regs, per_word, k_step))
            for cell in range(units * B):
                unit, b = unit0 + cell % units, cell // units
                if unit >= H:
                    continue
                dh = partial[:, b, unit - unit0].sum()
                if t < 0:
                    dh0[b, unit] = dh
                    continue
                dh = dh + dy[t, b, unit] + (dh_n[b, unit] if t == T - 1 else 0)
                pi, pf, pg, po, c_t = stash[t, b, unit::H]
                gi, gf, gg, go = pi.sigmoid(), pf.sigmoid(), pg.tanh(), po.sigmoid()
                c_prev = c0[b, unit] if t == 0 else stash[t - 1, b, 4 * H + unit]
                tanh_c = torch.tanh(c_t)
                dc_t = dc[b, unit] + dh * go * (1 - tanh_c**2)
                dgates[t, b, unit::H] = torch.stack([dc_t * gg * gi * (1 - gi),
                                                     dc_t * c_prev * gf * (1 - gf),
                                                     dc_t * gi * (1 - gg**2),
                                                     dh * tanh_c * go * (1 - go)])  # fmt: skip
                dc[b, unit] = dc_t * gf
    return dgates, dh0, dc


@pytest.mark.parametrize("bf16", [True, False])
@pytest.mark.parametrize(
    ("hidden", "batch", "units"),
    [(32, 1, 4), (40, 3, 8), (40, 9, 12), (136, 2, 16)],  # K padded, units past H, 2 N tiles
)
def test_kernel_model_matches_the_reference(bf16, hidden, batch, units):
    torch.manual_seed(0)
    T = 3
    lstm = torch.nn.LSTM(hidden, hidden).double()
    x = torch.randn(T, batch, hidden, dtype=torch.float64)
    h0 = torch.randn(batch, hidden, dtype=torch.float64)
    c0 = torch.randn(batch, hidden, dtype=torch.float64)
    w_ih, w_hh, b_ih, b_hh = prototype._weights(lstm)
    with torch.no_grad():
        want = prototype.reference_forward(x, h0, c0, w_ih, w_hh, b_ih, b_hh)
        xw = torch.nn.functional.linear(x, w_ih, b_ih)
        got = kernel_model(xw, w_hh, b_hh, h0, c0, units=units, bf16=bf16)[:3]
    assert prototype.relative_error(got, want) < 1e-12


@pytest.mark.parametrize("bf16", [True, False])
@pytest.mark.parametrize(
    ("hidden", "batch", "units", "T"),
    # units past H, 2 M tiles (batch 17), 2 N tiles (units 12), T = 1 (no product but dh0's)
    [(32, 1, 4, 3), (40, 3, 8, 2), (40, 17, 12, 2), (24, 2, 8, 1)],
)
def test_backward_kernel_model_matches_autograd(bf16, hidden, batch, units, T):
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(hidden, hidden).double()
    x = torch.randn(T, batch, hidden, dtype=torch.float64)
    h0, c0, dh_n, dc_n = (torch.randn(batch, hidden, dtype=torch.float64) for _ in range(4))
    dy = torch.randn(T, batch, hidden, dtype=torch.float64)
    weights = [w.detach() for w in prototype._weights(lstm)]
    w_ih, w_hh, b_ih, b_hh = weights
    want = prototype.reference_backward(x, h0, c0, *weights, dy, dh_n, dc_n)
    with torch.no_grad():
        xw = torch.nn.functional.linear(x, w_ih, b_ih)
        y, _, _, stash = kernel_model(xw, w_hh, b_hh, h0, c0, units=units, bf16=bf16)
        dgates, dh0, dc0 = backward_kernel_model(w_hh, stash, c0, dy, dh_n, dc_n,
                                                 units=units, bf16=bf16)  # fmt: skip
        dx, dw_ih, dw_hh, db = cuda_lstm_kernel.input_and_weight_gradients(x, h0, y, w_ih, dgates)
    got = (dx, dh0, dc0, dw_ih, dw_hh, db, db)
    errors = prototype.gradient_errors(got, want)
    assert max(errors.values()) < 1e-12, errors
