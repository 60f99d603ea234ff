"""The persistent layer's buffers: everything one forward or backward reads and writes
(``FwdBuffers``, ``BwdBuffers``), built fresh or as views of cuda_graphs.py's arenas
where the layer is captured, and the bytes of the "gates" arena it asks for."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from mirrorgrad.ops.rnn import padded_operands
from mirrorgrad.ops.rnn.padded_operands import PaddedOperands
from mirrorgrad.ops.rnn.persistent_plan import Plan
from mirrorgrad.ops.rnn.step_loop import LoopConfig, chunk_steps

# Rows that other programs read during a launch (h_t, dG_t) start on a 128-byte L1 line.
_LINE_BYTES = 128


def padded(n: int, dtype: torch.dtype) -> int:
    """``n`` elements rounded up to whole L1 lines."""
    per_line = _LINE_BYTES // dtype.itemsize
    return -(-n // per_line) * per_line


def counters(layout: Plan) -> int:
    """Barrier counters a launch of ``layout`` uses: one per batch group, of the plan or
    of the streamed layout it may fall back to."""
    return max(layout.groups, layout.streamed_groups)


def gates_bytes(config: LoopConfig) -> int:
    """What this config asks of the "gates" arena, forward (pre-activations where they
    are not the stash) or backward (a chunk's padded gate gradients)."""
    d, B, gh = config.dtype.itemsize, config.B, config.gh
    forward = 0 if config.mode == "lstm" and config.memory == "stash" else config.T * B * gh
    backward = chunk_steps(config.T, B) * B * padded(gh, config.dtype)
    return max(forward, backward) * d


@dataclass(kw_only=True, slots=True)
class FwdBuffers:
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
    # workspace: x and W_ih padded to 16 bytes where the input product pays for it
    pad_x: Tensor | None
    pad_w_ih: Tensor | None

    @property
    def pads(self) -> PaddedOperands:
        return PaddedOperands(x=self.pad_x, w_ih=self.pad_w_ih)


def fwd_buffers(config: LoopConfig, layout: Plan, inputs: dict, workspace=None, *,
                device: torch.device | None = None):  # fmt: skip
    """A forward's buffers; ``workspace(key, name, make)``, when given, supplies those
    that are no output (fresh ones otherwise). ``device``: the one the padding decision
    is made for (None: ``config.device``; the memory formulas build on "meta")."""
    T, B, H, gh = config.T, config.B, config.H, config.gh
    lstm, gru = config.mode == "lstm", config.mode == "gru"

    def scratch(name: str, make):
        return make() if workspace is None else workspace((config, layout), name, make)

    pads = padded_operands.forward_operands(T, B, inputs["x"].shape[-1], gh, config.dtype,
                                            device or config.device,
                                            _padded_maker(config, scratch, "fwd"))  # fmt: skip

    def make_pre():
        return config.empty(T, B, gh)

    folded = inputs["b_ih"] is not None and inputs["b_hh"] is not None and not gru
    count = counters(layout)
    return FwdBuffers(
        **inputs,
        bias=scratch("persistent.bias", lambda: config.empty(gh)) if folded else None,
        h=scratch("persistent.h", lambda: config.empty(T + 1, B, padded(H, config.dtype))),
        count=scratch("persistent.count", lambda: config.empty(count, dtype=torch.int32)),
        pre=make_pre() if lstm and config.memory == "stash" else scratch("pre", make_pre),
        stash=config.empty(T, B, 4 * H) if gru and config.memory == "stash" else None,
        cells=config.empty(T + 1, B, H, dtype=torch.float32) if lstm else None,
        y=config.empty(T, B, H),
        **_final_states(config),
        pad_x=pads.x,
        pad_w_ih=pads.w_ih,
    )


def _padded_maker(config: LoopConfig, scratch, phase: str):
    """``make(name, shape)`` of padded_operands.py: a "persistent.{phase}.pad.*" buffer
    (each phase's own workspace: their shapes differ; cuda_graphs.py's arenas are shared)."""

    def make(name: str, shape: tuple) -> Tensor:
        return scratch(f"persistent.{phase}.pad.{name}", lambda: config.empty(*shape))

    return make


def _final_states(config: LoopConfig) -> dict:
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


def copy_in(config: LoopConfig, layout: Plan, inputs: dict, workspace) -> dict:
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


@dataclass(kw_only=True, slots=True)
class BwdBuffers:
    """Everything one backward (all its chunks) reads and writes, as ``FwdBuffers``."""

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
    count: Tensor  # [chunks, >= counters]
    dh: Tensor  # running grad of h (grad h0 at the end)
    dc: Tensor | None  # lstm: running grad of c, fp32
    grad_x: Tensor | None
    grad_wih: Tensor | None
    grad_whh: Tensor | None
    grad_bih: Tensor | None
    grad_bhh: Tensor | None
    grad_c0: Tensor | None
    # workspace: padded_operands.py's buffers (None where that side runs unpadded)
    pad_x: Tensor | None
    pad_w_ih: Tensor | None
    pad_grad_wih: Tensor | None
    pad_h: Tensor | None
    pad_grad_whh: Tensor | None

    @property
    def pads(self) -> PaddedOperands:
        return PaddedOperands(x=self.pad_x, w_ih=self.pad_w_ih, grad_wih=self.pad_grad_wih,
                              h=self.pad_h, grad_whh=self.pad_grad_whh)  # fmt: skip


def state_block(config: LoopConfig, layout: Plan, launches: int, needs: tuple) -> dict:
    """(state, count, dh, dc) and the small gradients (grad_c0, grad_bih, grad_bhh, where
    ``needs`` asks) as views of one buffer: the backward's barrier counters per launch
    ([launches, >= counters], rows 16 bytes apart) and running state gradients (dh in
    the layer's dtype, dc fp32 for an LSTM, else None) zeroed in one fill (every torch op
    costs tens of microseconds of host time where it is not captured); one allocation
    where there were four, so one address for a captured entry to find again."""
    B, H, gh, lstm = config.B, config.H, config.gh, config.mode == "lstm"
    _, need_c0, _, _, need_bih, need_bhh = needs
    d = config.dtype.itemsize
    per_launch = -(-counters(layout) // 4) * 4
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


def bwd_buffers(config: LoopConfig, layout: Plan, inputs: dict, needs: tuple,
                workspace=None, *, device: torch.device | None = None) -> BwdBuffers:  # fmt: skip
    """A backward's buffers (``fwd_buffers``'s rules); ``needs``: (x, c0, w_ih, w_hh,
    b_ih, b_hh) gradients wanted."""
    T, B, H, gh, mode = config.T, config.B, config.H, config.gh, config.mode
    steps = chunk_steps(T, B)
    launches = -(-T // steps)
    need_x, _, need_wih, need_whh, need_bih, need_bhh = needs
    recompute = config.memory == "recompute" and not mode.startswith("rnn")

    def scratch(name: str, make):
        return make() if workspace is None else workspace((config, layout), name, make)

    def gate_grads(name: str) -> Tensor:
        width = padded(gh, config.dtype)
        return scratch(name, lambda: config.empty(steps, B, width))

    folded = recompute and mode != "gru" and inputs["b_ih"] is not None
    folded = folded and inputs["b_hh"] is not None
    chunked_lengths = inputs["lengths"] is not None and launches > 1
    n_in = inputs["x"].shape[-1]
    pads = padded_operands.backward_operands(T, B, steps, n_in, H, gh, config.dtype,
                                             device or config.device, (need_x, need_wih, need_whh),
                                             _padded_maker(config, scratch, "bwd"),
                                             recompute=recompute)  # fmt: skip
    return BwdBuffers(
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
        **state_block(config, layout, launches, needs),
        grad_x=config.empty(T, B, n_in) if need_x else None,
        grad_wih=config.empty(gh, n_in) if need_wih else None,
        grad_whh=config.empty(gh, H) if need_whh else None,
        pad_x=pads.x,
        pad_w_ih=pads.w_ih,
        pad_grad_wih=pads.grad_wih,
        pad_h=pads.h,
        pad_grad_whh=pads.grad_whh,
    )  # fmt: skip

