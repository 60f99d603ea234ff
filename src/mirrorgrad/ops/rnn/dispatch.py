"""Which RNN implementation runs: ``rnn(...)`` resolves ``impl`` and ``memory``.

``impl="auto"`` times the custom op's implementations (the persistent kernels where
they cover the shape: Triton's and, with ``cuda.bindings``, the CUDA C++ one; the split
Triton kernels) and torch's own RNN (cuDNN on CUDA) once per
shape, forward and backward as the call runs them, and keeps the fastest; where it may
not time (a CUDA Graph capture) it ranks the custom op's implementations by
``time_model.py``'s rule. Inside ``dispatch_as_captured()`` the candidates are timed captured
in a CUDA Graph and replayed, the way a caller that captures its step runs them (host
launch costs gone), and that choice is cached apart from the uncaptured one.
``impl="cudnn"`` runs torch's RNN outside the custom ops, since cuDNN's backward needs
its private reserve space that a fake kernel cannot size.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from mirrorgrad import _compat
from mirrorgrad._cuda_graphs import capture
from mirrorgrad._timing import time_calls
from mirrorgrad.ops.rnn import cuda_graphs, time_model
from mirrorgrad.ops.rnn.cell_modes import MEMORY_MODES, MODES
from mirrorgrad.ops.rnn.op import (
    EagerStack,
    _kernels,
    differentiable_stack,
    resolve_memory,
    triton_module,
)

IMPLS = ("auto", "triton", "reference", "cudnn", "persistent", "cuda")
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
#  grads, clipped, recompute asked) -> the chosen impl; and the ms each candidate measured
_AUTO_CHOICE: dict[tuple, str] = {}
AUTO_TIMES: dict[tuple, dict[str, float]] = {}


_KEY_FIELDS = ("mode", "device", "dtype", "T", "B", "input", "gates_x_hidden", "state",
               "layers", "bidirectional", "varlen", "memory", "dropout", "grads", "clipped",
               "recompute_asked")  # fmt: skip


def auto_choices() -> list[dict]:
    """What ``impl="auto"`` chose in this process, one dict per shape key: the call's
    shape and configuration, ``captured`` (timed captured), ``compiled`` (chosen while
    torch.compile traced), ``choice`` and the ms each candidate measured (``times``)."""
    rows = []
    for key, choice in _AUTO_CHOICE.items():
        row = {name: str(v) if name in ("device", "dtype") else v
               for name, v in zip(_KEY_FIELDS, key)}  # fmt: skip
        tags = key[len(_KEY_FIELDS):]
        row.update(captured="captured" in tags, compiled="compiled" in tags, choice=choice,
                   times=dict(AUTO_TIMES.get(key, {})))  # fmt: skip
        rows.append(row)
    return rows

_captured_depth = 0  # > 0 inside dispatch_as_captured()


@contextlib.contextmanager
def dispatch_as_captured() -> Iterator[None]:
    """impl="auto" calls (and torch.compile traces) inside choose by timing each
    candidate captured in a CUDA Graph, as a caller that captures the step will run it
    (CUDA Graphs, ``mode="reduce-overhead"``, `mirrorgrad train lm`'s step): without the
    host's launch costs, which favour fewer, larger kernels uncaptured. The step loops
    inside run plainly (``cuda_graphs.plain_loops``): the caller's graph holds them."""
    global _captured_depth
    _captured_depth += 1
    try:
        with cuda_graphs.plain_loops():
            yield
    finally:
        _captured_depth -= 1


_rule_depth = 0  # > 0 inside choose_by_rule()


@contextlib.contextmanager
def choose_by_rule() -> Iterator[None]:
    """impl="auto" calls inside take the cost rule's pick among the custom op's
    implementations, untimed and uncached, and never cuDNN, and their step loops run
    plainly (``cuda_graphs.plain_loops``: no graph, no arena): for shapes that run a few
    times, as an evaluation pass. Timing and recording there cost more than they save,
    and cuDNN's timed call (a flat copy of the weights and its workspace: 48.5 MiB at the
    medium LM's evaluation batch on an H200) raised `mirrorgrad train lm`'s peak above
    its steps'."""
    global _rule_depth
    _rule_depth += 1
    try:
        with cuda_graphs.plain_loops():
            yield
    finally:
        _rule_depth -= 1


def _choice_key(key: tuple) -> tuple:
    """The cache key of a choice: captured and uncaptured timings choose apart. A call
    made while a CUDA Graph is captured runs captured, so it takes the captured choice
    (made in the warm-up inside ``dispatch_as_captured()``)."""
    on_cuda = len(key) > 1 and isinstance(key[1], torch.device) and key[1].type == "cuda"
    captured = _captured_depth or (on_cuda and torch.cuda.is_current_stream_capturing())
    return (*key, "captured") if captured else key


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _time_ms(fn: Callable[[], None]) -> float:
    """Median ms of 5 forward+backward calls on the current GPU, after four warm-up calls
    (they compile kernels, capture the step loops and fill caches: a step's addresses
    repeat, and its captured layers replay, from about its fifth call on). Inside
    ``dispatch_as_captured()``: 5 replays of the call captured in one CUDA Graph."""
    if not _captured_depth:
        return time_calls(fn, repeats=5, warmup=4, device="cuda").median_ms
    graph, _ = capture(fn)  # the warm-up's stream is the capture's (autograd's too)
    ms = time_calls(graph.replay, repeats=5, warmup=2, device="cuda").median_ms
    del graph  # and its memory pool
    return ms


def _choose_auto(
    key: tuple,
    candidates: dict[str, Callable[[], None]],
    timer: Callable[[Callable[[], None]], float] = _time_ms,
    rule: Callable[[], str] | None = None,
) -> str:
    """Time each candidate's forward+backward once per shape key; cache the fastest, and
    drop the CUDA Graphs that only the others captured.

    While torch.compile traces, ``rule()`` (else the first candidate) is taken untimed:
    the candidates here run on the traced (fake) tensors; ``_timed_while_tracing``
    times the custom op's implementations on tensors of its own instead. So is it while
    a CUDA Graph is captured (timing would synchronize), without caching the pick."""
    if torch.compiler.is_compiling():
        return rule() if rule is not None else next(iter(candidates))
    key = _choice_key(key)
    if key in _AUTO_CHOICE:
        return _AUTO_CHOICE[key]
    if _capturing():
        return rule() if rule is not None else next(iter(candidates))
    # The timed calls draw dropout seeds: the RNG state is kept, so that the call's own
    # masks are the ones torch.manual_seed gives, timed first or not.
    devices = [d for d in key[1:2] if isinstance(d, torch.device) and d.type == "cuda"]
    with torch.random.fork_rng(devices=devices):
        return _time_and_cache(key, candidates, timer)


def _time_and_cache(key: tuple, candidates: dict[str, Callable[[], None]],
                    timer: Callable[[Callable[[], None]], float]) -> str:  # fmt: skip
    """The fastest of ``candidates`` by ``timer``, cached under ``key``; the CUDA Graphs
    that only the others captured are released."""
    if len(candidates) == 1:
        choice = next(iter(candidates))
    else:
        times, used = {}, {}
        for name, step in candidates.items():
            with cuda_graphs.recording() as keys:
                times[name] = timer(step)
            used[name] = keys
        choice = min(times, key=times.__getitem__)
        AUTO_TIMES[key] = times
        cuda_graphs.release(set().union(*used.values()) - used[choice])
    _AUTO_CHOICE[key] = choice
    return choice


# (key, candidates, call) -> the choice; torch.compile calls it once while it traces.
@torch.compiler.assume_constant_result
def _timed_while_tracing(key: tuple, candidates: tuple[str, ...], call: tuple) -> str:
    """impl="auto"'s pick for a stack call that torch.compile traces, among the custom op's
    implementations ``candidates``: eager's pick where eager timed the call and picked
    one of them, else timed as eager times them, on fresh tensors of the call's shapes
    (the traced ones are fake), cached beside eager's pick (eager may yet time cuDNN
    against them). ``key`` is eager's key of the call;
    ``call``: (input size, hidden size, has_biases, dropout p, state_clip). The RNG
    state is kept (the timed calls draw dropout seeds) and the graphs the timed calls
    captured are released (their weights are gone after this). Where the compile
    replays its graphs as CUDA Graphs (``mode="reduce-overhead"``, the option
    ``triton.cudagraphs``) they are timed captured, as inside ``dispatch_as_captured()``."""
    if not _captured_depth and _compat.tracing_for_cuda_graphs():
        with dispatch_as_captured():
            return _timed_while_tracing(key, candidates, call)
    for cached in (_choice_key(key), (*_choice_key(key), "compiled")):
        if _AUTO_CHOICE.get(cached) in candidates:
            return _AUTO_CHOICE[cached]
    device = key[1]
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            with cuda_graphs.recording() as used:
                steps = _synthetic_steps(key, candidates, call)
                # Its own entry: eager's (cuDNN among its candidates) is eager's to time.
                choice = _time_and_cache((*_choice_key(key), "compiled"), steps, _time_ms)
                del steps
            cuda_graphs.release(used)
    except Exception as exc:  # timing is an optimisation: the rule can still rank them
        mode, _, dtype, T, B, _, _, _, layers, bidirectional = key[:10]
        shape = time_model.Shape(mode=mode, T=T, B=B, H=call[1], layers=layers,
                                 directions=2 if bidirectional else 1)  # fmt: skip
        choice = time_model.pick(list(candidates), resolve_memory(key[11], mode), dtype, shape)
        warnings.warn(f"mirrorgrad: impl='auto' could not time {', '.join(candidates)} while "
                      f"torch.compile traced ({type(exc).__name__}: {exc}); the cost rule "
                      f"picked {choice!r}", RuntimeWarning, stacklevel=2)  # fmt: skip
    return choice


def _synthetic_steps(key: tuple, candidates: tuple[str, ...], call: tuple) -> dict:
    """candidate -> a forward+backward step of the stack ``key`` and ``call`` describe,
    on random tensors (what ``_timed_while_tracing`` times)."""
    mode, device, dtype, T, B, _, gh, Hr, layers, bidirectional, varlen, memory = key[:12]
    need_saved = key[13]
    n_in, H, has_biases, p, clip = call
    D = 2 if bidirectional else 1

    def tensor(*size):
        return (torch.randn(size, device=device, dtype=dtype) / H**0.5).requires_grad_(need_saved)

    x = tensor(T, B, n_in)
    weights = []
    for layer in range(layers):
        for _ in range(D):
            weights += [tensor(gh, n_in if layer == 0 else D * Hr), tensor(gh, Hr)]
            weights += [tensor(gh), tensor(gh)] if has_biases else []
    hx = torch.zeros(layers * D, B, Hr, device=device, dtype=dtype)
    cx = torch.zeros(layers * D, B, H, device=device, dtype=dtype) if mode == "lstm" else None
    lengths = torch.full((B,), T, device=device, dtype=torch.int64) if varlen else None

    def step(name: str) -> Callable[[], tuple]:
        def run():
            config = (mode, layers, bidirectional, has_biases, 0, p, memory, clip, name)
            seed = _dropout_seed(p, device)
            return EagerStack.apply(config, x, hx, cx, lengths, seed, *weights)

        return run

    grad_inputs = [x, *weights] if need_saved else []
    return {name: _timed_step(step(name), grad_inputs) for name in candidates}


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


@torch.compiler.assume_constant_result
def _cuda_supports(mode: str, proj: bool, dtype: torch.dtype, device: torch.device,
                   hidden: int, batch: int) -> bool:  # fmt: skip
    """Whether impl="cuda" (the CUDA C++ persistent LSTM) runs this layer shape here,
    ``cuda.bindings`` installed."""
    from mirrorgrad.ops.rnn import cuda_persistent

    return cuda_persistent.supports_shape(mode, proj=proj, dtype=dtype, device=device,
                                          hidden=hidden, batch=batch)  # fmt: skip


def _check_cuda_impl(x: Tensor, weights: Sequence[Tensor], lengths: Tensor | None, mode: str,
                     proj: bool, state_clip) -> None:  # fmt: skip
    """impl="cuda"'s checks: ValueError where the kernel cannot run the call, ImportError
    (naming the extra to install) without ``cuda.bindings``."""
    from mirrorgrad.ops.rnn import cuda_lstm_kernel, cuda_persistent

    reason = cuda_persistent.unsupported_reason(
        mode, proj=proj, dtype=x.dtype, device=x.device, hidden=weights[1].shape[1],
        batch=x.shape[1], varlen=lengths is not None, clip=state_clip is not None,
    )  # fmt: skip
    if reason is not None:
        raise ValueError(f"impl='cuda' cannot run this call: {reason}. Use impl='auto': it "
                         f"runs the fastest implementation that can")  # fmt: skip
    cuda_lstm_kernel.bindings()


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
    # The CUDA C++ kernel always stashes (2.5x recompute's fp32 cells in bf16, 5x in fp32):
    # auto offers it unless the caller asked for recompute by name.
    recompute_asked = memory == "recompute"
    if impl == "cuda" and not torch.compiler.is_compiling():
        _check_cuda_impl(x, weights, lengths, mode, proj_size > 0, state_clip)
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
        key = _auto_key(x, weights, hx, lengths, mode, num_layers, bidirectional, memory, p,
                        need_saved, state_clip is not None, recompute_asked)  # fmt: skip
        compiling = torch.compiler.is_compiling()
        # Not asked while Dynamo traces (it reads the stream's capture state).
        choice_key = _choice_key(key) if not compiling else None
        impl = _AUTO_CHOICE.get(choice_key) if not compiling else None
        if impl is None:
            # cuDNN has no state clip, and no backward outside training mode (it raises);
            # its dropout state waits on the host, which a CUDA Graph capture forbids.
            captured = choice_key is not None and choice_key[-1] == "captured"
            cudnn_ok = (state_clip is None and (training or not grad_inputs)
                        and not (captured and p > 0))  # fmt: skip
            shape = time_model.Shape(mode=mode, T=x.shape[0], B=x.shape[1],
                                     H=weights[1].shape[1], layers=num_layers,
                                     directions=2 if bidirectional else 1)  # fmt: skip
            call = (x.shape[2], shape.H, has_biases, p,
                    None if state_clip is None else tuple(state_clip))  # fmt: skip
            impl = _auto_impl(x, proj_size > 0, shape, key, custom,
                              cudnn if cudnn_ok else None, grad_inputs, memory, call,
                              plain_lstm=(lengths is None and state_clip is None
                                          and not recompute_asked))  # fmt: skip
    return cudnn() if impl == "cudnn" else custom(impl)()


def _auto_key(x: Tensor, weights: Sequence[Tensor], hx: Tensor, lengths: Tensor | None,
              mode: str, num_layers: int, bidirectional: bool, memory: str, p: float,
              need_saved: bool, clipped: bool = False,
              recompute_asked: bool = False) -> tuple:  # fmt: skip
    """impl="auto"'s cache key of a call (the shape and configuration). Under compile
    memory "auto" (the planner's to decide) counts as what eager resolves it to, so that
    compiled and eager calls find one choice. A state clip and a recompute asked for by
    name are in it: they take candidates away (cuDNN has no clip; the CUDA C++ kernel
    takes neither), so a choice made without them must not serve a call with them."""
    memory = resolve_memory(memory, mode) if need_saved else memory
    return (mode, x.device, x.dtype, *x.shape, weights[0].shape[0], hx.shape[-1], num_layers,
            bidirectional, lengths is not None, memory, p > 0, need_saved, clipped,
            recompute_asked)  # fmt: skip


def _auto_impl(x: Tensor, proj: bool, shape: time_model.Shape, key: tuple, custom: Callable,
               cudnn: Callable | None, grad_inputs: list[Tensor], memory: str,
               call: tuple = (), plain_lstm: bool = False) -> str:  # fmt: skip
    """What impl="auto" runs: the reference on CPU or for an empty batch; on CUDA the
    fastest step of the custom op's implementations and cuDNN (None: not a candidate),
    timed once per ``key`` (shape and configuration). While torch.compile traces, cuDNN
    is no candidate (torch's RNN is no graph node), the custom op's implementations are
    timed as in eager (``_timed_while_tracing``, ``call`` its other arguments) where
    the shapes are static, and ranked by the cost rule otherwise. ``plain_lstm``: no
    lengths, no state clip and no recompute asked for (what the CUDA C++ kernel takes
    and keeps)."""
    if not _on_gpu(x) or x.shape[1] == 0:
        return "reference"
    memory = resolve_memory(memory, shape.mode)
    compiling = torch.compiler.is_compiling()
    static = _compat.static_sizes([v for v in key if isinstance(v, int)])
    fused = []  # the custom op's implementations: the only ones the rule may rank
    # A symbolic batch cannot reach an assume_constant_result function: with dynamic
    # shapes the persistent kernel is asked only where the rule could pick it (it has
    # constants); int() then specialises the batch.
    ask = (not compiling or static
           or time_model.predicted_ms("persistent", memory, x.dtype, shape) is not None)
    if ask and _persistent_supports(shape.mode, proj, x.dtype, x.device, shape.H, int(shape.B)):
        fused.append("persistent")
    # The CUDA C++ kernel has no cost-rule constants: asked where the batch is static.
    if (plain_lstm and (not compiling or static)
            and _cuda_supports(shape.mode, proj, x.dtype, x.device, shape.H, int(shape.B))):
        fused.append("cuda")
    fused.append("triton" if _triton_supports(shape.mode, proj, x.dtype, x.device) else "reference")

    def rule() -> str:
        return time_model.pick(fused, memory, x.dtype, shape)

    if compiling:
        if static and call and len(fused) > 1:
            return _timed_while_tracing(key, tuple(fused), call)
        return rule()
    if _rule_depth:
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
