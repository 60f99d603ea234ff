"""One layer-direction of the stack as every layer implementation takes it.

op.py builds a ``LayerCall`` per layer and direction and hands it to the implementation
the op runs (reference.py, kernels.py, persistent.py): ``layer_forward(call)`` and
``layer_backward(call, saved, y, grad_y, grad_hn, grad_cn, needs_input_grad=...)``;
reference.py's docstring is the contract.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


# A NamedTuple, not a frozen dataclass: as immutable, and a third of the construction
# time (a frozen dataclass sets each field through object.__setattr__), paid per layer
# and direction on every call of a launch-bound loop.
class LayerCall(NamedTuple):
    """x [T,B,I]; h0 [B,Hr] (Hr = proj_size or H); c0 [B,H] for an LSTM, else None;
    w_ih [G*H,I], w_hh [G*H,Hr], b_ih and b_hh [G*H] or None, w_hr [Hr,H] or None;
    lengths int64 [B] on x's device or None; memory "stash" or "recompute"; state_clip
    (lo, hi) or None (LSTM)."""

    mode: str
    x: Tensor
    h0: Tensor
    c0: Tensor | None
    w_ih: Tensor
    w_hh: Tensor
    b_ih: Tensor | None = None
    b_hh: Tensor | None = None
    w_hr: Tensor | None = None
    lengths: Tensor | None = None
    memory: str = "stash"
    state_clip: tuple[float, float] | None = None

    @property
    def weights(self) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
        """(w_ih, w_hh, b_ih, b_hh, w_hr): the order of the weight gradients."""
        return self.w_ih, self.w_hh, self.b_ih, self.b_hh, self.w_hr
