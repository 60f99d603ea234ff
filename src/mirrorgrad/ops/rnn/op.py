"""The whole RNN stack (layers x directions) as two torch.library ops, with autograd.

``mirrorgrad::rnn_forward`` / ``mirrorgrad::rnn_backward`` take the flat weight list in
torch.nn's order (per layer and direction: w_ih, w_hh, [b_ih, b_hh], [w_hr]) and run
one of the per-layer implementations (``reference`` on any device; on CUDA ``kernels``
and ``persistent`` (Triton) and ``cuda_persistent`` (CUDA C++)) for every layer and
direction (handing them contiguous tensors). Fake kernels,
an autograd formula and FLOP formulas make ``torch.compile`` capture the recurrence as
one node. Which implementation runs is ``dispatch``'s decision.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from types import ModuleType

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from mirrorgrad import _compat
from mirrorgrad.formulas import (
    register_held_formula,
    register_memory_formula,
    register_time_formula,
)
from mirrorgrad.ops.rnn import reference, time_model
from mirrorgrad.ops.rnn.cell_modes import GATES
from mirrorgrad.ops.rnn.layer_call import LayerCall


@functools.cache
def triton_module() -> ModuleType | None:
    """``ops.rnn.kernels`` (the Triton layer), or None where triton is not installed."""
    try:
        from mirrorgrad.ops.rnn import kernels
    except ImportError:
        return None
    return kernels


def _kernels(impl: str) -> ModuleType:
    """The per-layer implementation the op's ``impl`` argument names."""
    if impl == "reference":
        return reference
    if impl == "persistent":
        from mirrorgrad.ops.rnn import persistent  # Triton: imported where it runs

        return persistent
    if impl == "cuda":
        from mirrorgrad.ops.rnn import cuda_persistent

        return cuda_persistent
    module = triton_module()
    if module is None:
        raise RuntimeError("impl='triton' needs triton and mirrorgrad.ops.rnn.kernels")
    return module


def _weights_per_layer(has_biases: bool, proj_size: int) -> int:
    return 2 + 2 * has_biases + (proj_size > 0)


def _layer_weights(weights: Sequence[Tensor], index: int, has_biases: bool, proj_size: int):
    """(w_ih, w_hh, b_ih, b_hh, w_hr) of layer-direction ``index`` (None where absent)."""
    n = _weights_per_layer(has_biases, proj_size)
    w = [t.contiguous() for t in weights[index * n : (index + 1) * n]]
    w_ih, w_hh = w[0], w[1]
    b_ih, b_hh = (w[2], w[3]) if has_biases else (None, None)
    w_hr = w[-1] if proj_size > 0 else None
    return w_ih, w_hh, b_ih, b_hh, w_hr


def reverse_within_lengths(x: Tensor, lengths: Tensor | None) -> Tensor:
    """Reverse time [T,B,...] of each row within its own length; padding stays put."""
    if lengths is None:
        return x.flip(0)
    steps = torch.arange(x.shape[0], device=x.device)[:, None]
    index = torch.where(steps < lengths[None, :], lengths[None, :] - 1 - steps, steps)
    return x.gather(0, index.view(*index.shape, *([1] * (x.dim() - 2))).expand_as(x))


def _clip(state_clip: Sequence[float] | None) -> tuple[float, float] | None:
    return None if state_clip is None else (state_clip[0], state_clip[1])


def _seed(kernels: ModuleType, seed: Tensor, dropout: float) -> Tensor | int:
    """The dropout seed as ``kernels.dropout`` takes it: the Triton kernels read the tensor
    on the device (no host sync, CUDA Graph safe); the reference layer seeds a generator
    with an int. Without dropout the seed is never read (and left uninitialised)."""
    if kernels is reference:
        return int(seed.item()) if dropout > 0 else 0
    return seed


def resolve_memory(memory: str, mode: str) -> str:
    """The memory mode an op called with ``memory="auto"`` runs: recompute for an LSTM
    (cells only: about 3x smaller stash for one extra GEMM), stash otherwise. Under
    ``mirrorgrad.compile`` the planner rewrites "auto" to its own choice first."""
    if memory != "auto":
        return memory
    return "recompute" if mode == "lstm" else "stash"


def _saved_per_layer(impl: str, mode: str, memory: str) -> int:
    """How many tensors one layer-direction saves (shapes do not matter here)."""
    return len(_kernels(impl).saved_layout(mode, memory, 1, 1, 1, torch.float32))


def _forward_impl(
    x: Tensor,
    weights: list[Tensor],
    hx: Tensor,
    cx: Tensor | None,
    lengths: Tensor | None,
    seed: Tensor,
    mode: str,
    num_layers: int,
    bidirectional: bool,
    has_biases: bool,
    proj_size: int,
    dropout: float,
    memory: str,
    state_clip: list[float] | None,
    impl: str,
    need_saved: bool,
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """Returns (y [T,B,D*Hr], h_n [L*D,B,Hr], c_n [L*D,B,H] or empty, saved)."""
    memory = resolve_memory(memory, mode)
    kernels = _kernels(impl)
    seed_value = _seed(kernels, seed, dropout)
    # An implementation may run a whole stack at once (cuda_persistent's wavefront): it
    # returns None where it leaves the stack to its layers.
    if hasattr(kernels, "stack_forward"):
        whole = kernels.stack_forward(x, weights, hx, cx, lengths, seed_value, mode, num_layers,
                                      bidirectional, has_biases, proj_size, dropout, memory,
                                      state_clip, need_saved)  # fmt: skip
        if whole is not None:
            return whole

    def drop(layer_out: Tensor, layer: int) -> Tensor:
        return _dropout(kernels, layer_out, dropout, seed_value, layer)

    return _stack(
        kernels.layer_forward, drop, x, weights, hx, cx, lengths, mode, num_layers,
        bidirectional, has_biases, proj_size, memory, state_clip, need_saved,
    )  # fmt: skip


rnn_forward = torch.library.custom_op("mirrorgrad::rnn_forward", mutates_args=())(_forward_impl)


def _dropout(kernels: ModuleType, x: Tensor, p: float, seed: Tensor | int, layer: int) -> Tensor:
    """Dropout between layers (its own backward too); p = 1 gives zeros, as torch.nn."""
    if p >= 1.0:
        return torch.zeros_like(x)
    return kernels.dropout(x, p, seed, layer) if p > 0 else x


def _stack(layer_forward: Callable, drop: Callable[[Tensor, int], Tensor], x, weights, hx, cx,
           lengths, mode, num_layers, bidirectional, has_biases, proj_size, memory, state_clip,
           need_saved):  # fmt: skip
    """Layers x directions of ``layer_forward``, ``drop`` between layers: (y, h_n, c_n,
    saved), saved holding each layer's saved tensors and every layer's output but the last."""
    num_dirs = 2 if bidirectional else 1
    saved: list[Tensor] = []
    h_n, c_n = [], []
    layer_out = x
    for layer in range(num_layers):
        layer_in = drop(layer_out, layer) if layer > 0 else layer_out
        outs = []
        for direction in range(num_dirs):
            index = layer * num_dirs + direction
            w = _layer_weights(weights, index, has_biases, proj_size)
            xin = layer_in if direction == 0 else reverse_within_lengths(layer_in, lengths)
            y, h, c, layer_saved = layer_forward(LayerCall(
                mode, xin.contiguous(), hx[index].contiguous(),
                None if cx is None else cx[index].contiguous(), *w,
                lengths=lengths, memory=memory, state_clip=_clip(state_clip),
            ))  # fmt: skip
            outs.append(y if direction == 0 else reverse_within_lengths(y, lengths))
            h_n.append(h)
            c_n.append(c)
            if need_saved:
                saved.extend(layer_saved)
        layer_out = outs[0] if num_dirs == 1 else torch.cat(outs, -1)
        if need_saved and layer < num_layers - 1:
            saved.append(layer_out)
    c_out = torch.stack(c_n) if mode == "lstm" else x.new_empty(0)
    return layer_out, torch.stack(h_n), c_out, saved


def differentiable_stack(x, weights, hx, cx, lengths, seed, mode, num_layers, bidirectional,
                         has_biases, proj_size, dropout, state_clip, impl):  # fmt: skip
    """The stack in plain PyTorch ops (the reference layers), differentiable at every
    order and under forward AD and torch.func transforms: (y, h_n, c_n or empty).

    The dropout masks are ``impl``'s own (drawn on a tensor of ones), so a forward that ran
    ``impl`` and this recomputation agree."""
    kernels = _kernels(impl)
    seed_value = _seed(kernels, seed, dropout)

    def drop(layer_out: Tensor, layer: int) -> Tensor:
        ones = torch.ones(layer_out.shape, dtype=layer_out.dtype, device=layer_out.device)
        return layer_out * _dropout(kernels, ones, dropout, seed_value, layer)

    y, h_n, c_n, _ = _stack(
        reference.layer_forward, drop, x, weights, hx, cx, lengths, mode, num_layers,
        bidirectional, has_biases, proj_size, "recompute", state_clip, False,
    )  # fmt: skip
    return y, h_n, c_n


@rnn_forward.register_fake
def rnn_forward_fake(
    x, weights, hx, cx, lengths, seed, mode, num_layers, bidirectional, has_biases, proj_size,
    dropout, memory, state_clip, impl, need_saved,
):  # fmt: skip
    T, B, _ = x.shape
    num_dirs = 2 if bidirectional else 1
    H = weights[1].shape[0] // GATES[mode]
    Hr = hx.shape[-1]
    layout = _kernels(impl).saved_layout(mode, resolve_memory(memory, mode), T, B, H, x.dtype)
    saved = []
    if need_saved:
        for layer in range(num_layers):
            for _ in range(num_dirs):
                saved.extend(x.new_empty(shape, dtype=dtype) for shape, dtype in layout)
            if layer < num_layers - 1:
                saved.append(x.new_empty(T, B, num_dirs * Hr))
    c_n = x.new_empty(num_layers * num_dirs, B, H) if mode == "lstm" else x.new_empty(0)
    return x.new_empty(T, B, num_dirs * Hr), x.new_empty(hx.shape), c_n, saved


def _backward_impl(
    grad_y: Tensor | None,
    grad_hn: Tensor | None,
    grad_cn: Tensor | None,
    x: Tensor,
    weights: list[Tensor],
    hx: Tensor,
    cx: Tensor | None,
    lengths: Tensor | None,
    seed: Tensor,
    y: Tensor,
    saved: list[Tensor],
    mode: str,
    num_layers: int,
    bidirectional: bool,
    has_biases: bool,
    proj_size: int,
    dropout: float,
    memory: str,
    state_clip: list[float] | None,
    impl: str,
    needs_input_grad: list[bool],
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """Gradients of (x, hx, cx, weights); an empty tensor where needs_input_grad is False.

    needs_input_grad: [x, hx, cx, *weights].
    """
    memory = resolve_memory(memory, mode)
    kernels = _kernels(impl)
    num_dirs = 2 if bidirectional else 1
    n_w = _weights_per_layer(has_biases, proj_size)
    need_x, need_hx, need_cx = needs_input_grad[:3]
    need_w = needs_input_grad[3:]
    seed_value = _seed(kernels, seed, dropout)
    Hr = hx.shape[-1]
    if mode != "lstm":
        grad_cn = None
    per_layer = _saved_per_layer(impl, mode, memory)
    layer_saved, layer_outputs = _split_saved(saved, per_layer, num_layers, num_dirs, y)

    grad_hx = [None] * (num_layers * num_dirs)
    grad_cx = [None] * (num_layers * num_dirs)
    grad_w: list[Tensor | None] = [None] * len(weights)
    grad_out = grad_y
    for layer in reversed(range(num_layers)):
        # The input gradient of this layer is needed if anything below it needs a gradient.
        below = need_x or need_hx or need_cx or any(need_w[: layer * num_dirs * n_w])
        layer_in = x
        if layer > 0:
            layer_in = layer_outputs[layer - 1]
            layer_in = _dropout(kernels, layer_in, dropout, seed_value, layer)
        grad_in = None
        for direction in range(num_dirs):
            index = layer * num_dirs + direction
            w = _layer_weights(weights, index, has_biases, proj_size)
            xin, y_d, g_d = _direction_view(
                (layer_in, layer_outputs[layer], grad_out), direction, Hr, lengths
            )
            w_needs = _weight_needs(need_w[index * n_w : (index + 1) * n_w], has_biases, proj_size)
            call = LayerCall(mode, xin.contiguous(), hx[index].contiguous(), _row(cx, index), *w,
                             lengths=lengths, memory=memory, state_clip=_clip(state_clip))
            grads = kernels.layer_backward(
                call, layer_saved[index], y_d.contiguous(), _row(g_d, None),
                _row(grad_hn, index), _row(grad_cn, index),
                needs_input_grad=(below if layer > 0 else need_x, need_hx, need_cx, *w_needs),
            )  # fmt: skip
            gx, grad_hx[index], grad_cx[index] = grads[:3]
            present = [g for g, wt in zip(grads[3:], w) if wt is not None]
            grad_w[index * n_w : index * n_w + len(present)] = present
            if gx is not None:
                gx = gx if direction == 0 else reverse_within_lengths(gx, lengths)
                # Both are fresh tensors of this loop: sum in place, no third [T,B,I].
                grad_in = gx if grad_in is None else grad_in.add_(gx)
        grad_out = grad_in
        if layer > 0 and grad_out is not None:
            grad_out = _dropout(kernels, grad_out, dropout, seed_value, layer)
    return _backward_outputs(x, (grad_out, grad_hx, grad_cx, grad_w), needs_input_grad[:3])


rnn_backward = torch.library.custom_op("mirrorgrad::rnn_backward", mutates_args=())(_backward_impl)


def _backward_outputs(x: Tensor, grads: tuple, needs: Sequence[bool]) -> tuple:
    """rnn_backward's return from (grad_x, per-index grad_hx, grad_cx, grad_w): contiguous,
    as the fake kernel promises (Inductor asserts the strides it was told), and an empty
    tensor for each gradient not needed or not computed."""
    grad_x, grad_hx, grad_cx, grad_w = grads
    need_x, need_hx, need_cx = needs

    def stacked(per_index: list[Tensor | None]) -> Tensor:
        return x.new_empty(0) if any(g is None for g in per_index) else torch.stack(per_index)

    return (
        grad_x.contiguous() if need_x and grad_x is not None else x.new_empty(0),
        stacked(grad_hx) if need_hx else x.new_empty(0),
        stacked(grad_cx) if need_cx else x.new_empty(0),
        [x.new_empty(0) if g is None else g.contiguous() for g in grad_w],
    )


def _split_saved(saved: Sequence[Tensor], per_layer: int, num_layers: int, num_dirs: int,
                 y: Tensor) -> tuple[list[tuple[Tensor, ...]], list[Tensor]]:  # fmt: skip
    """The forward's saved list as (each layer-direction's saved tensors, each layer's
    output): per layer its directions' tensors, then its output (the last layer's is y)."""
    layer_saved, layer_outputs, pos = [], [], 0
    for layer in range(num_layers):
        for _ in range(num_dirs):
            layer_saved.append(tuple(s.contiguous() for s in saved[pos : pos + per_layer]))
            pos += per_layer
        if layer < num_layers - 1:
            layer_outputs.append(saved[pos])
            pos += 1
    layer_outputs.append(y)
    return layer_saved, layer_outputs


def _direction_view(
    tensors: tuple[Tensor, Tensor, Tensor | None], direction: int, Hr: int, lengths: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(layer input, layer output, output gradient) as one direction sees them: its Hr
    output columns, and time reversed within each length for the reverse direction."""
    layer_in, layer_out, grad_out = tensors

    def columns(t: Tensor | None) -> Tensor | None:
        # A one-direction layer's output is all its columns: no view (a full slice is
        # aten::alias, which the batched gradients' vmap has no rule for).
        return t if t is None or t.shape[-1] == Hr else t.narrow(-1, direction * Hr, Hr)

    views = (layer_in, columns(layer_out), columns(grad_out))
    if direction == 0:
        return views
    return tuple(None if t is None else reverse_within_lengths(t, lengths) for t in views)


def _weight_needs(wanted: Sequence[bool], has_biases: bool, proj_size: int) -> tuple:
    """needs_input_grad of (w_ih, w_hh, b_ih, b_hh, w_hr) from one layer-direction's slice
    of the flat weight list (False for the weights it does not have)."""
    biases = tuple(wanted[2:4]) if has_biases else (False, False)
    return (wanted[0], wanted[1], *biases, bool(proj_size) and wanted[-1])


def _row(t: Tensor | None, index: int | None) -> Tensor | None:
    """``t[index]`` (``t`` itself for index None) contiguous, or None where t is None."""
    if t is None:
        return None
    return (t if index is None else t[index]).contiguous()


@rnn_backward.register_fake
def _rnn_backward_fake(
    grad_y, grad_hn, grad_cn, x, weights, hx, cx, lengths, seed, y, saved, mode, num_layers,
    bidirectional, has_biases, proj_size, dropout, memory, state_clip, impl, needs_input_grad,
):  # fmt: skip
    # Contiguous gradients whatever the inputs' strides: empty_like would copy a permuted
    # x's strides, which the real kernel's fresh gradients do not have.
    need_x, need_hx, need_cx = needs_input_grad[:3]
    return (
        x.new_empty(x.shape) if need_x else x.new_empty(0),
        hx.new_empty(hx.shape) if need_hx else x.new_empty(0),
        cx.new_empty(cx.shape) if need_cx and cx is not None else x.new_empty(0),
        [
            w.new_empty(w.shape) if n else x.new_empty(0)
            for w, n in zip(weights, needs_input_grad[3:])
        ],
    )


_FORWARD_ARGS = (
    "x", "weights", "hx", "cx", "lengths", "seed", "mode", "num_layers", "bidirectional",
    "has_biases", "proj_size", "dropout", "memory", "state_clip", "impl",
)  # fmt: skip


def _save(ctx, inputs, output) -> None:
    """Keep what _stack_backward needs: inputs in _FORWARD_ARGS order, the op's output."""
    args = dict(zip(_FORWARD_ARGS, inputs))
    y, _, _, saved = output
    ctx.set_materialize_grads(False)
    ctx.config = {k: args[k] for k in _FORWARD_ARGS[6:]}
    ctx.n_weights = len(args["weights"])
    ctx.n_saved = len(saved)
    ctx.has_lengths = args["lengths"] is not None
    ctx.has_cx = args["cx"] is not None
    tensors = [args["x"], args["hx"], args["seed"], y, *args["weights"], *saved]
    if ctx.has_cx:
        tensors.append(args["cx"])
    if ctx.has_lengths:
        tensors.append(args["lengths"])
    ctx.save_for_backward(*tensors)


def _setup_context(ctx, inputs, output) -> None:
    ctx.mark_non_differentiable(*output[3])
    _save(ctx, inputs, output)


def _stack_backward(ctx, grad_y, grad_hn, grad_cn, needs: list[bool]) -> tuple:
    """(grad_x, grad_hx, grad_cx, [grad_w]) from what _setup_context saved, None where not
    needed; needs: [x, hx, cx, *weights]."""
    x, hx, seed, y, *rest = ctx.saved_tensors
    weights = rest[: ctx.n_weights]
    saved = rest[ctx.n_weights : ctx.n_weights + ctx.n_saved]
    extra = rest[ctx.n_weights + ctx.n_saved :]
    cx = extra.pop(0) if ctx.has_cx else None
    lengths = extra.pop(0) if ctx.has_lengths else None
    cfg = ctx.config
    grads = (grad_y, grad_hn, grad_cn)
    create_graph = torch.is_grad_enabled()  # backward(create_graph=True)
    if create_graph or _compat.is_batched(next((g for g in grads if g is not None), None)):
        # Higher-order or batched gradients (``is_grads_batched=True``, functorch): the
        # backward recomputed in plain PyTorch ops, which have both rules.
        inputs = (x, weights, hx, cx, lengths, seed)
        with torch.enable_grad():
            return _differentiable_backward(inputs, cfg, grads, needs, create_graph)
    grad_x, grad_hx, grad_cx, grad_w = _call(
        torch.ops.mirrorgrad.rnn_backward, _backward_impl,
        (grad_y, grad_hn, grad_cn, x, weights, hx, cx, lengths, seed, y, saved,
         cfg["mode"], cfg["num_layers"], cfg["bidirectional"], cfg["has_biases"],
         cfg["proj_size"], cfg["dropout"], cfg["memory"], cfg["state_clip"], cfg["impl"], needs),
        (grad_y, grad_hn, grad_cn, x, hx, cx, lengths, seed, y, *weights, *saved),
    )  # fmt: skip
    need_x, need_hx, need_cx, *need_w = needs
    return (
        grad_x if need_x else None,
        grad_hx if need_hx else None,
        grad_cx if need_cx else None,
        [g if n else None for g, n in zip(grad_w, need_w)],
    )


def _call(op: Callable, impl: Callable, args: tuple, tensors: Sequence[Tensor | None]):
    """``op(*args)``; in eager mode with plain tensors and no dispatch or function mode
    active (nothing that would see the op), ``impl(*args)`` directly: the dispatcher's
    trip through torch.library's wrappers costs ~50 us of host time per call, paid in
    full while the GPU waits for the host."""
    if _compat.dispatches_plainly(tensors):
        return impl(*args)
    return op(*args)


def _differentiable_backward(inputs: tuple, cfg: dict, grads: tuple, needs: list[bool],
                             create_graph: bool):  # fmt: skip
    """The backward recomputed through ``differentiable_stack`` with a graph of its own, for
    higher-order (``create_graph``) or batched gradients: same return as _stack_backward."""
    x, weights, hx, cx, lengths, seed = inputs
    wanted = [t for t, n in zip([x, hx, cx, *weights], needs) if n]
    outputs = differentiable_stack(
        x, list(weights), hx, cx, lengths, seed, cfg["mode"], cfg["num_layers"],
        cfg["bidirectional"], cfg["has_biases"], cfg["proj_size"], cfg["dropout"],
        cfg["state_clip"], cfg["impl"],
    )  # fmt: skip
    pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None]
    computed = iter(())
    if pairs and wanted:
        computed = iter(torch.autograd.grad(
            [o for o, _ in pairs], wanted, [g for _, g in pairs],
            create_graph=create_graph, allow_unused=True,
        ))  # fmt: skip
    result = [next(computed, None) if n else None for n in needs]
    return result[0], result[1], result[2], result[3:]


def _backward(ctx, grad_y, grad_hn, grad_cn, _grad_saved):
    need = ctx.needs_input_grad  # (x, [weights], hx, cx, ...)
    needs = [need[0], need[2], need[3], *need[1]]
    grad_x, grad_hx, grad_cx, grad_w = _stack_backward(ctx, grad_y, grad_hn, grad_cn, needs)
    return grad_x, grad_w, grad_hx, grad_cx, *([None] * (len(_FORWARD_ARGS) - 4 + 1))


rnn_forward.register_autograd(_backward, setup_context=_setup_context)


class EagerStack(torch.autograd.Function):
    """Autograd of the stack in eager mode: the same two ops and the same save/backward
    code as the op's own registration, without torch.library's autograd wrapper (pytree
    over the weight list, schema defaults, per-output checks: ~0.3 ms of host time per
    forward+backward at 4 layers, paid in full when the GPU waits for the host).
    ``torch.compile`` keeps calling the op, whose autograd it traces into the joint graph.
    """

    @staticmethod
    def forward(ctx, config: tuple, x, hx, cx, lengths, seed, *weights):
        inputs = (x, list(weights), hx, cx, lengths, seed, *config)
        output = _call(torch.ops.mirrorgrad.rnn_forward, _forward_impl, (*inputs, True),
                       (x, hx, cx, lengths, seed, *weights))  # fmt: skip
        _save(ctx, inputs, output)
        return output[:3]

    @staticmethod
    def backward(ctx, grad_y, grad_hn, grad_cn):
        need = ctx.needs_input_grad  # (config, x, hx, cx, lengths, seed, *weights)
        needs = [need[1], need[2], need[3], *need[6:]]
        grad_x, grad_hx, grad_cx, grad_w = _stack_backward(ctx, grad_y, grad_hn, grad_cn, needs)
        return None, grad_x, grad_hx, grad_cx, None, None, *grad_w


def _layer_flops(mode, T, B, n_in, H, Hr, proj) -> int:
    """One layer-direction forward: input and hidden GEMMs (+ projection)."""
    flops = 2 * T * B * GATES[mode] * H * (n_in + Hr)
    return flops + (2 * T * B * H * Hr if proj else 0)


def _stack_flops(x_shape, weight_shapes, hx_shape, mode, num_layers, bidirectional, has_biases,
                 proj_size) -> int:  # fmt: skip
    """Forward FLOPs of the stack; flop formulas receive shapes in place of tensors."""
    T, B, _ = x_shape
    n_w = _weights_per_layer(has_biases, proj_size)
    num_dirs = 2 if bidirectional else 1
    H = weight_shapes[1][0] // GATES[mode]
    total = 0
    for index in range(num_layers * num_dirs):
        n_in = weight_shapes[index * n_w][1]
        total += _layer_flops(mode, T, B, n_in, H, hx_shape[-1], proj_size > 0)
    return total


@register_flop_formula(torch.ops.mirrorgrad.rnn_forward)
def _rnn_forward_flops(x, weights, hx, cx, lengths, seed, mode, num_layers, bidirectional,
                       has_biases, proj_size, *args, out_val=None, **kwargs) -> int:  # fmt: skip
    return _stack_flops(x, weights, hx, mode, num_layers, bidirectional, has_biases, proj_size)


@register_flop_formula(torch.ops.mirrorgrad.rnn_backward)
def _rnn_backward_flops(grad_y, grad_hn, grad_cn, x, weights, hx, cx, lengths, seed, y, saved,
                        mode, num_layers, bidirectional, has_biases, proj_size, dropout, memory,
                        *args, out_val=None, **kwargs) -> int:  # fmt: skip
    """Data and weight gradients: twice the forward; recompute adds one forward's GEMMs."""
    forward = _stack_flops(x, weights, hx, mode, num_layers, bidirectional, has_biases, proj_size)
    recomputes = resolve_memory(memory, mode) == "recompute" and mode in ("lstm", "gru")
    return 2 * forward + (forward if recomputes else 0)


def _call_seconds(impl, mode, memory, x, weights, hx, num_layers, bidirectional, proj_size,
                  *, backward: bool) -> float | None:  # fmt: skip
    """One call's seconds by ops/rnn/time_model.py's fitted rule (per-step latency x steps plus
    the GEMMs), or None where it has no constants for ``impl`` (the roofline prices it)."""
    if proj_size:
        return None  # no implementation with constants runs a projection
    T, B, _, H, _, _ = map(_hint, _stack_shape(x, weights, hx, mode))
    shape = time_model.Shape(mode=mode, T=T, B=B, H=H, layers=num_layers,
                       directions=2 if bidirectional else 1)  # fmt: skip
    ms = time_model.phase_ms(impl, resolve_memory(memory, mode), x.dtype, shape, backward=backward)
    return None if ms is None else ms / 1e3


@register_time_formula(torch.ops.mirrorgrad.rnn_forward)
def _rnn_forward_seconds(x, weights, hx, cx, lengths, seed, mode, num_layers, bidirectional,
                         has_biases, proj_size, dropout, memory, state_clip, impl,
                         need_saved) -> float | None:  # fmt: skip
    return _call_seconds(impl, mode, memory, x, weights, hx, num_layers, bidirectional,
                         proj_size, backward=False)  # fmt: skip


@register_time_formula(torch.ops.mirrorgrad.rnn_backward)
def _rnn_backward_seconds(grad_y, grad_hn, grad_cn, x, weights, hx, cx, lengths, seed, y, saved,
                          mode, num_layers, bidirectional, has_biases, proj_size, dropout,
                          memory, state_clip, impl, needs_input_grad) -> float | None:  # fmt: skip
    return _call_seconds(impl, mode, memory, x, weights, hx, num_layers, bidirectional,
                         proj_size, backward=True)  # fmt: skip


def _stack_shape(x, weights, hx, mode):
    """(T, B, I, H, Hr, bytes per element) of a stack call."""
    T, B, n_in = x.shape
    return T, B, n_in, weights[1].shape[0] // GATES[mode], hx.shape[-1], x.dtype.itemsize


def layer_saved_bytes(impl, mode, memory, T, B, H, dtype) -> int:
    """Bytes of one layer-direction's own saved tensors."""
    layout = _kernels(impl).saved_layout(mode, memory, T, B, H, dtype)
    return sum(dt.itemsize * torch.Size(shape).numel() for shape, dt in layout)


@register_memory_formula(torch.ops.mirrorgrad.rnn_forward)
def _rnn_forward_temporary_bytes(x, weights, hx, cx, lengths, seed, mode, num_layers,
                                 bidirectional, has_biases, proj_size, dropout, memory,
                                 state_clip, impl, need_saved) -> int:  # fmt: skip
    """Peak of one layer at a time beyond the op's inputs and outputs: the layer's
    workspace beside its dropped-out input, the previous layer's output and the stash
    where nothing is saved, a bidirectional layer's reversed input and its directions'
    outputs before they are concatenated; plus each layer-direction's [B, H] states. An
    implementation that runs the whole stack at once says its own (``stack_forward``)."""
    kernels = _kernels(impl)
    if hasattr(kernels, "stack_temporary_bytes"):
        whole = kernels.stack_temporary_bytes(x, weights, hx, lengths, mode, num_layers,
                                              bidirectional, proj_size, dropout, state_clip,
                                              need_saved)  # fmt: skip
        if whole is not None:
            return whole
    T, B, n_in, H, Hr, d = _stack_shape(x, weights, hx, mode)
    D = 2 if bidirectional else 1
    memory = resolve_memory(memory, mode)
    unit = T * B * Hr * d  # one direction's output
    state = (3 if mode == "lstm" else 2) * B * H * d
    peak = 0
    for layer in range(num_layers):
        width = n_in if layer == 0 else D * Hr
        work = _workspace_bytes(impl, proj_size, mode, memory, x, T, B, H, width, backward=False)
        layer_in = T * B * width * d
        dropped = layer > 0 and dropout > 0
        held = layer_in if dropped else 0
        if not need_saved:
            held += D * layer_saved_bytes(impl, mode, memory, T, B, H, x.dtype)
            held += layer_in if layer > 0 else 0  # the previous output: not saved
            held += D * unit if layer < num_layers - 1 else 0  # this one, the same
        # the dropout's scratch is freed before the layer runs
        scratch = _dropout_scratch(impl, layer_in // d) if dropped else 0
        directions = layer_in + unit + max(work + unit, 2 * unit) if D == 2 else work
        peak = max(peak, held + max(directions, scratch) + (layer + 1) * D * state)
    return peak


@register_memory_formula(torch.ops.mirrorgrad.rnn_backward)
def _rnn_backward_temporary_bytes(grad_y, grad_hn, grad_cn, x, weights, hx, cx, lengths, seed,
                                  y, saved, mode, num_layers, bidirectional, has_biases,
                                  proj_size, dropout, memory, state_clip, impl,
                                  needs_input_grad) -> int:  # fmt: skip
    """Peak of one layer at a time, from the top: the gradient flowing in and the one
    flowing out (but the op's own grad_x), the recomputed dropout of the layer input,
    the layer's workspace, and a bidirectional layer's reversed input, output and output
    gradient and both directions' input gradients."""
    T, B, n_in, H, Hr, d = _stack_shape(x, weights, hx, mode)
    D = 2 if bidirectional else 1
    memory = resolve_memory(memory, mode)
    unit = T * B * Hr * d
    peak = 0
    for layer in reversed(range(num_layers)):
        width = n_in if layer == 0 else D * Hr
        work = _workspace_bytes(impl, proj_size, mode, memory, x, T, B, H, width, backward=True)
        layer_in = T * B * width * d
        held = D * unit if layer < num_layers - 1 else 0  # gradient from above
        dropped = layer > 0 and dropout > 0
        scratch = _dropout_scratch(impl, layer_in // d) if dropped else 0
        if dropped:  # recomputed dropout (its scratch freed before the layer runs)
            held += layer_in
            peak = max(peak, held + scratch)
        grad_in = layer_in if layer > 0 else 0  # the op's grad_x at layer 0
        if D == 2:
            held += 2 * unit + layer_in + grad_in + max(work + layer_in, 2 * layer_in)
        else:  # the layer, then the dropout of its input gradient
            held += max(work + grad_in, 2 * grad_in + scratch if dropped else 0)
        peak = max(peak, held)
    return peak


def _dropout_scratch(impl: str, elements: int) -> int:
    """Bytes the dropout between layers allocates beside its output (the reference
    path's hashes; the Triton kernel's none)."""
    return reference.dropout_scratch_bytes(elements) if impl == "reference" else 0


def _hint(size) -> int:
    """A size as an int (a symbolic one by its hint: the capture decides on the real one)."""
    return size if isinstance(size, int) else int(_compat.optimization_hint(size, fallback=1))


def _captures(impl: str, proj_size: int) -> ModuleType | None:
    """The layer module that ``impl`` runs where it may capture its layers in CUDA Graphs
    (kernels.py, persistent.py), else None."""
    if impl not in ("triton", "persistent") or proj_size or triton_module() is None:
        return None
    return _kernels(impl)


def _workspace_bytes(impl, proj_size, mode, memory, x, T, B, H, n_in, *, backward: bool) -> int:
    """One layer's per-call workspace, for an input of ``n_in`` features: none of what a
    captured loop keeps in arenas."""
    kernels = _kernels(impl)
    captured = _captures(impl, proj_size) is not None and kernels.loop_captured(
        mode, *map(_hint, (T, B, H)), x.device, backward=backward
    )
    extra = {"captured": True} if captured else {}
    if impl != "reference":  # the GPU layers' padded operands (padded_operands.py)
        extra |= {"n_in": n_in, "device": x.device}
    return kernels.workspace_bytes(mode, memory, T, B, H, x.dtype, backward=backward, **extra)


def _held_arenas(impl, mode, memory, x, weights, hx, lengths, has_biases, proj_size, num_layers,
                 bidirectional, *, backward: bool, has_grad_y: bool = True) -> dict:  # fmt: skip
    """The arenas of the op's captured loops (one config per call: every layer-direction
    has the same T, B, H), keyed so that ops of one graph share them as the cache does."""
    kernels = _captures(impl, proj_size)
    if kernels is None:
        return {}
    T, B, n_in, H, Hr, _ = map(_hint, _stack_shape(x, weights, hx, mode))
    flags = dict(has_lengths=lengths is not None, has_bias=has_biases, backward=backward,
                 has_grad_y=has_grad_y)  # fmt: skip
    args = (mode, resolve_memory(memory, mode), T, B, H, x.dtype, x.device)
    if impl != "persistent":
        return kernels.held_arenas(*args, **flags)
    # Its padded operands' arenas depend on the layers' input widths: as large as the
    # largest any layer asks for, as the cache keeps them.
    D = 2 if bidirectional else 1
    held: dict = {}
    for width in {n_in, D * Hr} if num_layers > 1 else {n_in}:
        for key, nbytes in kernels.held_arenas(*args, n_in=width, **flags).items():
            held[key] = max(held.get(key, 0), nbytes)
    return held


@register_held_formula(torch.ops.mirrorgrad.rnn_forward)
def _rnn_forward_held(x, weights, hx, cx, lengths, seed, mode, num_layers, bidirectional,
                      has_biases, proj_size, dropout, memory, state_clip, impl,
                      need_saved) -> dict:  # fmt: skip
    """What the forward's CUDA Graph cache keeps between calls (cuda_graphs.py's arenas)."""
    return _held_arenas(impl, mode, memory, x, weights, hx, lengths, has_biases, proj_size,
                        num_layers, bidirectional, backward=False)  # fmt: skip


@register_held_formula(torch.ops.mirrorgrad.rnn_backward)
def _rnn_backward_held(grad_y, grad_hn, grad_cn, x, weights, hx, cx, lengths, seed, y, saved,
                       mode, num_layers, bidirectional, has_biases, proj_size, dropout, memory,
                       state_clip, impl, needs_input_grad) -> dict:  # fmt: skip
    """What the backward's CUDA Graph cache keeps between calls (cuda_graphs.py's arenas)."""
    return _held_arenas(impl, mode, memory, x, weights, hx, lengths, has_biases, proj_size,
                        num_layers, bidirectional, backward=True,
                        has_grad_y=grad_y is not None)  # fmt: skip
