"""``impl="cuda"``: an LSTM layer whose recurrence is the persistent CUDA C++ kernel
(cuda_lstm.cu through cuda_lstm_kernel.py): all T steps in one cooperative launch, W_hh
in registers, one grid barrier a step.

The per-layer contract of ``reference.py``'s docstring. Forward: the input GEMM over all
steps (cuBLAS), then ONE launch writing y, h_n, c_n and the stash. Backward: ONE launch
from the stash (the gate gradients of every step, dh0, dc0), then dx, dW_ih and dW_hh
as GEMMs over all steps and the bias gradients as one GEMV (step_loop.add_chunk_grads);
the input product and these GEMMs on operands padded to 16 bytes where that pays
(padded_operands.py). Dropout between layers and
bidirectional stacks are op.py's (it calls the layer per layer and direction); the
dropout masks are the Triton kernels' (kernels.py), whose seed stays on the GPU.

What it runs: mode "lstm", fp32 (the recurrent products in TF32, as cuDNN's default) or
bf16, no projection, no sequence lengths, no state clip, on CUDA, at hidden sizes and
batches the kernel's layout fits (``cuda_lstm_kernel.unfit``: up to 1024 in fp32 on an
H100's 132 SMs at batch up to 32; a larger batch runs in batch groups of at most 32 rows,
each on its share of the SMs, so W's slice a CTA grows with the groups: bf16 656 at batch
128 fits, fp32 656 does not). ``unsupported_reason`` says why not; ``impl="cuda"`` raises
it, ``impl="auto"`` leaves the candidate out.

PADDED HIDDEN SIZES: the kernel's layout takes H a multiple of 8, so a layer of another
H runs padded to Hp = ``padded_hidden(H)``: each gate block (i, f, g, o) of x W_ih^T +
b_ih, of W_hh (its columns too) and of b_hh gets Hp - H zero rows, h0 and c0 zero
columns. Exact: a padded unit's pre-activations are zero, so i = f = o = 0.5 and g = 0;
its c stays 0 from c0 = 0 and its h = 0.5 tanh(0) = 0; W_hh's padded columns are zero,
so real units never see it. In the backward its dh (through those zero columns) and dc
stay zero, and so its gate gradients. Outputs and gradients are sliced back to H. The
padded copies are made per call (nothing cached goes stale when the optimizer updates W
in place) and counted as workspace.

SAVED LAYOUT (both memory modes): the stash [T,B,5Hp] in the layer's dtype, the gates'
pre-activations i, f, g, o (both biases added) and c_t of every step, as the backward
kernel reads it (Hp = H where H is a multiple of 8; the backward activates the gates
again: in bf16 the activated gates would lose their derivatives where they saturate).
memory="recompute" runs as "stash" (the kernel has no recomputing backward): its saved
bytes are the stash's, and ``saved_layout`` says so to the op's memory formulas and the
planner.

STACKS AS ONE LAUNCH: op.py asks ``stack_forward`` first; a unidirectional stack of 2
layers or more whose layout fits (``wavefront_reason``) runs its forward as one
wavefront launch (cuda_lstm.cu's LSTM_LAYERS kernel: layer l runs step t at tick t + l),
with the same outputs and saved tensors as the layers would give (so the backward is
the layers' own), dropout's masks drawn before the launch. ``WAVEFRONT = False`` runs
every stack layer by layer.

A grid barrier that waits more than 1 s gives up (the launch could not run all its CTAs
at once): the call's outputs become NaN on the GPU (no sync) and the next call of that
kernel configuration raises RuntimeError.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mirrorgrad.ops.rnn import cuda_lstm_kernel, padded_operands
from mirrorgrad.ops.rnn.cuda_lstm_kernel import CudaLstmKernel
from mirrorgrad.ops.rnn.layer_call import LayerCall
from mirrorgrad.ops.rnn.step_loop import add_chunk_grads

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
# Whether a stack the wavefront fits runs as one launch (``stack_forward``); off, every
# stack runs layer by layer (benchmarks/cuda_impl_lm_shapes.py times both).
WAVEFRONT = True


def padded_hidden(hidden: int) -> int:
    """The hidden size the kernel runs a layer of ``hidden`` units at: the next multiple
    of 8 (the module's docstring, PADDED HIDDEN SIZES)."""
    return -(-hidden // 8) * 8


def saved_layout(
    mode: str, memory: str, T: int, B: int, H: int, dtype: torch.dtype
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The stash [T,B,5Hp] in the layer's dtype, in either memory mode (the module's
    docstring)."""
    return [((T, B, 5 * padded_hidden(H)), dtype)]


def workspace_bytes(
    mode: str, memory: str, T: int, B: int, H: int, dtype: torch.dtype, *, backward: bool,
    n_in: int | None = None, device: torch.device | str = "cpu",
) -> int:  # fmt: skip
    """Peak bytes a layer call allocates beyond its inputs, outputs and stash, for an
    input of ``n_in`` features (None: H) on ``device``. Beside the input GEMM's product
    (forward) or the gate gradients (backward, at the input and weight GEMMs) the GEMMs'
    padded operands (padded_operands.py) and the bias GEMV's vector of ones.

    H a multiple of 8: forward the input GEMM's [T,B,4H] and b_hh in float32; backward
    the gate gradients [T,B,4H] with dh0 and dc0, beside the zeros of absent output
    gradients (at the launch) or the GEMMs' operands.

    Padded (Hp > H), as ``layer_forward`` and ``layer_backward`` allocate: forward the
    larger of (the input GEMM's [T,B,4H] beside its padded copy) and (at the launch: the
    padded xw, W_hh [4Hp,Hp], b_hh in float32, h0, c0 and the padded y, h_n, c_n before
    they are sliced back); backward the larger of (at the launch: the padded W_hh, c0,
    output gradients, gate gradients and dh0, dc0) and (the padded gate gradients, dh0
    and dc0 beside their slices); the GEMMs come after the padded copies are freed."""
    size = dtype.itemsize
    Hp = padded_hidden(H)
    pads = padded_operands.operand_bytes(T, B, T, H if n_in is None else n_in, H, 4 * H, dtype,
                                         device, backward=backward)  # fmt: skip
    xw = T * B * 4 * H * size
    gradients = (T * B * 4 * H + 2 * B * H) * size
    gemms = gradients + pads + T * B * size
    if Hp == H:
        if not backward:
            return xw + max(pads, 4 * H * 4)
        return max(gradients + (T * B * H + 2 * B * H) * size, gemms)
    xw_padded = T * B * 4 * Hp * size
    w_hh_padded = 4 * Hp * Hp * size
    if not backward:
        launch = (xw_padded + w_hh_padded + 4 * Hp * 4 + 2 * B * Hp * size
                  + (T + 2) * B * Hp * size)  # fmt: skip
        return max(xw + max(pads, xw_padded), launch)
    gradients_padded = (T * B * 4 * Hp + 2 * B * Hp) * size
    launch = w_hh_padded + (B * Hp + (T * B + 2 * B) * Hp) * size + gradients_padded
    return max(launch, gradients_padded + gradients, gemms)


def supports(mode: str, *, proj: bool, dtype: torch.dtype, device: torch.device) -> bool:
    """LSTM without projection, fp32 or bf16, on CUDA (the shape: ``unsupported_reason``)."""
    return mode == "lstm" and not proj and dtype in _DTYPE_NAMES and device.type == "cuda"


def available() -> bool:
    """Whether the kernel can be built here: ``cuda.bindings`` imports."""
    return cuda_lstm_kernel.available()


def unsupported_reason(mode: str, *, proj: bool, dtype: torch.dtype, device: torch.device,
                       hidden: int, batch: int, varlen: bool = False,
                       clip: bool = False) -> str | None:  # fmt: skip
    """Why the kernel cannot run this layer, or None where it can."""
    if device.type != "cuda":
        return f"it needs CUDA tensors, got {device.type}"
    if mode != "lstm":
        return f"it runs mode='lstm' only, got {mode!r}"
    if proj:
        return "it has no projection (proj_size)"
    if varlen:
        return "it takes no sequence lengths (packed or padded batches)"
    if clip:
        return "it has no state_clip"
    if dtype not in _DTYPE_NAMES:
        return f"it runs float32 and bfloat16, got {dtype}"
    props = torch.cuda.get_device_properties(device)
    optin = getattr(props, "shared_memory_per_block_optin", cuda_lstm_kernel.SHARED_OPTIN_BYTES)
    padded = padded_hidden(hidden)
    reason = cuda_lstm_kernel.unfit(_DTYPE_NAMES[dtype], padded, batch,
                                    props.multi_processor_count, optin)  # fmt: skip
    if reason is not None and padded != hidden:
        return f"hidden {hidden} runs padded to {padded}, and {reason}"
    return reason


def supports_shape(mode: str, *, proj: bool, dtype: torch.dtype, device: torch.device,
                   hidden: int, batch: int) -> bool:  # fmt: skip
    """Whether impl="cuda" can run this layer here (``cuda.bindings`` included): what
    ``impl="auto"`` asks before timing it."""
    return available() and unsupported_reason(mode, proj=proj, dtype=dtype, device=device,
                                              hidden=hidden, batch=batch) is None  # fmt: skip


def dropout(x: Tensor, p: float, seed: Tensor, offset: int = 0) -> Tensor:
    """kernels.py's dropout (Philox from a seed tensor on the GPU: no host sync)."""
    from mirrorgrad.ops.rnn import kernels  # Triton: imported where it runs

    return kernels.dropout(x, p, seed, offset)


def _kernel(call: LayerCall) -> CudaLstmKernel:
    """The compiled kernel for the call's layer (once a process per dtype, hidden, batch
    and device); ValueError where it cannot run the call, ImportError without
    ``cuda.bindings``, RuntimeError where an earlier launch timed out."""
    x, hidden = call.x, call.w_hh.shape[1]
    reason = unsupported_reason(call.mode, proj=call.w_hr is not None, dtype=x.dtype,
                                device=x.device, hidden=hidden, batch=x.shape[1],
                                varlen=call.lengths is not None,
                                clip=call.state_clip is not None)  # fmt: skip
    others = {t.dtype for t in (call.h0, call.c0, call.w_ih, call.w_hh)} - {x.dtype}
    if reason is None and others:
        reason = f"it takes states and weights in the input's dtype {x.dtype}, got {others}"
    if reason is not None:
        raise ValueError(f"impl='cuda' cannot run this layer: {reason}. Use impl='auto': it "
                         f"runs the fastest implementation that can")  # fmt: skip
    kernel = cuda_lstm_kernel.compiled(_DTYPE_NAMES[x.dtype], padded_hidden(hidden), x.shape[1],
                                       x.device)  # fmt: skip
    kernel.raise_if_timed_out()
    return kernel


def _pad(t: Tensor, H: int, Hp: int, gates: int = 1) -> Tensor:
    """[..., gates*H] -> [..., gates*Hp] contiguous: each gate block gets Hp - H zero
    columns at its end (``t`` itself, made contiguous, where Hp = H)."""
    if Hp == H:
        return t.contiguous()
    out = t.new_zeros(*t.shape[:-1], gates, Hp)
    out[..., :H] = t.unflatten(-1, (gates, H))
    return out.flatten(-2)


def _pad_w_hh(w_hh: Tensor, H: int, Hp: int) -> Tensor:
    """W_hh [4H,H] -> [4Hp,Hp]: each gate block's rows and the columns padded with zeros
    (the zero columns keep the padded units' h out of the real units' products)."""
    if Hp == H:
        return w_hh.contiguous()
    out = w_hh.new_zeros(4, Hp, Hp)
    out[:, :H, :H] = w_hh.unflatten(0, (4, H))
    return out.flatten(0, 1)


def _unpad(t: Tensor, H: int, Hp: int, gates: int = 1) -> Tensor:
    """[..., gates*Hp] -> [..., gates*H] contiguous: the real units of each gate block."""
    if Hp == H:
        return t
    return t.unflatten(-1, (gates, Hp))[..., :H].flatten(-2).contiguous()


def _fresh(like: Tensor):
    """``make(name, shape)`` of padded_operands.py: a fresh buffer."""
    return lambda _name, shape: like.new_empty(shape)


def _input_product(x: Tensor, w_ih: Tensor, b_ih: Tensor | None) -> Tensor:
    """x @ W_ih^T + b_ih [T,B,4H] (the padded copies of x and W_ih freed on return)."""
    T, B, n_in = x.shape
    pads = padded_operands.forward_operands(T, B, n_in, w_ih.shape[0], x.dtype, x.device,
                                            _fresh(x))  # fmt: skip
    x2d, w_ih = padded_operands.input_operands(pads, x.view(T * B, n_in), w_ih)
    return F.linear(x2d, w_ih, b_ih).view(T, B, -1)


@torch.no_grad()
def layer_forward(call: LayerCall) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, ...]]:
    """One layer, one direction: ``(y [T,B,H], h_n, c_n, (stash [T,B,5Hp],))``."""
    kernel = _kernel(call)
    x = call.x.contiguous()
    w_ih, w_hh, b_ih, b_hh, _ = call.weights
    T, B, H, Hp = x.shape[0], x.shape[1], w_hh.shape[1], kernel.hidden
    # The product padded to the kernel's Hp, not W_ih: its size does not depend on the
    # input width. (Its operands padded to 16 bytes where that pays: padded_operands.py.)
    xw = _pad(_input_product(x, w_ih, b_ih), H, Hp, gates=4)
    if b_hh is None:
        b_hh = x.new_zeros(4 * Hp, dtype=torch.float32)
    else:
        b_hh = _pad(b_hh.float(), H, Hp, gates=4)
    # y, h_n and c_n in one block: one NaN fill covers them where a barrier gave up.
    out = torch.empty(T + 2, B, Hp, dtype=x.dtype, device=x.device)
    stash = x.new_empty(T, B, 5 * Hp)
    kernel.recurrence(xw, _pad_w_hh(w_hh, H, Hp), b_hh, _pad(call.h0, H, Hp),
                      _pad(call.c0, H, Hp), out[:T], out[T], out[T + 1], stash)  # fmt: skip
    kernel.poison(out)
    kernel.note_status()
    out = _unpad(out, H, Hp)
    return out[:T], out[T], out[T + 1], (stash,)


def _gate_gradients(kernel: CudaLstmKernel, call: LayerCall, stash: Tensor,
                    grad_y: Tensor | None, grad_hn: Tensor | None,
                    grad_cn: Tensor | None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The backward launch: (the gate gradients [T,B,4H] of every step, [dh0, dc0]
    [2,B,H]), run padded where the kernel's Hp is past H (its padded copies freed on
    return)."""
    x = call.x
    T, B, H, Hp = x.shape[0], x.shape[1], call.w_hh.shape[1], kernel.hidden

    def given(grad: Tensor | None, *shape: int) -> Tensor:
        return x.new_zeros(*shape, Hp) if grad is None else _pad(grad, H, Hp)

    dgates = torch.empty(T, B, 4 * Hp, dtype=x.dtype, device=x.device)
    state = torch.empty(2, B, Hp, dtype=x.dtype, device=x.device)
    kernel.backward_recurrence(_pad_w_hh(call.w_hh, H, Hp), stash.contiguous(),
                               _pad(call.c0, H, Hp), given(grad_y, T, B), given(grad_hn, B),
                               given(grad_cn, B), dgates, state[0], state[1])  # fmt: skip
    kernel.poison(dgates, state)
    kernel.note_status()
    return _unpad(dgates, H, Hp, gates=4), _unpad(state, H, Hp)


@torch.no_grad()
def layer_backward(
    call: LayerCall,
    saved: tuple[Tensor, ...],
    y: Tensor,
    grad_y: Tensor | None,
    grad_hn: Tensor | None,
    grad_cn: Tensor | None,
    *,
    needs_input_grad: tuple[bool, ...] = (True,) * 8,
) -> tuple[Tensor | None, ...]:
    """Gradients of x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr (None where not needed): the
    backward launch, then one GEMM for each input and weight gradient and one GEMV for
    the biases."""
    need_x, need_h0, need_c0, need_wih, need_whh, need_bih, need_bhh, _ = needs_input_grad
    need_bih, need_bhh = need_bih and call.b_ih is not None, need_bhh and call.b_hh is not None
    if not (need_x or need_h0 or need_c0 or need_wih or need_whh or need_bih or need_bhh):
        return (None,) * 8
    kernel = _kernel(call)
    (stash,) = saved
    # dh0 and dc0 apart from dgates: the op holds them until the stack's backward ends.
    dgates, state = _gate_gradients(kernel, call, stash, grad_y, grad_hn, grad_cn)
    dh0, dc0 = state.unbind(0)
    x, h0, w_ih = call.x.contiguous(), call.h0.contiguous(), call.w_ih
    T, B, H, n_in = x.shape[0], x.shape[1], call.w_hh.shape[1], x.shape[2]
    flat = dgates.view(T * B, 4 * H)
    grads = dict(grad_x=x.new_empty(T, B, n_in) if need_x else None,
                 grad_wih=x.new_empty(4 * H, n_in) if need_wih else None,
                 grad_whh=x.new_empty(4 * H, H) if need_whh else None,
                 grad_bih=x.new_empty(4 * H) if need_bih else None,
                 grad_bhh=x.new_empty(4 * H) if need_bhh else None)  # fmt: skip
    # Every step as one chunk of step_loop's: one GEMM each (two for dW_hh unpadded: h0,
    # then y), on padded operands where they pay (padded_operands.py); both bias gradients
    # are dG's column sums: one GEMV, copied.
    pads = padded_operands.backward_operands(T, B, T, n_in, H, 4 * H, x.dtype, x.device,
                                             (need_x, need_wih, need_whh), _fresh(x))  # fmt: skip
    padded_operands.start_backward(pads, w_ih)
    bias = grads["grad_bih"] if need_bih else grads["grad_bhh"]
    add_chunk_grads(flat, flat, x.view(T * B, n_in), w_ih, h0, y, 0, T, first=True, ones=None,
                    grad_x=grads["grad_x"], grad_wih=grads["grad_wih"],
                    grad_whh=grads["grad_whh"], grad_bih=bias, grad_bhh=None,
                    pads=pads)  # fmt: skip
    padded_operands.finish_backward(pads, grads["grad_wih"], grads["grad_whh"])
    del pads
    if need_bih and need_bhh:
        grads["grad_bhh"].copy_(bias)
    return (grads["grad_x"], dh0 if need_h0 else None, dc0 if need_c0 else None,
            grads["grad_wih"], grads["grad_whh"], grads["grad_bih"], grads["grad_bhh"],
            None)  # fmt: skip


def wavefront_reason(x: Tensor, weights, hx: Tensor, lengths: Tensor | None, mode: str,
                     num_layers: int, bidirectional: bool, proj_size: int,
                     state_clip) -> str | None:  # fmt: skip
    """Why ``stack_forward`` leaves this stack of the op (its arguments) to the layers,
    or None where the wavefront runs it: a unidirectional LSTM stack of 2 layers or more,
    no lengths, no state clip, weights and states in the input's dtype, and the
    wavefront's layout fits (``cuda_lstm_kernel.wavefront_unfit``)."""
    if bidirectional or num_layers < 2 or proj_size:
        return "it runs unidirectional stacks of 2 layers or more without projection"
    if mode != "lstm" or lengths is not None or state_clip is not None:
        return "it runs plain LSTMs (no sequence lengths, no state clip)"
    if x.device.type != "cuda" or x.dtype not in _DTYPE_NAMES or not available():
        return "it runs float32 and bfloat16 on CUDA, with cuda.bindings"
    if any(w.dtype != x.dtype for w in weights) or hx.dtype != x.dtype:
        return f"it takes weights and states in the input's dtype {x.dtype}"
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    batch = x.shape[1]
    if not isinstance(batch, int):  # a symbolic size (the planner's formulas): its hint
        from mirrorgrad import _compat

        batch = int(_compat.optimization_hint(batch, fallback=1))
    return cuda_lstm_kernel.wavefront_unfit(_DTYPE_NAMES[x.dtype], padded_hidden(hx.shape[-1]),
                                            batch, num_layers, sms)  # fmt: skip


def stack_temporary_bytes(x, weights, hx, lengths, mode, num_layers, bidirectional, proj_size,
                          dropout, state_clip, need_saved) -> int | None:  # fmt: skip
    """Peak bytes ``stack_forward`` allocates beyond the op's inputs and outputs, or None
    where the wavefront does not run the stack (op.py's formula then sums the layers).

    In order: the input GEMM's [T,B,4H] (beside its operands' padded copies, then
    beside its own padded to Hp); held from then on, the
    padded product, the biases [L,4Hp] in float32, the masks [L-1,T,B,Hp] (drawn beside
    a [T,B,H] of ones and one layer's mask) and their scratch ``dropped``; at the launch
    every layer's y, h_n and c_n where padded (else the intermediate y's where nothing is
    saved) and the padded W_ih, W_hh, h0 and c0; after it the unpadded y's where nothing
    is saved, beside the padded ones."""
    reason = wavefront_reason(x, weights, hx, lengths, mode, num_layers, bidirectional,
                              proj_size, state_clip)  # fmt: skip
    if not WAVEFRONT or reason is not None:
        return None
    L, (T, B, n_in), H = num_layers, x.shape, hx.shape[-1]
    Hp, size = padded_hidden(H), x.dtype.itemsize
    padded = Hp != H
    step = T * B * Hp * size  # one layer's y
    xw = 4 * T * B * Hp * size
    held = xw + L * 4 * Hp * 4
    product = 4 * T * B * H * size
    operands = padded_operands.operand_bytes(T, B, T, n_in, H, 4 * H, x.dtype, x.device,
                                             backward=False)  # fmt: skip
    peak = max(xw + (product if padded else 0), product + operands)
    if dropout > 0:
        masks = (L - 1) * step
        drawn = 2 * T * B * H * size if dropout < 1 else 0
        peak = max(peak, held + masks + drawn)
        held += 2 * masks  # and ``dropped``
    unpadded_ys = 0 if need_saved else (L - 1) * T * B * H * size
    if padded:
        held += L * step + 2 * L * B * Hp * size  # y, h_n and c_n padded
        copies = (2 * L - 1) * 4 * Hp * Hp * size + 2 * L * B * Hp * size
        return max(peak, held + copies, held + unpadded_ys)
    return max(peak, held + unpadded_ys)


def _dropout_masks(like: Tensor, layers: int, p: float, seed: Tensor, H: int,
                   Hp: int) -> Tensor | None:  # fmt: skip
    """The masks (0 or 1/(1-p)) on the inputs of layers 1.. [L-1,T,B,Hp] (zero past H), as
    op.py's dropout draws them for those layers (``dropout`` with the layer as offset, on
    ones), or None without dropout."""
    if p <= 0:
        return None
    shape = (layers - 1, *like.shape[:2], Hp)
    if p >= 1:
        return like.new_zeros(shape)
    masks = like.new_empty(shape) if Hp == H else like.new_zeros(shape)  # all drawn, or not
    ones = torch.ones((*like.shape[:2], H), dtype=like.dtype, device=like.device)
    for layer in range(1, layers):
        masks[layer - 1, ..., :H] = dropout(ones, p, seed, layer)
    return masks


@torch.no_grad()
def stack_forward(x, weights, hx, cx, lengths, seed, mode, num_layers, bidirectional,
                  has_biases, proj_size, dropout, memory, state_clip, need_saved):  # fmt: skip
    """The op's forward of a whole stack (its arguments, its return: y, h_n, c_n and
    saved, per layer the stash then, but after the last, the layer's output) as ONE
    wavefront launch; None where ``wavefront_reason`` leaves it to the layers (or
    ``WAVEFRONT`` is off).

    The dropout masks are drawn before the launch on ones (a layer's input is then its
    previous layer's y times the mask, as ``op.differentiable_stack`` computes it; the
    backward's ``dropout`` of y agrees with it but for rounding where 1/(1-p) is not
    exact in the dtype)."""
    reason = wavefront_reason(x, weights, hx, lengths, mode, num_layers, bidirectional,
                              proj_size, state_clip)  # fmt: skip
    if not WAVEFRONT or reason is not None or cx.dtype != x.dtype:
        return None  # the layers run it (or raise, as for a c0 in another dtype)
    L, (T, B, _), H = num_layers, x.shape, hx.shape[-1]
    Hp = padded_hidden(H)
    kernel = cuda_lstm_kernel.compiled_wavefront(_DTYPE_NAMES[x.dtype], Hp, B, L, x.device)
    kernel.raise_if_timed_out()
    n = 4 if has_biases else 2
    w = [weights[i * n : (i + 1) * n] for i in range(L)]  # each layer's
    xw = _pad(_input_product(x.contiguous(), w[0][0], w[0][2] if has_biases else None), H, Hp,
              gates=4)  # fmt: skip
    bias = x.new_zeros(L, 4, Hp, dtype=torch.float32)
    if has_biases:  # in place: no temporaries
        for layer in range(L):
            bias[layer, :, :H] += w[layer][3].reshape(4, H)
            if layer > 0:
                bias[layer, :, :H] += w[layer][2].reshape(4, H)
    mask = _dropout_masks(x, L, dropout, seed, H, Hp)
    dropped = None if mask is None else torch.empty_like(mask)
    ys = [x.new_empty(T, B, Hp) for _ in range(L)]
    h_n, c_n = x.new_empty(L, B, Hp), x.new_empty(L, B, Hp)
    stash = None
    if need_saved:
        stash = [x.new_empty(T, B, 5 * Hp) for _ in range(L)]
    kernel.wavefront(xw, [_pad_w_hh(w[layer][0], H, Hp) for layer in range(1, L)],
                     [_pad_w_hh(w[layer][1], H, Hp) for layer in range(L)], bias.view(L, 4 * Hp),
                     _pad(hx, H, Hp), _pad(cx, H, Hp), mask, dropped, ys, h_n, c_n,
                     stash)  # fmt: skip
    kernel.poison(*ys, h_n, c_n)
    kernel.note_status()
    ys = [_unpad(y, H, Hp) for y in ys]
    saved = []
    if need_saved:
        for layer in range(L):
            saved.append(stash[layer])
            if layer < L - 1:
                saved.append(ys[layer])
    return ys[-1], _unpad(h_n, H, Hp), _unpad(c_n, H, Hp), saved
