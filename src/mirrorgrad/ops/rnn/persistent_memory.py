"""What the persistent layer allocates per call (``workspace_bytes``) and what its CUDA
Graph cache holds between calls (``held_arenas``): the op's memory formulas ask these."""

from __future__ import annotations

import torch

from mirrorgrad.ops.rnn import cuda_graphs, kernels
from mirrorgrad.ops.rnn.cell_modes import GATES
from mirrorgrad.ops.rnn.padded_operands import operand_bytes
from mirrorgrad.ops.rnn.persistent_buffers import (
    bwd_buffers,
    copy_in,
    fwd_buffers,
    gates_bytes,
    padded,
)
from mirrorgrad.ops.rnn.persistent_plan import formula_plan
from mirrorgrad.ops.rnn.step_loop import chunk_steps, make_config


def workspace_bytes(
    mode: str, memory: str, T: int, B: int, H: int, dtype: torch.dtype, *, backward: bool,
    captured: bool = False, n_in: int | None = None, device: torch.device | str = "cpu",
) -> int:  # fmt: skip
    """Peak bytes one ``layer_forward`` (or ``layer_backward``) allocates beyond its inputs
    and outputs ([B, H]-sized buffers left out): forward the pre-activations where they
    are not the stash and every step's h ([T+1, B, H] with padded rows); backward per
    chunk the padded gate gradients and the recomputed pre-activations; both the padded
    operands of padded_operands.py, for an input of ``n_in`` features (None: H, a stacked
    layer's) on ``device``. ``captured``: the layer runs as a CUDA Graph, whose buffers
    are arenas held between calls (``held_arenas``), not allocated per call."""
    if captured:
        return 0
    d, gh = dtype.itemsize, GATES[mode] * H
    steps = chunk_steps(T, B)
    pads = operand_bytes(T, B, steps, H if n_in is None else n_in, H, gh, dtype, device,
                         backward=backward)  # fmt: skip
    if not backward:
        pre = 0 if mode == "lstm" and memory == "stash" else T * B * gh * d
        return pre + (T + 1) * B * padded(H, dtype) * d + pads
    rows = steps * B
    dg = rows * padded(gh, dtype) * d * (2 if mode == "gru" else 1)
    recompute = memory == "recompute" and not mode.startswith("rnn")
    width = 4 * H if mode == "gru" else gh
    return dg + (rows * width * d if recompute else 0) + pads


# Captured where kernels.py's loops are, sized alike (persistent.py's ``_graphed``).
loop_captured = kernels.loop_captured


def held_arenas(mode: str, memory: str, T: int, B: int, H: int, dtype: torch.dtype,
                device: torch.device, *, n_in: int | None = None,
                **flags: bool) -> dict[tuple, int]:  # fmt: skip
    """``kernels.held_arenas`` (the same arguments; ``flags``: its keywords) of the
    persistent layer, keyed alike (kernels.py's layers run where the persistent kernel
    does not): the same buffer builders as the capture, on the meta device, and the
    "gates" arena reserved for both phases. Bias gradients are assumed wanted (their
    GEMV's vector of ones: rows elements). ``n_in``: the input's features (None: H), for
    the padded operands' arenas."""
    device = torch.device(device)
    layout = formula_plan(mode, B, H, dtype, device)
    if layout is None:
        return kernels.held_arenas(mode, memory, T, B, H, dtype, device, **flags)
    n_in = H if n_in is None else n_in
    has_lengths, has_bias, backward = flags["has_lengths"], flags["has_bias"], flags["backward"]
    if device.type != "cuda" or not loop_captured(mode, T, B, H, device, backward=backward):
        return {}
    config = make_config(mode, T, B, H, dtype, torch.device("meta"), has_lengths, None,
                         memory, has_bias, False, "ieee")  # fmt: skip
    record = cuda_graphs.ArenaSizes(device)
    record.ask("pre", gates_bytes(config))
    empty, gh = config.empty, config.gh
    weights = dict(w_ih=empty(gh, n_in), w_hh=empty(gh, H), b_ih=empty(gh) if has_bias else None,
                   b_hh=empty(gh) if has_bias else None)  # fmt: skip
    lstm_state = empty(B, H) if mode == "lstm" else None
    common = dict(x=empty(T, B, n_in), h0=empty(B, H), **weights,
                  lengths=empty(B, dtype=torch.int64) if has_lengths else None)  # fmt: skip
    if backward:  # the state gradients given (autograd fills the unused ones with zeros)
        inputs = dict(stash=None, cells=None, y=empty(T, B, H), dy=None, grad_hn=empty(B, H),
                      grad_cn=lstm_state, **common)  # fmt: skip
        inputs = copy_in(config, layout, inputs, record)
        bwd_buffers(config, layout, inputs, (True,) * 4 + (has_bias,) * 2, record, device=device)
    else:
        inputs = copy_in(config, layout, dict(c0=lstm_state, **common), record)
        fwd_buffers(config, layout, inputs, record, device=device)
    return record.held()

