"""Drop-in ``LSTMCell``, ``GRUCell`` and ``RNNCell``: one step, on mirrorgrad's op where that
is measured faster, on torch.nn's own cell elsewhere.

Subclasses of torch.nn's cells (same arguments, parameters, checks, ``state_dict``), so
``isinstance`` checks hold. ``impl``: ``"torch"`` runs torch.nn's cell (plain ATen ops,
differentiable at every order); ``"op"`` runs ``mirrorgrad.ops.rnn.rnn`` with one step
(its fused kernels on CUDA); ``"auto"`` takes torch.nn's cell off CUDA and, on CUDA, times
both once per shape and keeps the faster (``tests/nn/gpu_cells_compare.py`` measures the two).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mirrorgrad.ops.rnn import rnn
from mirrorgrad.ops.rnn.dispatch import _choose_auto, _timed_step

CELL_IMPLS = ("auto", "op", "torch")


class _FusedCell:
    """The forward of mirrorgrad's cells, mixed in before torch.nn's cell class."""

    _op_mode: str
    _n_states: int  # 2 for the LSTM (h, c), 1 otherwise

    def __init__(self, *args, impl: str = "auto", **kwargs) -> None:
        # torch.nn's cell class comes next in the MRO: it takes the other arguments.
        super().__init__(*args, **kwargs)
        if impl not in CELL_IMPLS:
            raise ValueError(f"impl must be one of {CELL_IMPLS}, got {impl!r}")
        self.impl = impl

    def extra_repr(self) -> str:
        s = super().extra_repr()
        return s + (f", impl={self.impl!r}" if self.impl != "auto" else "")

    def forward(self, input: Tensor, hx=None):
        torch_cell = super().forward
        if self.impl == "torch" or input.numel() == 0 or self.hidden_size == 0:
            return torch_cell(input, hx)
        if self.impl == "auto":
            if input.device.type != "cuda":
                return torch_cell(input, hx)
            if self._auto_choice(input, hx) == "torch":
                return torch_cell(input, hx)
        return self._op_step(input, hx)

    def _auto_choice(self, input: Tensor, hx) -> str:
        states = [] if hx is None else list(hx) if self._n_states == 2 else [hx]
        tensors = [input, *states, *self.parameters()]
        grad_inputs = [t for t in tensors if t.requires_grad] if torch.is_grad_enabled() else []
        key = ("cell", self._op_mode, input.device, input.dtype, *input.shape,
               self.hidden_size, self.bias, len(grad_inputs) > 0)  # fmt: skip

        def h_of(out):  # (y, h_n, c_n) as _timed_step reads them: h is both
            h = out[0] if self._n_states == 2 else out
            return h, h, None

        def torch_call():
            return h_of(super(_FusedCell, self).forward(input, hx))

        def op_call():
            return h_of(self._op_step(input, hx))

        # torch.nn's cell first: the pick while torch.compile traces (Inductor fuses it).
        candidates = {"torch": _timed_step(torch_call, grad_inputs)}
        candidates["op"] = _timed_step(op_call, grad_inputs)
        return _choose_auto(key, candidates)

    def _op_step(self, input: Tensor, hx):
        name = type(self).__name__
        if input.dim() not in (1, 2):
            raise ValueError(f"{name}: Expected input to be 1D or 2D, got {input.dim()}D instead")
        states = None if hx is None else (list(hx) if self._n_states == 2 else [hx])
        for index, state in enumerate(states or []):
            if state.dim() not in (1, 2):
                label = f"hx[{index}]" if self._n_states == 2 else "hidden"
                raise ValueError(
                    f"{name}: Expected {label} to be 1D or 2D, got {state.dim()}D instead"
                )
        is_batched = input.dim() == 2
        x = input if is_batched else input.unsqueeze(0)
        if states is None:
            states = [x.new_zeros(x.shape[0], self.hidden_size)] * self._n_states
        elif not is_batched:
            states = [s.unsqueeze(0) for s in states]
        _check_step(x, states, self.input_size, self.hidden_size)
        weights = [self.weight_ih, self.weight_hh]
        if self.bias:
            weights += [self.bias_ih, self.bias_hh]
        c0 = states[1][None] if self._n_states == 2 else None
        if c0 is not None and c0.dtype != x.dtype:
            c0 = c0.to(x.dtype)
        _, h, c = rnn(x[None], weights, states[0][None], c0, mode=self._op_mode,
                      has_biases=self.bias)  # fmt: skip
        h = h[0] if is_batched else h[0, 0]
        if self._n_states == 1:
            return h
        return h, (c[0] if is_batched else c[0, 0])


def _check_step(x: Tensor, states: list[Tensor], input_size: int, hidden_size: int) -> None:
    """The checks (and messages) of ATen's cells: sizes, batch, device and dtype."""
    if x.shape[1] != input_size:
        raise RuntimeError(
            f"input has inconsistent input_size: got {x.shape[1]} expected {input_size}"
        )
    for index, state in enumerate(states):
        label = index if len(states) == 2 else ""
        if state.shape[0] != x.shape[0]:
            raise RuntimeError(
                f"Input batch size {x.shape[0]} doesn't match hidden{label} batch size "
                f"{state.shape[0]}"
            )
        if state.shape[1] != hidden_size:
            raise RuntimeError(
                f"hidden{label} has inconsistent hidden_size: got {state.shape[1]}, "
                f"expected {hidden_size}"
            )
        if state.device != x.device:
            raise RuntimeError(
                f"Input and hidden tensors are not at the same device, found input tensor at "
                f"{x.device} and hidden tensor at {state.device}: use .to({str(x.device)!r})"
            )
    if states[0].dtype != x.dtype:
        raise RuntimeError(
            f"hidden state dtype ({states[0].dtype}) does not match input dtype ({x.dtype}): "
            f"use .to({x.dtype})"
        )


class LSTMCell(_FusedCell, torch.nn.LSTMCell):
    """One LSTM step: ``torch.nn.LSTMCell`` on mirrorgrad's op where that is faster.

    A subclass of ``torch.nn.LSTMCell`` (same arguments, parameters, checks,
    ``state_dict``). Use it for loops that feed each step's output back in (decoders
    with attention); for a whole sequence, :class:`mirrorgrad.nn.LSTM` is faster.

    Args:
        input_size, hidden_size, bias, device, dtype: as for ``torch.nn.LSTMCell``.
        impl: keyword-only. ``"auto"`` (default: on CUDA, times the op's one-step
            kernels against torch's cell once per shape and keeps the faster; off
            CUDA, torch's cell), ``"op"`` (always mirrorgrad's op) or ``"torch"``
            (always torch's cell, differentiable at every order).

    Shapes (N = batch):
        - input: ``(N, input_size)`` or ``(input_size,)`` unbatched.
        - hx: a tuple ``(h_0, c_0)``, each ``(N, hidden_size)``; zeros if not given.
        - output: ``(h_1, c_1)``, each ``(N, hidden_size)``.

    Example::

        >>> cell = mirrorgrad.nn.LSTMCell(10, 20)
        >>> h, c = cell(torch.randn(3, 10))
        >>> h, c = cell(torch.randn(3, 10), (h, c))
        >>> h.shape
        torch.Size([3, 20])
    """

    _op_mode = "lstm"
    _n_states = 2


class GRUCell(_FusedCell, torch.nn.GRUCell):
    """One GRU step: ``torch.nn.GRUCell`` on mirrorgrad's op where that is faster.

    A subclass of ``torch.nn.GRUCell``; see :class:`LSTMCell`.

    Args:
        input_size, hidden_size, bias, device, dtype: as for ``torch.nn.GRUCell``.
        impl: keyword-only ``"auto"`` (default), ``"op"`` or ``"torch"``, as for
            :class:`LSTMCell`.

    Shapes (N = batch): input ``(N, input_size)`` or ``(input_size,)``; hx and the
    output ``(N, hidden_size)`` (hx zeros if not given).

    Example::

        >>> cell = mirrorgrad.nn.GRUCell(10, 20)
        >>> cell(torch.randn(3, 10)).shape
        torch.Size([3, 20])
    """

    _op_mode = "gru"
    _n_states = 1


class RNNCell(_FusedCell, torch.nn.RNNCell):
    """One Elman RNN step (``tanh`` or ``relu``): ``torch.nn.RNNCell`` on mirrorgrad's op.

    A subclass of ``torch.nn.RNNCell``; see :class:`LSTMCell`.

    Args:
        input_size, hidden_size, bias, nonlinearity, device, dtype: as for
            ``torch.nn.RNNCell``.
        impl: keyword-only ``"auto"`` (default), ``"op"`` or ``"torch"``, as for
            :class:`LSTMCell`.

    Shapes: as for :class:`GRUCell`.

    Example::

        >>> cell = mirrorgrad.nn.RNNCell(10, 20, nonlinearity="relu")
        >>> cell(torch.randn(3, 10), torch.zeros(3, 20)).shape
        torch.Size([3, 20])
    """

    _n_states = 1

    @property
    def _op_mode(self) -> str:
        return f"rnn_{self.nonlinearity}"


_TWINS = {torch.nn.LSTMCell: LSTMCell, torch.nn.GRUCell: GRUCell, torch.nn.RNNCell: RNNCell}


def cell_replacement(module: torch.nn.Module) -> torch.nn.Module | None:
    """mirrorgrad's twin of a torch.nn LSTMCell/GRUCell/RNNCell with the same weights, else
    None."""
    twin = _TWINS.get(type(module))
    if twin is None:
        return None
    extra = {"nonlinearity": module.nonlinearity} if twin is RNNCell else {}
    weight = module.weight_ih
    new = twin(module.input_size, module.hidden_size, module.bias, device=weight.device,
               dtype=weight.dtype, **extra)  # fmt: skip
    new.load_state_dict(module.state_dict())
    return new.train(module.training)
