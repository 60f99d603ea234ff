"""One layer-direction's step loop as both Triton layers (kernels.py, persistent.py) run
it: its configuration (``LoopConfig``), the argument checks, the input GEMM over all
steps, the backward's chunks of steps and their buffers."""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from mirrorgrad.ops import aligned_mm
from mirrorgrad.ops.rnn.cell_modes import GATES, MEMORY_MODES, MODES
from mirrorgrad.ops.rnn.layer_call import LayerCall
from mirrorgrad.ops.rnn.padded_operands import PaddedOperands
from mirrorgrad.ops.rnn.tuning import StepTuning, active

# The dtypes the Triton kernels take.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreting() -> bool:
    """Whether Triton runs its interpreter (``TRITON_INTERPRET=1``: kernels on CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(kw_only=True, slots=True, frozen=True)
class LoopConfig:
    """Everything a captured step loop depends on besides tensor values."""

    mode: str
    T: int
    B: int
    H: int
    dtype: torch.dtype
    device: torch.device
    has_lengths: bool
    clip: tuple[float, float] | None
    memory: str
    has_bias: bool
    fused: bool  # hidden GEMM inside the step kernel (else cuBLAS per step)
    precision: str  # tl.dot input precision: "tf32" as torch.backends.cuda.matmul allows

    @property
    def gh(self) -> int:
        return GATES[self.mode] * self.H

    @property
    def stash_width(self) -> int:
        return 4 * self.H if self.mode == "gru" else self.gh

    def empty(self, *shape: int, dtype: torch.dtype | None = None) -> Tensor:
        return torch.empty(shape, dtype=dtype or self.dtype, device=self.device)


def clip_args(config: LoopConfig) -> tuple[float, float]:
    """The state clip as the kernels take it: (lo, hi), zeros where there is none."""
    return (float(config.clip[0]), float(config.clip[1])) if config.clip is not None else (0.0, 0.0)


def check_layer(call: LayerCall) -> None:
    """The errors torch.nn would raise, and what the Triton layers do not run."""
    mode, x, w_hr, memory, state_clip = call.mode, call.x, call.w_hr, call.memory, call.state_clip
    if mode not in MODES:
        raise ValueError(f"unknown RNN mode {mode!r}; expected one of {MODES}")
    if memory not in MEMORY_MODES:
        raise ValueError(f"memory must be one of {MEMORY_MODES}, got {memory!r}")
    if w_hr is not None:
        raise NotImplementedError(
            "the Triton RNN kernels have no projection (proj_size > 0): use the reference path"
        )
    if x.dtype not in DTYPES:
        raise TypeError(
            f"the Triton RNN kernels take {DTYPES}, got {x.dtype}: cast, or use impl='reference'"
        )
    if state_clip is not None and mode != "lstm":
        raise ValueError("state_clip applies to mode='lstm' only")
    if x.dim() != 3 or x.shape[0] == 0:
        # torch.nn's own message and type for an empty sequence.
        raise RuntimeError("Expected sequence length to be larger than 0 in RNN")


def loop_config(call: LayerCall, fused: bool | None) -> LoopConfig:
    """The loop of ``call``; ``fused`` None: by batch size (``StepTuning.fused_max_batch``)."""
    x, clip = call.x, call.state_clip
    T, B, _ = x.shape
    tf32 = x.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    return make_config(
        call.mode,
        T,
        B,
        call.w_hh.shape[1],
        x.dtype,
        x.device,
        call.lengths is not None,
        tuple(float(v) for v in clip) if clip is not None else None,
        call.memory,
        call.b_ih is not None or call.b_hh is not None,
        default_fused(B) if fused is None else fused,
        "tf32" if tf32 else "ieee",
    )


def default_fused(B: int) -> bool:
    """Whether the step kernel runs the hidden GEMM itself at batch ``B`` (else cuBLAS)."""
    return active(StepTuning).fused_max_batch >= B


# One object per configuration: building and hashing a frozen dataclass on every call
# costs host time that a launch-bound loop pays in full.
@functools.lru_cache(maxsize=1024)
def make_config(mode, T, B, H, dtype, device, has_lengths, clip, memory, has_bias, fused,
                precision) -> LoopConfig:  # fmt: skip
    """The ``LoopConfig`` of these fields (one object each)."""
    return LoopConfig(mode=mode, T=T, B=B, H=H, dtype=dtype, device=device,
                      has_lengths=has_lengths, clip=clip, memory=memory, has_bias=has_bias,
                      fused=fused, precision=precision)  # fmt: skip


_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(LoopConfig))


def with_steps(config: LoopConfig, T: int) -> LoopConfig:
    """``config`` for a chunk of T steps."""
    if T == config.T:
        return config
    return make_config(*(T if name == "T" else getattr(config, name) for name in _CONFIG_FIELDS))


def chunk_steps(T: int, B: int) -> int:
    """Steps per backward chunk: dG is kept for one chunk only, at most
    ``StepTuning.bwd_chunk_rows`` + B rows whatever T is; chunks of equal size so that no
    tiny remainder chunk runs."""
    chunks = max(1, -(-T * B // active(StepTuning).bwd_chunk_rows))
    return -(-T // chunks)


def input_bias(mode: str, b_ih: Tensor | None, b_hh: Tensor | None) -> Tensor | None:
    """Bias folded into the input GEMM: gru keeps b_hh on the hidden side."""
    if mode == "gru" or b_hh is None:
        return b_ih
    return b_hh if b_ih is None else b_ih + b_hh


def input_gemm(x2d: Tensor, w_ih: Tensor, bias: Tensor | None, out: Tensor) -> None:
    """out = x2d @ w_ih^T (+ bias): the input side of every step at once."""
    if bias is None:
        torch.mm(x2d, w_ih.t(), out=out)
    else:
        torch.addmm(bias, x2d, w_ih.t(), out=out)


@dataclass(kw_only=True, slots=True)
class BwdLoopBuffers:
    """What one backward loop (a chunk of steps) reads and writes."""

    pre: Tensor | None  # [T, B, P] stash layout (rnn: None)
    cells: Tensor | None  # lstm: [T+1, B, H] fp32
    h0: Tensor | None  # gru: [B, H]
    y: Tensor | None  # gru, rnn: [T, B, H]
    dy: Tensor | None  # [T, B, H]
    dh: Tensor  # [B, H] running grad of h (fused: its direct part)
    dc: Tensor | None  # lstm: [B, H] fp32 running grad of c
    dg: Tensor  # [T, B, G*H]
    dgh: Tensor | None  # gru: [T, B, 3H]
    lengths: Tensor | None
    w_hh: Tensor


def bwd_loop_buffers(
    config: LoopConfig, *, pre, cells, h0, y, dy, w_hh, lengths, dh=None, dc=None, workspace=None,
    dg_over_pre: bool = False,
) -> BwdLoopBuffers:
    """Buffers of one backward loop; ``workspace(config, name, make)``, when given,
    supplies the gate gradients (shared between captured loops of one config).
    ``dg_over_pre``: the gate gradients are written over ``pre`` (kernels.py's
    ``dg_overwrites_pre``; its step kernel only: persistent.py keeps its own, padded, buffer)."""
    lstm = config.mode == "lstm"

    def gate_grads(name: str) -> Tensor:
        def make():
            return config.empty(config.T, config.B, config.gh)

        return make() if workspace is None else workspace(config, f"bwd.{name}", make)

    return BwdLoopBuffers(
        pre=pre,
        cells=cells,
        h0=h0,
        y=y,
        dy=dy,
        dh=dh if dh is not None else config.empty(config.B, config.H),
        dc=(dc if dc is not None else config.empty(config.B, config.H, dtype=torch.float32))
        if lstm
        else None,
        dg=pre[..., : config.gh] if dg_over_pre else gate_grads("dg"),
        dgh=gate_grads("dgh") if config.mode == "gru" else None,
        lengths=lengths,
        w_hh=w_hh,
    )



def add_chunk_grads(dg: Tensor, dgh: Tensor, x2d: Tensor, w_ih: Tensor, h0: Tensor, y: Tensor,
                    t0: int, t1: int, *, first: bool, ones: Tensor | None, grad_x: Tensor | None,
                    grad_wih: Tensor | None, grad_whh: Tensor | None, grad_bih: Tensor | None,
                    grad_bhh: Tensor | None, pads: PaddedOperands | None = None,
                    x_padded: bool = False) -> None:  # fmt: skip
    """The chunk of steps [t0, t1)'s share of the input and weight gradients (each None
    where not wanted): GEMMs over its gate gradients ``dg`` [rows, G*H] (``dgh``: the
    hidden side's, ``dg`` itself but for a GRU), written by the ``first`` chunk and added
    to by the others. dW_hh reads h_{t-1}: h0 for step 0, then y. ``pads``: the call's
    padded operands (padded_operands.py; ``start_backward`` before the first chunk,
    ``finish_backward`` after the last); ``x_padded``: ``pads.x`` holds the chunk's x
    already (the recomputed pre-activations' input GEMM read it there). The bias gradients
    are GEMVs against ``ones`` (at least ``rows``; None: made here): CUDA's sum over dim 0
    of a tall matrix stages partial sums in a buffer from the caching allocator (ATen's
    Reduce.cuh: 44 MiB per bias at deepspeech2's [4800, 2400] at the backward's peak), a
    GEMV none."""
    pads = pads or PaddedOperands()
    B = h0.shape[0]
    rows = dg.shape[0]
    if grad_wih is not None:
        x_rows = x2d[t0 * B : t1 * B]
        if pads.grad_wih is not None:  # pads.x: then overwritten by grad_x's padded product
            padded_x = pads.x[:rows]
            x_rows = padded_x if x_padded else aligned_mm.pad_into(padded_x, x_rows)
        _mm_into(pads.grad_wih if pads.grad_wih is not None else grad_wih, first, dg.t(), x_rows)
    if grad_x is not None:
        out = grad_x[t0:t1].view(rows, grad_x.shape[-1])
        if pads.w_ih is None:
            torch.mm(dg, w_ih, out=out)
        else:
            product = torch.mm(dg, pads.w_ih, out=pads.x[:rows])
            out.copy_(product[:, : out.shape[1]])
    if ones is None and (grad_bih is not None or grad_bhh is not None):
        ones = dg.new_ones(rows)  # only while the chunk's GEMVs run
    for out, g in ((grad_bih, dg), (grad_bhh, dgh)):
        if out is not None:
            if first:
                torch.mv(g.t(), ones[:rows], out=out)
            else:
                out.addmv_(g.t(), ones[:rows])
    if grad_whh is None:
        return
    H = y.shape[-1]
    if pads.h is not None:  # h_{t-1} of the chunk's steps in one padded block: one GEMM
        hprev = pads.h[:rows]
        done = 0
        if t0 == 0:
            hprev[:B, :H].copy_(h0)
            done = B
        hprev[done:, :H].copy_(y[max(t0 - 1, 0) : t1 - 1].reshape(-1, H))
        hprev[:, H:].zero_()
        _mm_into(pads.grad_whh, first, dgh.t(), hprev)
        return
    done = 0
    if t0 == 0:
        _mm_into(grad_whh, first, dgh[:B].t(), h0)
        first, done = False, B
    if rows > done:
        hprev = y[max(t0 - 1, 0) : t1 - 1].reshape(-1, H)
        _mm_into(grad_whh, first, dgh[done:].t(), hprev)


def _mm_into(out: Tensor, first: bool, a: Tensor, b: Tensor) -> None:
    """out = a @ b (first) or out += a @ b."""
    if first:
        torch.mm(a, b, out=out)
    else:
        out.addmm_(a, b)
