"""The RNN layer's large products on operands padded to 16 bytes (aligned_mm.py's why):
the input product over all steps (x @ W_ih^T), grad_x (dG @ W_ih), grad_W_ih (dG^T @ x)
and grad_W_hh (dG^T @ h_{t-1}); the per-step recurrent products are left alone.

Each of these multiplies a [rows, width] operand (x or h_{t-1}: rows = steps x batch)
with a [G*H, width] one (W_ih, or the product grad_W_ih / grad_W_hh), width the input or
the hidden size. Where ``width`` is not a multiple of 16 bytes both get copied into
buffers ``aligned_width`` wide (zero past ``width``), once per call: W_ih once however
many chunks the backward runs, x and h_{t-1} a chunk at a time, the weight gradients
accumulated padded over the chunks and copied out at the end; grad_x's padded product
is written over the chunk's padded x (read by then) and copied out. Whether a layer
pads is ``padded_width``: ``aligned_mm.pays_to_pad`` on the same FLOPs and copied bytes
as ``aligned_mm.pads`` counts for one such product. The layers take their buffers from
``PaddedOperands`` (fresh, or a captured layer's workspace), so their memory formulas
count exactly these."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from mirrorgrad import _compat
from mirrorgrad.ops import aligned_mm
from mirrorgrad.ops.aligned_mm import pad_into


def padded_width(width: int, rows: int, gh: int, dtype: torch.dtype, device) -> int:
    """The width at which a layer runs its products of [rows, width] by [gh, width]
    operands: ``aligned_width`` where ``width`` is misaligned and the copies pay, else
    ``width``."""
    if not isinstance(rows, int):  # a symbolic size (the op's memory formulas): its hint
        rows = int(_compat.optimization_hint(rows, fallback=1))
    flops = 2.0 * rows * gh * width
    return aligned_mm.width_to_run(width, flops, (rows + gh) * width, dtype, torch.device(device))


@dataclass(slots=True)
class PaddedOperands:
    """One layer call's padded buffers, None where that side runs unpadded (or its
    gradient is not wanted). Forward: ``x`` [T*B, Ip] and ``w_ih`` [G*H, Ip]. Backward,
    a chunk's rows at a time: ``x`` [rows, Ip] (the chunk's x, then its grad_x product),
    ``w_ih`` (grad_x wanted), ``grad_wih`` [G*H, Ip], ``h`` [rows, Hp] (h_{t-1} of the
    chunk's steps) and ``grad_whh`` [G*H, Hp]."""

    x: Tensor | None = None
    w_ih: Tensor | None = None
    grad_wih: Tensor | None = None
    h: Tensor | None = None
    grad_whh: Tensor | None = None

    @property
    def any(self) -> bool:
        return self.x is not None or self.h is not None


def forward_operands(T: int, B: int, n_in: int, gh: int, dtype: torch.dtype, device,
                     make: Callable[[str, tuple], Tensor]) -> PaddedOperands:  # fmt: skip
    """The forward's buffers (``make(name, shape)`` makes each: fresh or workspace)."""
    Ip = padded_width(n_in, T * B, gh, dtype, device)
    if Ip == n_in:
        return PaddedOperands()
    return PaddedOperands(x=make("x", (T * B, Ip)), w_ih=make("w_ih", (gh, Ip)))


def backward_operands(T: int, B: int, steps: int, n_in: int, H: int, gh: int,
                      dtype: torch.dtype, device, needs: tuple[bool, bool, bool],
                      make: Callable[[str, tuple], Tensor], *,
                      recompute: bool = False) -> PaddedOperands:  # fmt: skip
    """The backward's buffers for chunks of ``steps`` steps; ``needs``: (grad_x,
    grad_W_ih, grad_W_hh) wanted; ``recompute``: each chunk's pre-activations are
    recomputed first, their input product on the padded x and W_ih too."""
    need_x, need_wih, need_whh = needs
    Ip = padded_width(n_in, T * B, gh, dtype, device)
    Hp = padded_width(H, T * B, gh, dtype, device)
    rows = steps * B
    input_side = Ip > n_in and (need_x or need_wih or recompute)
    hidden_side = Hp > H and need_whh
    return PaddedOperands(
        x=make("x", (rows, Ip)) if input_side else None,
        w_ih=make("w_ih", (gh, Ip)) if input_side and (need_x or recompute) else None,
        grad_wih=make("grad_wih", (gh, Ip)) if input_side and need_wih else None,
        h=make("h", (rows, Hp)) if hidden_side else None,
        grad_whh=make("grad_whh", (gh, Hp)) if hidden_side else None,
    )


def operand_bytes(T: int, B: int, steps: int, n_in: int, H: int, gh: int, dtype: torch.dtype,
                  device, *, backward: bool) -> int:  # fmt: skip
    """Bytes of ``forward_operands`` (or ``backward_operands``, every gradient wanted)."""

    def make(_name: str, shape: tuple) -> Tensor:
        return torch.empty(shape, dtype=dtype, device="meta")

    if backward:
        pads = backward_operands(T, B, steps, n_in, H, gh, dtype, device, (True,) * 3, make)
    else:
        pads = forward_operands(T, B, n_in, gh, dtype, device, make)
    buffers = (pads.x, pads.w_ih, pads.grad_wih, pads.h, pads.grad_whh)
    return sum(t.numel() for t in buffers if t is not None) * dtype.itemsize


def input_operands(pads: PaddedOperands, x2d: Tensor, w_ih: Tensor) -> tuple[Tensor, Tensor]:
    """The forward's (x2d, w_ih): their padded copies where ``pads`` has them."""
    if pads.x is None:
        return x2d, w_ih
    return pad_into(pads.x, x2d), pad_into(pads.w_ih, w_ih)


def start_backward(pads: PaddedOperands, w_ih: Tensor) -> None:
    """W_ih padded once for every chunk's grad_x."""
    if pads.w_ih is not None:
        pad_into(pads.w_ih, w_ih)


def finish_backward(pads: PaddedOperands, grad_wih: Tensor | None,
                    grad_whh: Tensor | None) -> None:  # fmt: skip
    """The weight gradients accumulated padded over the chunks, copied out."""
    for padded, out in ((pads.grad_wih, grad_wih), (pads.grad_whh, grad_whh)):
        if padded is not None and out is not None:
            out.copy_(padded[:, : out.shape[1]])
