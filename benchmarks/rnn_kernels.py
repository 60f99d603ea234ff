"""The RNN op's Triton kernels without the module: what mirrorgrad.nn adds to them.

    python benchmarks/rnn_kernels.py --out DIR [--dtype bf16] [mirrorgrad bench's options]

The rnn-modules suite's workloads (forward + backward of an LSTM/GRU/RNN-tanh stack),
with the op's Triton path called directly, layer by layer (no module, no autograd
function of the op's): ``kernel-auto`` (its defaults, memory="stash"),
``kernel-recompute``, ``kernel-split`` / ``kernel-fused`` (hidden GEMM in cuBLAS or in
the step kernel, per-layer CUDA Graphs), ``kernel-split-nograph`` /
``kernel-fused-nograph`` (host launches), ``kernel-auto-graph`` (the whole step in one
CUDA Graph); beside them cuDNN (``eager``) and the module on the same kernels and memory
mode (``mgnn-triton-stash``). The table sets the module against ``kernel-auto``. What
``memory="recompute"`` saves in bytes, and the backward's memory as T grows, through the
module: benchmarks/rnn_memory_modes.py.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mirrorgrad.bench.command import run_script_suite
from mirrorgrad.bench.methods import Method
from mirrorgrad.bench.rnn_modules import WORKLOADS, use_module
from mirrorgrad.bench.suite_tables import x_ratio
from mirrorgrad.bench.suites import Suite
from mirrorgrad.ops.rnn.layer_call import LayerCall


def _layer_params(rnn: nn.RNNBase, layer: int, direction: int) -> list[Tensor]:
    sfx = f"_l{layer}" + ("_reverse" if direction else "")
    return [getattr(rnn, f"{n}{sfx}") for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]


class _KernelStack(torch.autograd.Function):
    """Layers x directions of the op's Triton contract, as the op composes them (no
    dropout): ``layer_forward`` up the stack, ``layer_backward`` down it."""

    @staticmethod
    def forward(ctx, rnn, mode, opts, x, h0, c0, *params):
        from mirrorgrad.ops.rnn import kernels  # Triton: imported when a kernel method runs

        D = 2 if rnn.bidirectional else 1
        inp, record = x, []
        for layer in range(rnn.num_layers):
            outs = []
            for d in range(D):
                k = layer * D + d
                xin = inp.flip(0) if d else inp
                c = c0[k] if c0 is not None else None
                call = LayerCall(mode, xin, h0[k], c, *_layer_params(rnn, layer, d),
                                 memory=opts.get("memory", "stash"))  # fmt: skip
                y, _, _, saved = kernels.layer_forward(call, **_launch_opts(opts))
                record.append((call, y, saved))
                outs.append(y.flip(0) if d else y)
            inp = torch.cat(outs, -1) if D == 2 else outs[0]
        ctx.rnn, ctx.mode, ctx.opts, ctx.record, ctx.h0 = rnn, mode, opts, record, h0
        return inp

    @staticmethod
    def backward(ctx, grad_y):
        from mirrorgrad.ops.rnn import kernels

        rnn, D, H = ctx.rnn, 2 if ctx.rnn.bidirectional else 1, ctx.rnn.hidden_size
        grads: dict[int, list[Tensor]] = {}
        g = grad_y
        for layer in reversed(range(rnn.num_layers)):
            g_in = None
            for d in range(D):
                k = layer * D + d
                call, y, saved = ctx.record[k]
                gy = g[..., d * H : (d + 1) * H]
                out = kernels.layer_backward(call, saved, y, gy.flip(0) if d else gy, None, None,
                                             **_launch_opts(ctx.opts))  # fmt: skip
                gx = out[0].flip(0) if d else out[0]
                g_in = gx if g_in is None else g_in + gx
                grads[k] = list(out[3:7])
            g = g_in
        ctx.record = None
        flat = [t for k in range(rnn.num_layers * D) for t in grads[k]]
        return None, None, None, g, None, None, *flat


def _launch_opts(opts: dict[str, Any]) -> dict[str, Any]:
    """The options of a ``kernel-*`` method that the layer functions take (``memory`` is
    the layer call's own)."""
    return {k: v for k, v in opts.items() if k != "memory"}


def _kernel_forward(rnn: nn.RNNBase, mode: str, opts: dict[str, Any], x: Tensor, hx: Any):
    h0, c0 = hx if mode == "lstm" else (hx, None)
    D = 2 if rnn.bidirectional else 1
    params = [p for k in range(rnn.num_layers) for d in range(D) for p in _layer_params(rnn, k, d)]
    return _KernelStack.apply(rnn, mode, opts, x, h0, c0, *params), None


def _use_kernels(opts: dict[str, Any]):
    def wrap(model: nn.Module, blocks: tuple[str, ...], backend: str):
        rnn = model.rnn
        # Instance attribute: the module and its parameters (and their names) stay.
        rnn.forward = functools.partial(_kernel_forward, rnn, model.mode, opts)
        return model

    return wrap


_KERNELS = {
    "kernel-auto": {},
    "kernel-recompute": {"memory": "recompute"},
    "kernel-split": {"use_graph": True, "fused": False},
    "kernel-fused": {"use_graph": True, "fused": True},
    "kernel-split-nograph": {"use_graph": False, "fused": False},
    "kernel-fused-nograph": {"use_graph": False, "fused": True},
    "kernel-auto-graph": {"use_graph": False},
}


def kernel_methods() -> list[Method]:
    """The kernels without the module, and the module on the same kernels."""
    module = Method(
        name="mgnn-triton-stash",
        description="mirrorgrad.nn RNNs with impl='triton', memory='stash'",
        wrap=use_module({"impl": "triton", "memory": "stash"}),
        compiles=False,
    )
    return [module] + [
        Method(
            name=name,
            description="the op's Triton kernels called directly"
            + (f" ({', '.join(f'{k}={v}' for k, v in opts.items())})" if opts else ""),
            wrap=_use_kernels(opts),
            compiles=False,
            cuda_graph=name == "kernel-auto-graph",
        )
        for name, opts in _KERNELS.items()
    ]


def kernel_table(doc: dict[str, Any]) -> str:
    """Per workload: cuDNN, the module and every kernel method (ms), and the module's
    time over kernel-auto's (the same kernels and memory mode)."""
    names = ["eager", "mgnn-triton-stash", *_KERNELS]
    head = ["workload", *(f"{n} ms" for n in names), "module / kernel-auto"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for name, w in doc["workloads"].items():
        ok = {m["method"]: m for m in w["methods"] if m["status"] == "ok"}
        ms = [ok[n]["median_ms"] if n in ok else None for n in names]
        module, kernels = ms[1], ms[2]
        cells = [name, *("—" if t is None else f"{t:.2f}" for t in ms)]
        cells.append(x_ratio(module / kernels if module and kernels else None))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


SUITE = Suite(
    name="rnn-kernels",
    description="the RNN op's Triton kernels without the module, beside cuDNN and the module",
    workloads=WORKLOADS,
    methods=("eager", "mgnn-triton-stash", *_KERNELS),
    table=kernel_table,
    table_only=True,
    script=Path(__file__).resolve(),
)

if __name__ == "__main__":
    sys.exit(run_script_suite(SUITE, kernel_methods()))
