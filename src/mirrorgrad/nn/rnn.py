"""Drop-in ``LSTM``, ``GRU`` and ``RNN`` running mirrorgrad's RNN op.

Same constructor arguments, parameter names, shapes and initialisation as torch.nn
(they subclass ``torch.nn.RNNBase``), so ``load_state_dict`` works both ways; same
forward signature and outputs (optional hx, unbatched input, ``batch_first``,
``PackedSequence`` in and out). Extra keyword-only arguments: ``memory`` and ``impl``
(see ``mirrorgrad.ops.rnn.rnn``) and, for LSTM, ``state_clip=(lo, hi)``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from mirrorgrad.ops.rnn import IMPLS, MEMORY, rnn

_OP_MODE = {"LSTM": "lstm", "GRU": "gru", "RNN_TANH": "rnn_tanh", "RNN_RELU": "rnn_relu"}


class _RNNBase(torch.nn.RNNBase):
    """Shared forward of the three modules; torch.nn.RNNBase owns parameters and checks."""

    def __init__(
        self,
        mode: str,
        *args,
        memory: str = "auto",
        impl: str = "auto",
        state_clip: tuple[float, float] | None = None,
        **kwargs,
    ) -> None:
        super().__init__(mode, *args, **kwargs)
        if memory not in MEMORY:
            raise ValueError(f"memory must be one of {MEMORY}, got {memory!r}")
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        if state_clip is not None:
            lo, hi = (float(v) for v in state_clip)
            if not lo < hi:
                raise ValueError(f"state_clip must be (lo, hi) with lo < hi, got {state_clip}")
            state_clip = (lo, hi)
        self.memory = memory
        self.impl = impl
        self.state_clip = state_clip

    def extra_repr(self) -> str:
        s = super().extra_repr() + f", memory={self.memory!r}, impl={self.impl!r}"
        return s + (f", state_clip={self.state_clip}" if self.state_clip is not None else "")

    def _check_devices_and_dtypes(self, x: Tensor, hx: Tensor, cx: Tensor | None) -> None:
        weight = self._flat_weights[0]
        if x.device != weight.device:
            raise RuntimeError(
                f"Input and parameter tensors are not at the same device, found input tensor at "
                f"{x.device} and parameter tensor at {weight.device}: move one with "
                f"input.to({str(weight.device)!r}) or model.to({str(x.device)!r})"
            )
        for name, state in (("hx", hx), ("cx", cx)):
            if state is None:
                continue
            if state.device != x.device:
                raise RuntimeError(
                    f"Input and hidden tensors are not at the same device, found input tensor at "
                    f"{x.device} and hidden tensor at {state.device}: use "
                    f"{name}.to({str(x.device)!r})"
                )
            if state.dtype != x.dtype:
                raise RuntimeError(
                    f"hidden state {name} dtype ({state.dtype}) does not match input dtype "
                    f"({x.dtype}): use {name}.to({x.dtype})"
                )

    def forward(self, input, hx=None):
        is_lstm = self.mode == "LSTM"
        num_dirs = 2 if self.bidirectional else 1
        hidden = self.proj_size if self.proj_size > 0 else self.hidden_size
        packed = isinstance(input, PackedSequence)
        lengths = None
        is_batched = True
        if packed:
            self.check_input(input.data, input.batch_sizes)
            x, lengths = pad_packed_sequence(input)  # time-major, the caller's batch order
            batch = x.shape[1]
        else:
            if input.dim() not in (2, 3):
                raise ValueError(
                    f"{type(self).__name__}: Expected input to be 2D or 3D, got {input.dim()}D "
                    "instead: pass (T, B, input_size), (B, T, input_size) with batch_first, "
                    "or (T, input_size)"
                )
            is_batched = input.dim() == 3
            batch_dim = 0 if self.batch_first else 1
            if not is_batched:
                input = input.unsqueeze(batch_dim)
            self.check_input(input, None)
            x = input.transpose(0, 1) if self.batch_first else input
            batch = x.shape[1]
        h0, c0 = (hx if hx is not None else (None, None)) if is_lstm else (hx, None)
        expected_dim = 3 if is_batched else 2
        for name, state in (("hx", h0), ("cx", c0)):
            if state is not None and state.dim() != expected_dim:
                kind = "batched 3-D" if is_batched else "unbatched 2-D"
                raise RuntimeError(
                    f"For {kind} input, {name} should also be {expected_dim}-D but got "
                    f"{state.dim()}-D tensor"
                )
        if not is_batched:
            h0 = None if h0 is None else h0.unsqueeze(1)
            c0 = None if c0 is None else c0.unsqueeze(1)
        expected_h = (self.num_layers * num_dirs, batch, hidden)
        expected_c = (self.num_layers * num_dirs, batch, self.hidden_size)
        if h0 is None:
            h0 = x.new_zeros(expected_h)
        if is_lstm and c0 is None:
            c0 = x.new_zeros(expected_c)
        self.check_hidden_size(h0, expected_h, "Expected hidden[0] size {}, got {}")
        if is_lstm:
            self.check_hidden_size(c0, expected_c, "Expected hidden[1] size {}, got {}")
        self._check_devices_and_dtypes(x, h0, c0)
        weights = [getattr(self, name) for name in self._flat_weights_names]
        if torch.is_autocast_enabled(x.device.type):
            # As torch.nn's RNNs under autocast: run in the autocast dtype.
            dtype = torch.get_autocast_dtype(x.device.type)
            x, h0 = x.to(dtype), h0.to(dtype)
            c0 = None if c0 is None else c0.to(dtype)
            weights = [w.to(dtype) for w in weights]
        y, h_n, c_n = rnn(
            x, weights, h0, c0, mode=_OP_MODE[self.mode], num_layers=self.num_layers,
            bidirectional=self.bidirectional, has_biases=self.bias, proj_size=self.proj_size,
            dropout=self.dropout, training=self.training, lengths=lengths, memory=self.memory,
            state_clip=self.state_clip, impl=self.impl,
        )  # fmt: skip
        if packed:
            y = _repack(y, lengths, input)
        elif not is_batched:
            y = y.squeeze(1)
            h_n = h_n.squeeze(1)
            c_n = None if c_n is None else c_n.squeeze(1)
        elif self.batch_first:
            y = y.transpose(0, 1)
        return (y, (h_n, c_n)) if is_lstm else (y, h_n)


def _repack(y: Tensor, lengths: Tensor, like: PackedSequence) -> PackedSequence:
    """Pack y [T,B,...] (caller's order) with exactly ``like``'s batch sizes and indices."""
    if like.sorted_indices is not None:
        y = y.index_select(1, like.sorted_indices)
        lengths = lengths.index_select(0, like.sorted_indices.cpu())
    data = pack_padded_sequence(y, lengths, enforce_sorted=True).data
    return PackedSequence(data, like.batch_sizes, like.sorted_indices, like.unsorted_indices)


class LSTM(_RNNBase):
    """``torch.nn.LSTM`` on mirrorgrad's op; ``state_clip=(lo, hi)`` clamps the cell state
    every step (its gradient is zero where clamped), as MXNet's lstm_state_clip_min/max."""

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        proj_size: int = 0,
        device=None,
        dtype=None,
        *,
        memory: str = "auto",
        impl: str = "auto",
        state_clip: tuple[float, float] | None = None,
    ) -> None:
        super().__init__(
            "LSTM", input_size, hidden_size, num_layers, bias, batch_first, dropout,
            bidirectional, proj_size, device, dtype,
            memory=memory, impl=impl, state_clip=state_clip,
        )  # fmt: skip


class GRU(_RNNBase):
    """``torch.nn.GRU`` on mirrorgrad's op (PyTorch's formula: r multiplies W_hn h + b_hn)."""

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        device=None,
        dtype=None,
        *,
        memory: str = "auto",
        impl: str = "auto",
    ) -> None:
        super().__init__(
            "GRU", input_size, hidden_size, num_layers, bias, batch_first, dropout,
            bidirectional, 0, device, dtype, memory=memory, impl=impl,
        )  # fmt: skip


class RNN(_RNNBase):
    """``torch.nn.RNN`` (nonlinearity "tanh" or "relu") on mirrorgrad's op."""

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        nonlinearity: str = "tanh",
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        device=None,
        dtype=None,
        *,
        memory: str = "auto",
        impl: str = "auto",
    ) -> None:
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(
                f"Unknown nonlinearity '{nonlinearity}'. Select from 'tanh' or 'relu'."
            )
        self.nonlinearity = nonlinearity
        super().__init__(
            f"RNN_{nonlinearity.upper()}", input_size, hidden_size, num_layers, bias,
            batch_first, dropout, bidirectional, 0, device, dtype, memory=memory, impl=impl,
        )  # fmt: skip


def _replacement(module: torch.nn.Module, **options) -> _RNNBase | None:
    """mirrorgrad's twin of a torch.nn LSTM/GRU/RNN with the same weights, else None."""
    kind = type(module)
    if kind not in (torch.nn.LSTM, torch.nn.GRU, torch.nn.RNN):
        return None
    common = dict(
        num_layers=module.num_layers, bias=module.bias, batch_first=module.batch_first,
        dropout=module.dropout, bidirectional=module.bidirectional,
    )  # fmt: skip
    weight = module._flat_weights[0]
    factory = {"device": weight.device, "dtype": weight.dtype}
    size = (module.input_size, module.hidden_size)
    if kind is torch.nn.LSTM:
        new = LSTM(*size, proj_size=module.proj_size, **common, **factory, **options)
        return _with_weights(new, module)
    options.pop("state_clip", None)  # an LSTM-only option
    if kind is torch.nn.GRU:
        new = GRU(*size, **common, **factory, **options)
    else:
        new = RNN(*size, nonlinearity=module.nonlinearity, **common, **factory, **options)
    return _with_weights(new, module)


def _with_weights(new: _RNNBase, module: torch.nn.Module) -> _RNNBase:
    new.load_state_dict(module.state_dict())
    return new.train(module.training)


def convert(model: torch.nn.Module, **options) -> torch.nn.Module:
    """Swap every ``torch.nn.LSTM`` / ``GRU`` / ``RNN`` in ``model`` (in place) for
    mirrorgrad's module with the same weights; ``options`` (memory, impl, state_clip for
    LSTMs) go to the new modules. Returns ``model``, or its replacement if ``model`` is
    itself one of those modules."""
    top = _replacement(model, **options)
    if top is not None:
        return top
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = _replacement(child, **options)
            if new is not None:
                setattr(parent, name, new)
    return model
