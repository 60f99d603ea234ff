"""Persistent RNN layer: one Triton launch runs all T steps of a layer and direction
(docs/rnn-op.md, "The persistent kernel").

The same per-layer contract as ``kernels.py`` (``reference.py``'s docstring), same
saved layout, dropout and workspace, so the op can run ``impl="persistent"`` where it
runs ``"triton"``. Forward: the input GEMM over all steps (cuBLAS), then ONE launch of
``persistent_fwd_kernel``, program p owning hidden units [p*BN, (p+1)*BN) of every gate,
a grid-wide barrier between steps. Backward: chunks of steps as kernels.py's, ONE
``persistent_bwd_kernel`` launch per chunk (program p owning columns of dh), then the
input and weight gradients as GEMMs over the stored gate gradients. The input GEMM and
these run on operands padded to 16 bytes where that pays (padded_operands.py), in
workspace like every buffer of the captured bodies.

W_hh's slice per program is resident (loaded once) where it fits
``PersistentTuning.resident_bytes`` and compiles without spills, else streamed from L2
each step. h_{t-1} and dG_{t+1} are read through L1, which is not coherent, so every
step writes them to addresses of their own, rows padded to 128-byte lines. The grid is
capped at one program per SM (the spin barrier needs them all resident), else the layer
runs kernels.py's (``persistent_plan.plan`` returns None); so do projections and an
empty batch. Under ``TRITON_INTERPRET=1`` one program owns every unit. On CUDA each
phase is one body captured in a CUDA Graph and replayed (the layer functions' section).

The layout and its knobs are persistent_plan.py's, the buffers persistent_buffers.py's,
the bytes they take persistent_memory.py's, the step stamps of benchmarks
persistent_probes.py's; this module launches the kernels and runs the layer.
"""

from __future__ import annotations

import functools

import torch
import triton
from torch import Tensor

from mirrorgrad.ops.aligned_mm import pad_into
from mirrorgrad.ops.rnn import cuda_graphs, kernels, persistent_probes, step_loop
from mirrorgrad.ops.rnn.cell_modes import GATES, MODE_ID
from mirrorgrad.ops.rnn.layer_call import LayerCall
from mirrorgrad.ops.rnn.padded_operands import finish_backward, input_operands, start_backward
from mirrorgrad.ops.rnn.persistent_buffers import (
    BwdBuffers,
    FwdBuffers,
    bwd_buffers,
    copy_in,
    counters,
    fwd_buffers,
    gates_bytes,
)
from mirrorgrad.ops.rnn.persistent_kernels import (
    STAMPS,
    persistent_bwd_kernel,
    persistent_fwd_kernel,
)
from mirrorgrad.ops.rnn.persistent_memory import held_arenas, loop_captured, workspace_bytes
from mirrorgrad.ops.rnn.persistent_plan import Plan, k_pieces, plan, supports_persistent
from mirrorgrad.ops.rnn.step_loop import (
    LoopConfig,
    add_chunk_grads,
    bwd_loop_buffers,
    check_layer,
    chunk_steps,
    clip_args,
    input_gemm,
    loop_config,
    with_steps,
)

# The layer interface the op and its dispatcher call (op.py, dispatch.py): the contract's
# parts that are kernels.py's own (same saved tensors, same dropout masks: the same Philox
# kernel from the same seed and offset), this layer's memory formulas, and whether it
# runs its own kernel for a shape.
saved_layout = kernels.saved_layout
supports = kernels.supports
dropout = kernels.dropout
__all__ = ["dropout", "held_arenas", "layer_backward", "layer_forward", "loop_captured",
           "saved_layout", "supports", "supports_persistent", "workspace_bytes"]  # fmt: skip


# ---- launches --------------------------------------------------------------------


# Resident layouts compiled on this GPU: "fits", "spills" (run streamed unless the plan
# allows spills) or "too big" (more shared memory or registers than an SM has: streamed).
_RESIDENT: dict[tuple, str] = {}


def _launch(kind: str, kernel, config: LoopConfig, layout: Plan, args: tuple,
            constants: dict, count: Tensor | None = None) -> None:  # fmt: skip
    """Launch ``kernel`` on ``layout``'s grid. A resident layout is compiled first (once
    per shape) and runs only if ptxas kept W without spilling and the SM has room;
    else the streamed layout runs. ``count``: the barriers' zeroed int32 counters (at
    least ``counters(layout)``; None: allocated here)."""
    key = (kind, config.mode, config.H, config.dtype, layout)
    if count is None:
        count = torch.zeros(counters(layout), dtype=torch.int32, device=config.device)
    probe = count  # read only when PROBE
    if _probing():
        shape = (layout.groups, layout.programs, config.T, STAMPS.value)
        probe = torch.zeros(shape, dtype=torch.int64, device=config.device)
        persistent_probes.PROBES[kind] = probe
    call = (*args, count, probe, *_runtime(config))
    if layout.resident and not step_loop.interpreting():
        if key not in _RESIDENT:
            _RESIDENT[key] = _resident_check(kernel, call, layout, constants, kind, config)
        if _RESIDENT[key] == "too big" or (_RESIDENT[key] == "spills" and not layout.allow_spills):
            layout = layout.streamed()
    tiles = _tile_constants(kind, config, layout)
    compiled = kernel[(layout.programs, layout.groups)](*call, **constants, **tiles)
    if compiled is not None and hasattr(compiled, "n_spills"):
        persistent_probes.COMPILED[(kind, config.mode, config.dtype, layout)] = {
            "n_regs": compiled.n_regs,
            "n_spills": compiled.n_spills,
            "shared": compiled.metadata.shared,
        }


def _resident_check(kernel, call, layout: Plan, constants, kind, config) -> str:
    """Compile (and load) the resident variant without launching it."""
    try:
        compiled = kernel.warmup(*call, grid=(layout.programs, layout.groups), **constants,
                                 **_tile_constants(kind, config, layout))  # fmt: skip
        compiled._init_handles()  # loads it: n_spills, and OutOfResources if too big
    except triton.runtime.errors.OutOfResources:
        return "too big"
    return "spills" if compiled.n_spills > layout.spill_words else "fits"


def _runtime(config: LoopConfig) -> tuple:
    lo, hi = clip_args(config)
    return (config.T, config.B, lo, hi)


def _precision(config: LoopConfig) -> str:
    """tl.dot's input precision (kernels.py's rule), "upcast" for 16-bit operands under
    the interpreter (its dot is wrong for them)."""
    interpreted_16_bit = step_loop.interpreting() and config.dtype.itemsize == 2
    return "upcast" if interpreted_16_bit else config.precision


def _tile_constants(kind: str, config: LoopConfig, layout: Plan) -> dict:
    """The launch's constexprs and compile options (a cached dict: do not change it)."""
    probe = persistent_probes.PROBE_LEVEL if _probing() else 0
    return _constants(kind, config, layout, probe, _precision(config))


def _probing() -> bool:
    """Whether launches stamp their steps (``persistent_probes.recording``; GPU only)."""
    return persistent_probes.PROBES is not None and not step_loop.interpreting()


@functools.lru_cache(maxsize=1024)
def _constants(kind: str, config: LoopConfig, layout: Plan, probe: int,
               precision: str) -> dict:  # fmt: skip
    fused = layout.fuse_gates and GATES[config.mode] >= 3
    return dict(
        H=config.H,
        MODE=MODE_ID[config.mode],
        G=GATES[config.mode],
        P=config.stash_width,
        HAS_LENGTHS=config.has_lengths,
        CLIP=config.clip is not None,
        PREC=precision,
        RESIDENT=layout.resident,
        BB=layout.bb,
        BN=layout.bn,
        BK=layout.bk if kind == "fwd" else layout.bwd_bk,
        SPIN_LOAD=layout.spin_load,
        PROBE=probe,
        SPLIT=layout.split if kind == "fwd" else layout.bwd_split,
        **({"FUSE_GATES": fused} if kind == "fwd" else {"GATHER": layout.gather}),
        **_resident_slices(kind, config, layout, fused),
        num_warps=layout.num_warps if kind == "fwd" else layout.bwd_warps,
        num_stages=layout.num_stages,
    )


def _resident_slices(kind: str, config: LoopConfig, layout: Plan, fused: bool) -> dict:
    """RS, and with it KA and KB a slice's two pieces: the resident hidden GEMM's K in RS
    slices (RS 1: K in the plan's two pieces, as before). Forward: K = H, all gates in one
    dot. Backward: K = G*H in parts of GP gates, one after another; each part's dG rows
    pass through shared memory beside W, so GP is the most gates whose part fits
    ``layout.part_bytes`` with W (fewer parts: fewer dependent L2 round trips per step)."""
    rs = layout.rsplit if kind == "fwd" else layout.bwd_rsplit
    if not layout.resident or rs == 1 or (kind == "fwd" and not fused):
        return {"RS": 1, "KA": layout.ka, "KB": layout.kb, **({} if kind == "fwd" else {"GP": 1})}
    if kind == "fwd":
        return {"RS": rs, **dict(zip(("KA", "KB"), k_pieces(triton.cdiv(config.H, rs))))}
    G, size = GATES[config.mode], config.dtype.itemsize
    for gp in (4, 2, 1):
        ka, kb = k_pieces(triton.cdiv(min(gp, G) * config.H, rs))
        part = rs * (ka + kb) * size  # bytes per row of a part (W: BN rows, dG: BB)
        if gp == 1 or part * (layout.bn * triton.cdiv(G, gp) + layout.bb) <= layout.part_bytes:
            return {"RS": rs, "KA": ka, "KB": kb, "GP": gp}



# ---- The layer functions -------------------------------------------------------------
# Each phase of a layer-direction is one body (``_fwd_body``, ``_bwd_body``) that reads
# its inputs in place, writes its outputs and workspace, and allocates nothing: on CUDA
# it is captured once in a CUDA Graph and replayed (cuda_graphs.py), so a call costs one
# replay instead of a dozen torch ops and a Triton launch on the host; elsewhere (CPU,
# inside another capture, benchmarks' probes) the same body runs plainly on fresh
# buffers, so captured and plain calls do the same arithmetic.


def _plan_of(config: LoopConfig, layout: Plan | None) -> Plan | None:
    return layout or plan(config.mode, config.B, config.H, config.dtype, config.device)


def _graphed(config: LoopConfig, steps: int, use_graph: bool | None) -> bool:
    """Whether a phase runs as a CUDA Graph: cuda_graphs.py's rule (sized as kernels.py's
    loop of ``steps`` steps), never while probes record the launches (they allocate)."""
    elements = steps * config.B * config.stash_width
    recording = persistent_probes.PROBES is not None
    return not recording and cuda_graphs.use_graph(config.device, elements, use_graph)


def _run(key: tuple, config: LoopConfig, buf, body) -> None:
    """``body(buf)`` as the captured entry of ``key`` for ``buf``'s addresses (captured
    now if there is none), or plainly where cuda_graphs.py skips this capture."""
    if config.device.type == "cuda":
        # This thread's cuBLAS handle, made now: its GEMMs all run on the capturing thread
        # here, and an outer capture (a user's torch.cuda.graph) in which they run plainly
        # cannot create one (CUBLAS_STATUS_NOT_INITIALIZED in the bench's capture).
        torch.cuda.current_blas_handle()
    entry = cuda_graphs.acquire(key, config.device, buf, body)
    if entry is not None:
        entry.replay(buf)
    else:
        body(buf)


def _input_bias(buf) -> Tensor | None:
    """The bias of the input GEMM (step_loop.input_bias), folded into ``buf.bias`` here."""
    if buf.bias is not None:
        torch.add(buf.b_ih, buf.b_hh, out=buf.bias)
        return buf.bias
    return buf.b_ih if buf.b_ih is not None else buf.b_hh


def _fwd_body(config: LoopConfig, layout: Plan, buf: FwdBuffers) -> None:
    """The input GEMM over all steps, the initial states, ONE persistent launch, the
    final states."""
    T, B, H = config.T, config.B, config.H
    gru = config.mode == "gru"
    bias = buf.b_ih if gru else _input_bias(buf)
    x2d, w_ih = input_operands(buf.pads, buf.x.view(T * B, -1), buf.w_ih)
    input_gemm(x2d, w_ih, bias, buf.pre.view(T * B, -1))
    buf.h[0, :, :H].copy_(buf.h0)
    if buf.cells is not None:
        buf.cells[0].copy_(buf.c0)
    buf.count.zero_()
    stash = buf.pre if config.mode == "lstm" and config.memory == "stash" else buf.stash
    dummy = buf.y
    has_hb = buf.b_hh is not None and gru
    args = (
        buf.pre, stash if stash is not None else dummy, buf.h, buf.w_hh,
        buf.b_hh if has_hb else dummy, buf.cells if buf.cells is not None else dummy, buf.y,
        buf.lengths if buf.lengths is not None else dummy,
    )  # fmt: skip
    constants = dict(WRITE_STASH=stash is not None, HAS_HB=has_hb, HS=buf.h.shape[-1])
    _launch("fwd", persistent_fwd_kernel, config, layout, args, constants, buf.count)
    buf.h_n.copy_(buf.h[T, :, :H])
    if buf.c_n is not None:
        buf.c_n.copy_(buf.cells[T])


@torch.no_grad()
def layer_forward(
    call: LayerCall, *, layout: Plan | None = None, use_graph: bool | None = None
) -> tuple[Tensor, Tensor, Tensor | None, tuple[Tensor, ...]]:
    """One layer, one direction: ``(y [T,B,H], h_n, c_n, saved)`` (kernels.py's
    contract); ``layout`` overrides ``plan``'s (tests, benchmarks); ``use_graph``:
    capture the layer in a CUDA Graph (None: by size, cuda_graphs.py)."""
    check_layer(call)
    config = loop_config(call, fused=False)
    layout = _plan_of(config, layout)
    if layout is None:
        return kernels.layer_forward(call, use_graph=use_graph)
    x, h0, c0, lengths = call.x, call.h0, call.c0, call.lengths
    w_ih, w_hh, b_ih, b_hh, _ = call.weights
    lengths = lengths.to(device=x.device, dtype=torch.int64) if lengths is not None else None
    inputs = dict(x=x.contiguous(), h0=h0.contiguous(),
                  c0=c0.contiguous() if c0 is not None else None, w_ih=w_ih, w_hh=w_hh,
                  b_ih=b_ih, b_hh=b_hh,
                  lengths=lengths.contiguous() if lengths is not None else None)  # fmt: skip
    body = functools.partial(_fwd_body, config, layout)
    if _graphed(config, config.T, use_graph):
        # The "gates" arena large enough for the backward before views of it are taken.
        cuda_graphs.reserve(config.device, "pre", gates_bytes(config))
        inputs = copy_in(config, layout, inputs, cuda_graphs.workspace)
        buf = fwd_buffers(config, layout, inputs, cuda_graphs.workspace)
        _run(((config, layout), "persistent.fwd", *_addresses(w_ih, w_hh, b_ih, b_hh)),
             config, buf, body)  # fmt: skip
    else:
        buf = fwd_buffers(config, layout, inputs)
        body(buf)
    return buf.y, buf.h_n, buf.c_n, kernels.saved_tensors(config, buf)


def _addresses(*tensors: Tensor | None) -> tuple[int, ...]:
    return tuple(0 if t is None else t.data_ptr() for t in tensors)


def _bwd_body(config: LoopConfig, layout: Plan, buf: BwdBuffers) -> None:
    """Chunks of steps from the end, each: (recomputed pre-activations,) ONE persistent
    launch, the chunk's GEMMs of the input and weight gradients; the state gradients
    carried between chunks in ``buf.dh``, ``buf.dc``."""
    T, B = config.T, config.B
    buf.state.zero_()
    if buf.grad_hn is not None:
        buf.dh.copy_(buf.grad_hn)
    if buf.grad_cn is not None:
        buf.dc.copy_(buf.grad_cn)
    if buf.ones is not None:
        buf.ones.fill_(1)
    bias = _input_bias(buf) if buf.pre is not None and config.mode != "gru" else None
    pads = buf.pads
    start_backward(pads, buf.w_ih)
    steps = chunk_steps(T, B)
    for launch, t1 in enumerate(range(T, 0, -steps)):
        t0 = max(0, t1 - steps)
        chunk = with_steps(config, t1 - t0)
        loop = _chunk_buffers(chunk, buf, t0, t1, launch)
        if buf.pre is not None:
            _recompute(chunk, buf, t0, t1, bias, out=loop.pre)
        _bwd_launch(chunk, layout, loop, buf.count[launch])
        dg = loop.dg.view(-1, chunk.gh)
        dgh = loop.dgh.view(-1, chunk.gh) if loop.dgh is not None else dg
        x2d = buf.x.view(T * B, buf.x.shape[-1])
        add_chunk_grads(dg, dgh, x2d, buf.w_ih, buf.h0, buf.y, t0, t1,
                        first=launch == 0, ones=buf.ones, grad_x=buf.grad_x,
                        grad_wih=buf.grad_wih, grad_whh=buf.grad_whh, grad_bih=buf.grad_bih,
                        grad_bhh=buf.grad_bhh, pads=pads,
                        x_padded=buf.pre is not None)  # fmt: skip
    finish_backward(pads, buf.grad_wih, buf.grad_whh)
    if buf.grad_c0 is not None:
        buf.grad_c0.copy_(buf.dc)


def _chunk_buffers(chunk: LoopConfig, buf: BwdBuffers, t0: int, t1: int, launch: int):
    """kernels.py's loop buffers of the chunk of steps [t0, t1): views of ``buf``."""
    n, gh, mode = t1 - t0, chunk.gh, chunk.mode
    lengths = buf.lengths
    if lengths is not None and t0 > 0:
        lengths = torch.sub(lengths, t0, out=buf.chunk_lengths[launch])
    pre = buf.pre[:n] if buf.pre is not None else None
    if buf.stash is not None:
        pre = buf.stash[t0:t1]
    grads = {"dg": buf.dg[:n, :, :gh], "dgh": buf.dgh[:n, :, :gh] if buf.dgh is not None else None}
    return bwd_loop_buffers(
        chunk, pre=pre, cells=buf.cells[t0 : t1 + 1] if buf.cells is not None else None,
        h0=(buf.h0 if t0 == 0 else buf.y[t0 - 1]) if mode == "gru" else None,
        y=buf.y[t0:t1] if mode != "lstm" else None,
        dy=buf.dy[t0:t1] if buf.dy is not None else None, w_hh=buf.w_hh, lengths=lengths,
        dh=buf.dh, dc=buf.dc, workspace=lambda _config, name, _make: grads[name[len("bwd."):]],
    )  # fmt: skip


def _recompute(chunk: LoopConfig, buf: BwdBuffers, t0: int, t1: int,
               bias: Tensor | None, *, out: Tensor) -> None:  # fmt: skip
    """The chunk's pre-activations from x and h_{t-1} (h0, then y) written into ``out``
    [n, B, P] in place (kernels.py's ``_recompute_pre``, with no temporary)."""
    B, H, n = chunk.B, chunk.H, (t1 - t0) * chunk.B
    x2d = buf.x.view(-1, buf.x.shape[-1])[t0 * B : t1 * B]
    w_ih = buf.w_ih
    if buf.pad_x is not None:  # padded_operands.py: the chunk's gradient GEMMs read it too
        x2d, w_ih = pad_into(buf.pad_x[:n], x2d), buf.pad_w_ih
    pre = out.view(n, out.shape[-1])
    # h_{t-1} of the chunk's first step, then of the others
    prev = ((slice(0, B), buf.h0 if t0 == 0 else buf.y[t0 - 1]),
            (slice(B, n), buf.y[t0 : t1 - 1].reshape(-1, H)))  # fmt: skip
    prev = [(rows, h) for rows, h in prev if h.numel()]
    if chunk.mode != "gru":
        input_gemm(x2d, w_ih, bias, pre)
        for rows, h in prev:
            pre[rows].addmm_(h, buf.w_hh.t())
        return
    # gru: [r, z: input + hidden side | n: input side | n: hidden side]
    input_gemm(x2d, w_ih, buf.b_ih, pre[:, : 3 * H])
    b_hn = buf.b_hh[2 * H :] if buf.b_hh is not None else None
    for rows, h in prev:
        pre[rows, : 2 * H].addmm_(h, buf.w_hh[: 2 * H].t())
        input_gemm(h, buf.w_hh[2 * H :], b_hn, pre[rows, 3 * H :])
    if buf.b_hh is not None:
        pre[:, : 2 * H].add_(buf.b_hh[: 2 * H])


def _bwd_launch(config: LoopConfig, layout: Plan, buf, count: Tensor) -> None:
    """One chunk's reverse loop, then the last step's ``dh += dG_0 @ W_hh``; ``count``:
    its zeroed barrier counters."""
    dummy = buf.dh
    args = (
        buf.pre if buf.pre is not None else dummy,
        buf.cells if buf.cells is not None else dummy,
        buf.h0 if buf.h0 is not None else dummy,
        buf.y if buf.y is not None else dummy,
        buf.dy if buf.dy is not None else dummy,
        buf.dh,
        buf.dc if buf.dc is not None else dummy,
        buf.dg,
        buf.dgh if buf.dgh is not None else dummy,
        buf.w_hh,
        buf.lengths if buf.lengths is not None else dummy,
    )
    constants = dict(HAS_DY=buf.dy is not None, DS=buf.dg.stride(1))
    _launch("bwd", persistent_bwd_kernel, config, layout, args, constants, count)
    buf.dh.addmm_((buf.dgh if buf.dgh is not None else buf.dg)[0], buf.w_hh)


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
    layout: Plan | None = None,
    use_graph: bool | None = None,
) -> tuple[Tensor | None, ...]:
    """Gradients of x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr (kernels.py's contract and
    chunks of steps: one persistent launch per chunk, the weight gradients as GEMMs over
    its stored gate gradients); ``use_graph`` as ``layer_forward``'s."""
    check_layer(call)
    config = loop_config(call, fused=False)
    layout = _plan_of(config, layout)
    if layout is None:
        return kernels.layer_backward(call, saved, y, grad_y, grad_hn, grad_cn,
                                      needs_input_grad=needs_input_grad, use_graph=use_graph)
    mode, x, h0, c0, memory = call.mode, call.x, call.h0, call.c0, call.memory
    lengths = call.lengths
    w_ih, w_hh, b_ih, b_hh, _ = call.weights
    need_x, need_h0, need_c0, need_wih, need_whh, need_bih, need_bhh, _ = needs_input_grad
    needs = (need_x, need_c0 and c0 is not None, need_wih, need_whh,
             need_bih and b_ih is not None, need_bhh and b_hh is not None)  # fmt: skip
    if not (need_h0 or any(needs)):
        return (None,) * 8
    lengths = lengths.to(device=x.device, dtype=torch.int64) if lengths is not None else None
    stashed = memory == "stash" and not mode.startswith("rnn")

    def own(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.contiguous()

    inputs = dict(stash=own(saved[0]) if stashed else None,
                  cells=own(saved[-1]) if mode == "lstm" else None, x=x.contiguous(),
                  h0=h0.contiguous(), w_ih=w_ih, w_hh=w_hh, b_ih=b_ih, b_hh=b_hh,
                  y=y.contiguous(), dy=own(grad_y), grad_hn=own(grad_hn),
                  grad_cn=own(grad_cn) if mode == "lstm" else None,
                  lengths=own(lengths))  # fmt: skip
    body = functools.partial(_bwd_body, config, layout)
    if _graphed(config, chunk_steps(config.T, config.B), use_graph):
        cuda_graphs.reserve(config.device, "pre", gates_bytes(config))
        inputs = copy_in(config, layout, inputs, cuda_graphs.workspace)
        buf = bwd_buffers(config, layout, inputs, needs, cuda_graphs.workspace)
        key = ((config, layout), "persistent.bwd", *_addresses(w_ih, w_hh, b_ih, b_hh))
        _run(key, config, buf, body)
    else:
        buf = bwd_buffers(config, layout, inputs, needs)
        body(buf)
    # grad_h0, grad_c0 and the bias gradients are views of the state block (one address
    # for a captured entry to find again): the small ones leave it as copies of their own,
    # since a custom op's outputs may share no storage (the stack stacks dh and grad_c0).
    return (buf.grad_x, buf.dh if need_h0 else None, buf.grad_c0, buf.grad_wih, buf.grad_whh,
            _own(buf.grad_bih), _own(buf.grad_bhh), None)  # fmt: skip


def _own(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.clone()

