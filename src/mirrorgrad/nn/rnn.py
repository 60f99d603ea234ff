"""Drop-in ``LSTM``, ``GRU`` and ``RNN`` running mirrorgrad's RNN op.

Subclasses of ``torch.nn.LSTM`` / ``GRU`` / ``RNN`` (so ``isinstance`` checks hold): same
constructor arguments, parameter names, shapes and initialisation, so
``load_state_dict`` works both ways; same
forward signature and outputs (optional hx, unbatched input, ``batch_first``,
``PackedSequence`` in and out). Extra keyword-only arguments: ``memory`` and ``impl``
(see ``mirrorgrad.ops.rnn.rnn``) and, for LSTM, ``state_clip=(lo, hi)``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from mirrorgrad import _compat
from mirrorgrad.nn.cells import cell_replacement
from mirrorgrad.ops.rnn import IMPLS, MEMORY, rnn

_OP_MODE = {"LSTM": "lstm", "GRU": "gru", "RNN_TANH": "rnn_tanh", "RNN_RELU": "rnn_relu"}


class _FusedRNN:
    """The forward of mirrorgrad's LSTM/GRU/RNN, mixed in before torch.nn's class, which
    owns parameters, ``_flat_weights``, checks, ``state_dict`` and pickling."""

    def _init_options(self, memory: str, impl: str, state_clip) -> None:
        if memory not in MEMORY:
            raise ValueError(f"memory must be one of {MEMORY}, got {memory!r}")
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        if impl == "cuda" and self.mode != "LSTM":
            raise ValueError(f"impl='cuda' (the CUDA C++ persistent LSTM) runs LSTMs only; "
                             f"use impl='auto' for {type(self).__name__}")  # fmt: skip
        if state_clip is not None:
            lo, hi = (float(v) for v in state_clip)
            if not lo < hi:
                raise ValueError(f"state_clip must be (lo, hi) with lo < hi, got {state_clip}")
            state_clip = (lo, hi)
        self.memory = memory
        self.impl = impl
        self.state_clip = state_clip

    def extra_repr(self) -> str:
        """torch.nn's repr, plus our options where they are not the defaults."""
        s = super().extra_repr()
        s += f", memory={self.memory!r}" if self.memory != "auto" else ""
        s += f", impl={self.impl!r}" if self.impl != "auto" else ""
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
            if state is not None and state.device != x.device:
                raise RuntimeError(
                    f"Input and hidden tensors are not at the same device, found input tensor at "
                    f"{x.device} and hidden tensor at {state.device}: use "
                    f"{name}.to({str(x.device)!r})"
                )
        if hx.dtype != x.dtype:
            raise RuntimeError(
                f"hidden state hx dtype ({hx.dtype}) does not match input dtype "
                f"({x.dtype}): use hx.to({x.dtype})"
            )

    def forward(self, input, hx=None):
        is_lstm = self.mode == "LSTM"
        packed = isinstance(input, PackedSequence)
        if packed:
            self.check_input(input.data, input.batch_sizes)
            x, h0, c0, lengths, rows = _unpack(input, hx, is_lstm)
            is_batched = True
        else:
            x, h0, c0, is_batched = self._time_major(input, hx, is_lstm)
            lengths = rows = None
        h0, c0 = self._initial_states(x, h0, c0)
        weights = [getattr(self, name) for name in self._flat_weights_names]
        if torch.is_autocast_enabled(x.device.type):
            # As torch.nn's RNNs under autocast: run in the autocast dtype.
            dtype = torch.get_autocast_dtype(x.device.type)
            x, h0 = x.to(dtype), h0.to(dtype)
            c0 = None if c0 is None else c0.to(dtype)
            weights = [w.to(dtype) for w in weights]
        elif c0 is not None and c0.dtype != x.dtype:
            c0 = c0.to(x.dtype)  # torch.nn accepts a cell state of another float dtype
        y, h_n, c_n = rnn(
            x, weights, h0, c0, mode=_OP_MODE[self.mode], num_layers=self.num_layers,
            bidirectional=self.bidirectional, has_biases=self.bias, proj_size=self.proj_size,
            dropout=self.dropout, training=self.training, lengths=lengths, memory=self.memory,
            state_clip=self.state_clip, impl=self.impl,
        )  # fmt: skip
        if packed:
            return _repack(y, h_n, c_n, rows, input, is_lstm)
        if not is_batched:
            y = y.squeeze(1)
            h_n = h_n.squeeze(1)
            c_n = None if c_n is None else c_n.squeeze(1)
        elif self.batch_first:
            y = y.transpose(0, 1)
        return (y, (h_n, c_n)) if is_lstm else (y, h_n)

    def _time_major(self, input: Tensor, hx, is_lstm: bool):
        """(x [T,B,I], h0, c0, is_batched) from a batched or unbatched tensor input."""
        if input.dim() not in (2, 3):
            tensor = " tensor" if self.mode.startswith("RNN") else ""  # torch.nn's wording
            raise ValueError(
                f"{type(self).__name__}: Expected input to be 2D or 3D, got {input.dim()}D"
                f"{tensor} instead: pass (T, B, input_size), (B, T, input_size) with "
                "batch_first, or (T, input_size)"
            )
        is_batched = input.dim() == 3
        if not is_batched:
            input = input.unsqueeze(0 if self.batch_first else 1)
        self.check_input(input, None)
        x = input.transpose(0, 1) if self.batch_first else input
        h0, c0 = (hx if hx is not None else (None, None)) if is_lstm else (hx, None)
        expected, kind = (3, "batched 3-D") if is_batched else (2, "unbatched 2-D")
        if is_lstm and hx is not None and (h0.dim(), c0.dim()) != (expected, expected):
            raise RuntimeError(
                f"For {kind} input, hx and cx should also be {expected}-D but got "
                f"({h0.dim()}-D, {c0.dim()}-D) tensors"
            )
        if not is_lstm and h0 is not None and h0.dim() != expected:
            raise RuntimeError(
                f"For {kind} input, hx should also be {expected}-D but got {h0.dim()}-D tensor"
            )
        if not is_batched:
            h0 = None if h0 is None else h0.unsqueeze(1)
            c0 = None if c0 is None else c0.unsqueeze(1)
        return x, h0, c0, is_batched

    def _initial_states(self, x: Tensor, h0: Tensor | None, c0: Tensor | None):
        """Zero states where none were given; sizes, devices and dtypes checked."""
        num_dirs = 2 if self.bidirectional else 1
        batch = x.shape[1]
        hidden = self.proj_size if self.proj_size > 0 else self.hidden_size
        expected_h = (self.num_layers * num_dirs, batch, hidden)
        expected_c = (self.num_layers * num_dirs, batch, self.hidden_size)
        if self.mode == "LSTM" and h0 is None and c0 is None and expected_h == expected_c:
            h0, c0 = x.new_zeros((2, *expected_h)).unbind(0)  # one fill (host time) for both
        if h0 is None:
            h0 = x.new_zeros(expected_h)
        if self.mode == "LSTM" and c0 is None:
            c0 = x.new_zeros(expected_c)
        if self.mode == "LSTM":  # torch.nn's messages: hidden[0] / hidden[1] for the LSTM
            self.check_hidden_size(h0, expected_h, "Expected hidden[0] size {}, got {}")
            self.check_hidden_size(c0, expected_c, "Expected hidden[1] size {}, got {}")
        else:
            self.check_hidden_size(h0, expected_h)
        self._check_devices_and_dtypes(x, h0, c0)
        return h0, c0


# A PackedSequence is unpacked and repacked with index arithmetic on the known shapes of
# its tensors (no .item(), no torch.nn.utils.rnn call, which Dynamo refuses to trace), so
# the module stays one graph under torch.compile(fullgraph=True).
def _packed_rows(batch_sizes: Tensor, n_rows: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(step, slot) of each row of a PackedSequence's data; slots in the packed order."""
    ends = batch_sizes.cumsum(0)  # [T], on the CPU like batch_sizes
    rows = torch.arange(n_rows)
    step = torch.searchsorted(ends, rows, right=True)
    slot = rows - (ends - batch_sizes)[step]
    return step.to(device), slot.to(device)


def _unpack(input: PackedSequence, hx, is_lstm: bool):
    """(x [T,B,I] padded, h0, c0, lengths, rows), all in the packed (sorted) batch order."""
    data, batch_sizes, sorted_indices = input.data, input.batch_sizes, input.sorted_indices
    h0, c0 = (hx if hx is not None else (None, None)) if is_lstm else (hx, None)
    if sorted_indices is not None:
        batch = sorted_indices.shape[0]
    elif h0 is not None and torch.compiler.is_compiling():
        batch = h0.shape[1]  # no .item() inside a graph; eager checks h0 against the data
    else:
        batch = int(batch_sizes[0])
    rows = _packed_rows(batch_sizes, data.shape[0], data.device)
    x = data.new_zeros(batch_sizes.shape[0], batch, data.shape[-1]).index_put(rows, data)
    lengths = (batch_sizes[:, None] > torch.arange(batch)[None, :]).sum(0).to(data.device)
    if sorted_indices is not None:
        h0 = None if h0 is None else h0.index_select(1, sorted_indices)
        c0 = None if c0 is None else c0.index_select(1, sorted_indices)
    return x, h0, c0, lengths, rows


def _repack(y: Tensor, h_n: Tensor, c_n, rows, like: PackedSequence, is_lstm: bool):
    """The module's output for a PackedSequence: y packed like ``like``, states in the
    caller's batch order."""
    out = PackedSequence(y[rows], like.batch_sizes, like.sorted_indices, like.unsorted_indices)
    if like.unsorted_indices is not None:
        h_n = h_n.index_select(1, like.unsorted_indices)
        c_n = None if c_n is None else c_n.index_select(1, like.unsorted_indices)
    return (out, (h_n, c_n)) if is_lstm else (out, h_n)


class LSTM(_FusedRNN, torch.nn.LSTM):
    """A multi-layer LSTM: ``torch.nn.LSTM`` running as one mirrorgrad op.

    A subclass of ``torch.nn.LSTM``: the same arguments, parameters (names, shapes,
    initialisation), ``state_dict``, checks and outputs, so a ``torch.nn.LSTM``'s
    weights load into it and back. The whole stack is one ``torch.library`` op, so
    ``torch.compile(fullgraph=True)`` captures it as one graph node and
    ``mirrorgrad.compile`` can choose its memory mode. On CUDA it runs fused Triton
    kernels (or cuDNN, where measured faster); elsewhere a plain-PyTorch reference.

    Args:
        input_size, hidden_size, num_layers, bias, batch_first, dropout,
        bidirectional, proj_size, device, dtype: as for ``torch.nn.LSTM``.
        memory: keyword-only. What the backward keeps: ``"stash"`` (the gates and
            cells of every step, as cuDNN), ``"recompute"`` (the cells only, about a
            third of the stash; the backward rebuilds all gates with one batched
            GEMM) or ``"auto"`` (default: recompute in eager mode; under
            ``mirrorgrad.compile`` the plan chooses).
        impl: keyword-only. ``"auto"`` (default: on CUDA, time the persistent
            kernels where they cover the shape, the split Triton kernels and cuDNN
            once per shape and keep the fastest), ``"triton"``, ``"persistent"``
            (Triton), ``"cuda"`` (the CUDA C++ persistent kernel: bf16, or fp32 with
            TF32 recurrent products as cuDNN's default; no projection, lengths or state
            clip; hidden up to about 1024 (padded to a multiple of 8) at batch up to 32,
            larger batches in groups of 32 rows where W still fits (bf16 650 at 128); needs
            ``pip install mirrorgrad[cuda]``), ``"cudnn"`` or
            ``"reference"`` (plain PyTorch; what runs on the CPU).
        state_clip: keyword-only ``(lo, hi)`` or None. Clamps the cell state every
            step (zero gradient where clamped), as MXNet's ``lstm_state_clip_min/max``.

    Shapes (L = sequence length, N = batch, D = 2 if bidirectional else 1,
    H_out = ``proj_size`` if > 0 else ``hidden_size``):
        - input: ``(L, N, input_size)``, ``(N, L, input_size)`` with
          ``batch_first=True``, ``(L, input_size)`` unbatched, or a ``PackedSequence``.
        - h_0: ``(D * num_layers, N, H_out)``; c_0: ``(D * num_layers, N,
          hidden_size)``; both zeros if not given.
        - output: ``(L, N, D * H_out)`` (batch first likewise, or packed as the input).
        - h_n, c_n: shaped as h_0 and c_0.

    Example::

        >>> lstm = mirrorgrad.nn.LSTM(10, 20, num_layers=2, memory="recompute")
        >>> x = torch.randn(5, 3, 10)
        >>> output, (h_n, c_n) = lstm(x)
        >>> output.shape, h_n.shape, c_n.shape
        (torch.Size([5, 3, 20]), torch.Size([2, 3, 20]), torch.Size([2, 3, 20]))
        >>> lstm.load_state_dict(torch.nn.LSTM(10, 20, num_layers=2).state_dict())
        <All keys matched successfully>
    """

    def __init__(
        self,
        *args,
        memory: str = "auto",
        impl: str = "auto",
        state_clip: tuple[float, float] | None = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._init_options(memory, impl, state_clip)


class GRU(_FusedRNN, torch.nn.GRU):
    """A multi-layer GRU: ``torch.nn.GRU`` running as one mirrorgrad op.

    A subclass of ``torch.nn.GRU`` with PyTorch's formula (the reset gate multiplies
    ``W_hn h + b_hn``): the same arguments, parameters, ``state_dict`` and outputs.
    See :class:`LSTM` for what the op brings.

    Args:
        input_size, hidden_size, num_layers, bias, batch_first, dropout,
        bidirectional, device, dtype: as for ``torch.nn.GRU``.
        memory: keyword-only ``"auto"`` (default; stash in eager mode, the plan's
            choice under ``mirrorgrad.compile``), ``"stash"`` or ``"recompute"``.
        impl: keyword-only ``"auto"``, ``"triton"``, ``"persistent"``, ``"cudnn"`` or
            ``"reference"``, as for :class:`LSTM`.

    Shapes (L = sequence length, N = batch, D = 2 if bidirectional else 1):
        - input: ``(L, N, input_size)`` (``(N, L, input_size)`` with
          ``batch_first=True``), ``(L, input_size)`` unbatched, or a ``PackedSequence``.
        - h_0: ``(D * num_layers, N, hidden_size)``, zeros if not given.
        - output: ``(L, N, D * hidden_size)``; h_n: shaped as h_0.

    Example::

        >>> gru = mirrorgrad.nn.GRU(10, 20, num_layers=2, batch_first=True)
        >>> output, h_n = gru(torch.randn(3, 5, 10))
        >>> output.shape, h_n.shape
        (torch.Size([3, 5, 20]), torch.Size([2, 3, 20]))
    """

    def __init__(self, *args, memory: str = "auto", impl: str = "auto", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._init_options(memory, impl, None)


class RNN(_FusedRNN, torch.nn.RNN):
    """A multi-layer Elman RNN (``tanh`` or ``relu``): ``torch.nn.RNN`` as one mirrorgrad op.

    A subclass of ``torch.nn.RNN``: the same arguments (``nonlinearity`` included),
    parameters, ``state_dict`` and outputs. See :class:`LSTM` for what the op brings;
    there is no persistent kernel for this cell, so ``impl="auto"`` chooses between
    the split Triton kernels and cuDNN.

    Args:
        input_size, hidden_size, num_layers, nonlinearity, bias, batch_first,
        dropout, bidirectional, device, dtype: as for ``torch.nn.RNN``.
        memory: keyword-only ``"auto"`` (default), ``"stash"`` or ``"recompute"``,
            as for :class:`GRU`.
        impl: keyword-only ``"auto"``, ``"triton"``, ``"cudnn"`` or ``"reference"``.

    Shapes: as for :class:`GRU`.

    Example::

        >>> rnn = mirrorgrad.nn.RNN(10, 20, nonlinearity="relu")
        >>> output, h_n = rnn(torch.randn(5, 3, 10), torch.zeros(1, 3, 20))
        >>> output.shape, h_n.shape
        (torch.Size([5, 3, 20]), torch.Size([1, 3, 20]))
    """

    def __init__(self, *args, memory: str = "auto", impl: str = "auto", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._init_options(memory, impl, None)


# Dynamo refuses every torch.nn.LSTM/GRU/RNN instance unless told otherwise; ours trace.
_compat.let_dynamo_trace_modules((LSTM, GRU, RNN))


def _replacement(module: torch.nn.Module, **options) -> torch.nn.Module | None:
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


def _with_weights(new: torch.nn.Module, module: torch.nn.Module) -> torch.nn.Module:
    new.load_state_dict(module.state_dict())
    return new.train(module.training)


def convert(model: torch.nn.Module, **options) -> torch.nn.Module:
    """Swap every torch.nn recurrent module in ``model`` for mirrorgrad's, in place.

    Each ``torch.nn.LSTM`` / ``GRU`` / ``RNN`` and ``LSTMCell`` / ``GRUCell`` /
    ``RNNCell`` becomes its mirrorgrad twin on the same device and dtype, with the same
    weights and training mode.

    Args:
        model: the module to convert (it may itself be one of those modules).
        **options: ``memory``, ``impl`` and (for LSTMs only) ``state_clip``, given to
            each new sequence module; the cells take their defaults.

    Returns:
        ``model``, or its replacement if ``model`` is itself a recurrent module.

    Example::

        >>> model = torch.nn.Sequential(torch.nn.LSTM(10, 20))
        >>> model = mirrorgrad.nn.convert(model, memory="stash")
        >>> type(model[0]).__module__, model[0].memory
        ('mirrorgrad.nn.rnn', 'stash')
    """

    def twin(module: torch.nn.Module) -> torch.nn.Module | None:
        return _replacement(module, **options) or cell_replacement(module)

    top = twin(model)
    if top is not None:
        return top
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = twin(child)
            if new is not None:
                setattr(parent, name, new)
    return model
