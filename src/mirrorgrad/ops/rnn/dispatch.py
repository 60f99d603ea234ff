"""Which RNN implementation runs: ``rnn(...)`` resolves ``impl`` and ``memory``.

``impl="auto"`` times the custom op's implementations (the persistent kernel where it
covers the shape, the split Triton kernels) and torch's own RNN (cuDNN on CUDA) once per
shape, forward and backward as the call runs them, and keeps the fastest; where it may
not time (torch.compile tracing, a CUDA Graph capture) it ranks the custom op's
implementations by ``cost.py``'s rule. ``impl="cudnn"`` runs torch's RNN outside the
custom ops, since cuDNN's backward needs its private reserve space that a fake kernel
cannot size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from mirrorgrad import _compat
from mirrorgrad._timing import time_calls
from mirrorgrad.ops.rnn import cost, graphs
from mirrorgrad.ops.rnn.cells import MEMORY_MODES, MODES
from mirrorgrad.ops.rnn.op import (
    EagerStack,
    _kernels,
    differentiable_stack,
    resolve_memory,
    triton_module,
)

IMPLS = ("auto", "triton", "reference", "cudnn", "persistent")
MEMORY = ("auto", *MEMORY_MODES)


def _cudnn(x, weights, hx, cx, lengths, *, mode, num_layers, bidirectional, has_biases,
           dropout, training):  # fmt: skip
    """torch's own RNN (cuDNN on CUDA, aten elsewhere), autograd by torch."""
    vf = _compat.vf_rnn(mode)
    state = (hx, cx) if mode == "lstm" else hx
    if lengths is None:
        out = vf(x, state, weights, has_biases, num_layers, dropout, training, bidirectional, False)
        return out[0], out[1], out[2] if mode == "lstm" else None
    packed = pack_padded_sequence(x, lengths.cpu(), enforce_sorted=False)
    order, unorder = packed.sorted_indices, packed.unsorted_indices
    state = (hx[:, order], cx[:, order]) if mode == "lstm" else hx[:, order]
    out = vf(packed.data, packed.batch_sizes, state, weights, has_biases, num_layers, dropout,
             training, bidirectional)  # fmt: skip
    y = PackedSequence(out[0], packed.batch_sizes, order, unorder)
    y = pad_packed_sequence(y, total_length=x.shape[0])[0]
    return y, out[1][:, unorder], out[2][:, unorder] if mode == "lstm" else None


# (mode, device, dtype, T, B, I, G*H, Hr, layers, bidirectional, varlen, memory, dropout,
#  training) -> the chosen impl; and the ms each candidate measured
_AUTO_CHOICE: dict[tuple, str] = {}
AUTO_TIMES: dict[tuple, dict[str, float]] = {}


def _time_ms(fn: Callable[[], None]) -> float:
    """Median ms of 5 forward+backward calls on the current GPU, after two warm-up calls
    (they compile kernels, capture the step loops and fill caches)."""
    return time_calls(fn, repeats=5, warmup=2, device="cuda").median_ms


def _choose_auto(
    key: tuple,
    candidates: dict[str, Callable[[], None]],
    timer: Callable[[Callable[[], None]], float] = _time_ms,
    rule: Callable[[], str] | None = None,
) -> str:
    """Time each candidate's forward+backward once per shape key; cache the fastest, and
    drop the CUDA Graphs that only the others captured.

    While torch.compile traces, ``rule()`` (else the first candidate) is taken untimed:
    the candidates it ranks are custom ops, one graph node with a fake kernel each,
    whereas torch's own RNN does not trace reliably (AOTAutograd fails on CPU's aten
    LSTM in torch 2.13). So is it while a CUDA Graph is captured (timing would
    synchronize), without caching the pick."""
    if torch.compiler.is_compiling():
        return rule() if rule is not None else next(iter(candidates))
    if key in _AUTO_CHOICE:
        return _AUTO_CHOICE[key]
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return rule() if rule is not None else next(iter(candidates))
    if len(candidates) == 1:
        choice = next(iter(candidates))
    else:
        times, used = {}, {}
        for name, step in candidates.items():
            with graphs.recording() as keys:
                times[name] = timer(step)
            used[name] = keys
        choice = min(times, key=times.__getitem__)
        AUTO_TIMES[key] = times
        graphs.release(set().union(*used.values()) - used[choice])
    _AUTO_CHOICE[key] = choice
    return choice


# A constant for given arguments: Dynamo calls it once while tracing instead of
# tracing into the cached import (it warns about every functools.cache it meets).
@torch.compiler.assume_constant_result
def _triton_supports(mode: str, proj: bool, dtype: torch.dtype, device: torch.device) -> bool:
    module = triton_module()
    return module is not None and module.supports(mode, proj=proj, dtype=dtype, device=device)


@torch.compiler.assume_constant_result
def _persistent_supports(mode: str, proj: bool, dtype: torch.dtype, device: torch.device,
                         hidden: int, batch: int) -> bool:  # fmt: skip
    """Whether impl="persistent" exists here and runs its persistent kernel for this
    layer shape (elsewhere it runs the split kernels: no candidate of its own)."""
    if "persistent" not in IMPLS:
        return False
    try:
        module = _kernels("persistent")
    except (ImportError, RuntimeError):
        return False
    supports = getattr(module, "supports_persistent", None)
    return supports is not None and supports(
        mode, proj=proj, dtype=dtype, device=device, hidden=hidden, batch=batch
    )


def rnn(
    x: Tensor,
    weights: Sequence[Tensor],
    hx: Tensor,
    cx: Tensor | None = None,
    *,
    mode: str,
    num_layers: int = 1,
    bidirectional: bool = False,
    has_biases: bool = True,
    proj_size: int = 0,
    dropout: float = 0.0,
    training: bool = False,
    lengths: Tensor | None = None,
    memory: str = "auto",
    state_clip: tuple[float, float] | None = None,
    impl: str = "auto",
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Multi-layer (bi)directional RNN, time-major: x [T,B,I] -> (y, h_n, c_n or None).

    weights: torch.nn's flat order; hx [L*D,B,Hr]; cx [L*D,B,H] (lstm); lengths int64 [B]
    (any order) for padded variable-length batches. Dropout (p=``dropout``) applies
    between layers when ``training``. ``memory="auto"`` is "recompute" for an LSTM whose
    gradients are needed (its stash is then cells only) and "stash" otherwise; while
    torch.compile traces, "auto" reaches the op, where ``mirrorgrad.compile``'s planner
    may choose (``mirror/op_memory.py``), the same default otherwise.
    """
    _check_arguments(x, mode, memory, impl, state_clip, proj_size > 0)
    p = float(dropout) if training and num_layers > 1 else 0.0
    tensors = [x, hx, *weights] + ([cx] if cx is not None else [])
    grad_inputs = [t for t in tensors if t.requires_grad] if torch.is_grad_enabled() else []
    need_saved = len(grad_inputs) > 0  # bool(list) does not trace in torch 2.11
    if memory == "auto" and not (need_saved and torch.compiler.is_compiling()):
        # Under compile "auto" reaches the op: mirrorgrad's planner chooses (op_memory).
        memory = resolve_memory(memory, mode) if need_saved else "stash"
    if lengths is not None:
        lengths = lengths.to(device=x.device, dtype=torch.int64)

    if not torch.compiler.is_compiling() and _compat.needs_plain_autograd(tensors):
        # Forward AD or a torch.func transform: the custom op has no rule for them.
        y, h_n, c_n = differentiable_stack(
            x, list(weights), hx, cx, lengths, _dropout_seed(p, x.device), mode, num_layers,
            bidirectional, has_biases, proj_size, p, state_clip, "reference",
        )  # fmt: skip
        return y, h_n, c_n if mode == "lstm" else None

    def custom(chosen: str) -> Callable[[], tuple]:
        def call():
            seed = _dropout_seed(p, x.device)
            config = (mode, num_layers, bidirectional, has_biases, proj_size, p, memory,
                      None if state_clip is None else list(state_clip), chosen)  # fmt: skip
            if need_saved and not torch.compiler.is_compiling():
                y, h_n, c_n = EagerStack.apply(config, x, hx, cx, lengths, seed, *weights)
            else:
                y, h_n, c_n, _ = torch.ops.mirrorgrad.rnn_forward(
                    x, list(weights), hx, cx, lengths, seed, *config, need_saved
                )
            return y, h_n, c_n if mode == "lstm" else None

        return call

    def cudnn() -> tuple:
        return _cudnn(x, list(weights), hx, cx, lengths, mode=mode, num_layers=num_layers,
                      bidirectional=bidirectional, has_biases=has_biases, dropout=p,
                      training=training)  # fmt: skip

    if impl == "auto":
        key = (mode, x.device, x.dtype, *x.shape, weights[0].shape[0], hx.shape[-1],
               num_layers, bidirectional, lengths is not None, memory, p > 0,
               need_saved)  # fmt: skip
        impl = _AUTO_CHOICE.get(key) if not torch.compiler.is_compiling() else None
        if impl is None:
            # cuDNN has no state clip, and no backward outside training mode (it raises).
            cudnn_ok = state_clip is None and (training or not grad_inputs)
            shape = cost.Shape(mode=mode, T=x.shape[0], B=x.shape[1], H=weights[1].shape[1],
                               layers=num_layers, directions=2 if bidirectional else 1)  # fmt: skip
            impl = _auto_impl(x, proj_size > 0, shape, key, custom,
                              cudnn if cudnn_ok else None, grad_inputs, memory)  # fmt: skip
    return cudnn() if impl == "cudnn" else custom(impl)()


def _auto_impl(x: Tensor, proj: bool, shape: cost.Shape, key: tuple, custom: Callable,
               cudnn: Callable | None, grad_inputs: list[Tensor], memory: str) -> str:  # fmt: skip
    """What impl="auto" runs: the reference on CPU or for an empty batch; on CUDA the
    fastest step of the custom op's implementations and cuDNN (None: not a candidate),
    timed once per ``key`` (shape and configuration); the cost rule where it cannot time."""
    if not _on_gpu(x) or x.shape[1] == 0:
        return "reference"
    memory = resolve_memory(memory, shape.mode)
    compiling = torch.compiler.is_compiling()
    fused = []  # the custom op's implementations: the only ones the rule may rank
    # While tracing, the persistent kernel is asked only where the rule could pick it (it
    # has constants): its plan depends on the batch, which int() then specialises (a
    # symbolic batch cannot reach an assume_constant_result function).
    ask = not compiling or cost.predicted_ms("persistent", memory, x.dtype, shape) is not None
    if ask and _persistent_supports(shape.mode, proj, x.dtype, x.device, shape.H, int(shape.B)):
        fused.append("persistent")
    fused.append("triton" if _triton_supports(shape.mode, proj, x.dtype, x.device) else "reference")

    def rule() -> str:
        return cost.pick(fused, memory, x.dtype, shape)

    if compiling:
        return rule()
    candidates = {name: _timed_step(custom(name), grad_inputs) for name in fused}
    if cudnn is not None:
        candidates["cudnn"] = _timed_step(cudnn, grad_inputs)
    return _choose_auto(key, candidates, rule=rule)


def _on_gpu(x: Tensor) -> bool:
    return x.device.type == "cuda"


def _check_arguments(x: Tensor, mode: str, memory: str, impl: str, state_clip, proj: bool):
    """rnn()'s argument checks: ValueError for options, RuntimeError for an empty sequence."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if memory not in MEMORY:
        raise ValueError(f"memory must be one of {MEMORY}, got {memory!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if state_clip is not None and mode != "lstm":
        raise ValueError("state_clip applies to LSTM only: drop it for GRU/RNN")
    # persistent runs what the split kernels run (and hands them the rest)
    if impl in ("triton", "persistent") and not _triton_supports(mode, proj, x.dtype, x.device):
        raise ValueError(
            f"impl={impl!r} does not support mode={mode!r}, proj={proj}, dtype={x.dtype} on "
            f"{x.device}: use impl='auto' or impl='reference'"
        )
    if impl == "cudnn" and state_clip is not None:
        raise ValueError("impl='cudnn' cannot clip the cell state: use impl='auto'")
    if x.shape[0] == 0:
        raise RuntimeError(
            "Expected sequence length to be larger than 0 in RNN: pass at least one step"
        )


def _dropout_seed(p: float, device: torch.device) -> Tensor:
    """The op's dropout seed, drawn from the default generator of the input's ``device``
    (torch.manual_seed reproduces masks) and kept there: a CPU seed would sync the host
    and, under torch.compile, put CPU kernels and a CPU tensor (no CUDA Graphs) in the
    graph. Never read when p == 0: left uninitialised (no fill kernel)."""
    if p > 0:
        return torch.randint(0, 2**62, (), dtype=torch.int64, device=device)
    return torch.empty((), dtype=torch.int64, device=device)


def _timed_step(call: Callable[[], tuple], grad_inputs: list[Tensor]) -> Callable[[], None]:
    """Forward, and backward of a scalar loss when some input needs a gradient."""

    def step() -> None:
        y, h_n, _ = call()
        if grad_inputs:
            torch.autograd.grad(y.float().square().mean() + h_n.float().mean(), grad_inputs)

    return step
