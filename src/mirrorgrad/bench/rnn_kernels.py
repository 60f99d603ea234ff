"""The RNN suite of `mirrorgrad bench`: recurrent layers alone, module and kernel level.

    mirrorgrad bench --suite rnn-kernels --dtype fp32|bf16 --out DIR

Workloads: LSTM, GRU and RNN-tanh stacks at the shapes of issues 3 and 16 (named
``rnn-<mode>-L<layers>-I<input>-H<hidden>-B<batch>-T<steps>[-bi]``); a step is forward
and backward of the stack with a random output gradient, no optimizer (``update=False``).
The methods, module level first (what users call):

* ``eager``            ``torch.nn.LSTM/GRU/RNN`` (cuDNN on the GPU);
* ``cuda-graph``       the same step captured whole in one CUDA Graph;
* ``eager+mgnn``       ``mirrorgrad.nn`` module (``mirrorgrad.nn.convert``), as users get it
                       (``impl="auto"``, ``memory="auto"``);
* ``mgnn-<impl>``      the module with ``impl`` fixed (``triton``, ``cudnn``, ``persistent``
                       where that implementation exists); ``mgnn-triton-stash`` with
                       ``memory="stash"`` (the kernels' ``kernel-auto`` through the module);
* ``cuda-graph+mgnn``  that module's step captured in one CUDA Graph;

and beside them the kernels without the module (the op's Triton path called directly):
``kernel-auto`` (its defaults, memory="stash"), ``kernel-recompute``, ``kernel-split`` /
``kernel-fused`` (hidden GEMM in cuBLAS or in the step kernel, per-layer CUDA Graphs),
``kernel-split-nograph`` / ``kernel-fused-nograph`` (host launches), ``kernel-auto-graph``
(the whole step in one CUDA Graph). Gradients of the first step are compared with
``eager``'s; TFLOP/s counts the gate GEMMs (3x the forward's: dX and dW in backward).

``python -m mirrorgrad.bench.rnn_kernels ARGS`` is ``mirrorgrad bench --suite rnn-kernels
ARGS``; with ``--subset`` it runs SUBSET's workloads and methods, 10 steps each (about
4 minutes of GPU time per dtype).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from mirrorgrad.bench.methods import Method
from mirrorgrad.bench.workloads import Workload
from mirrorgrad.ops.rnn.cells import GATES

TORCH_MODULES = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn_tanh": nn.RNN, "rnn_relu": nn.RNN}


@dataclass(kw_only=True, slots=True, frozen=True)
class Config:
    layers: int
    input: int
    hidden: int
    batch: int
    T: int
    bidirectional: bool = False

    @property
    def name(self) -> str:
        bi = "-bi" if self.bidirectional else ""
        return f"L{self.layers}-I{self.input}-H{self.hidden}-B{self.batch}-T{self.T}{bi}"


# Issue 3's table, then issue 16's small batches (persistent-kernel territory).
CONFIGS = (
    Config(layers=2, input=650, hidden=650, batch=20, T=35),
    Config(layers=2, input=1500, hidden=1500, batch=20, T=35),
    Config(layers=2, input=1024, hidden=1024, batch=64, T=50),
    Config(layers=4, input=1024, hidden=1024, batch=128, T=50),
    Config(layers=1, input=512, hidden=512, batch=16, T=100),
    Config(layers=2, input=512, hidden=512, batch=256, T=35),
    Config(layers=2, input=1024, hidden=1024, batch=64, T=50, bidirectional=True),
    Config(layers=1, input=1024, hidden=1024, batch=4, T=100),
    Config(layers=1, input=2048, hidden=2048, batch=4, T=100),
    Config(layers=2, input=1152, hidden=1152, batch=4, T=100),
    Config(layers=2, input=1024, hidden=1024, batch=1, T=100),
)
QUICK = Config(layers=2, input=8, hidden=8, batch=2, T=3, bidirectional=True)
SUITE_MODES = ("lstm", "gru", "rnn_tanh")


def step_flops(mode: str, cfg: Config) -> float:
    """Gate GEMM FLOPs of forward + backward: 3x the forward's 2*T*B*G*H*(I_l + H)."""
    D = 2 if cfg.bidirectional else 1
    per_dir = sum(
        2 * cfg.T * cfg.batch * GATES[mode] * cfg.hidden * (width + cfg.hidden)
        for width in [cfg.input] + [D * cfg.hidden] * (cfg.layers - 1)
    )
    return 3.0 * D * per_dir


class RnnStep(nn.Module):
    """``forward(x, h0[, c0], grad_y)``: the loss whose backward is the stack's with
    output gradient ``grad_y`` (the input gets a gradient too, as in a network)."""

    def __init__(self, mode: str, cfg: Config) -> None:
        super().__init__()
        kwargs = {"nonlinearity": mode[4:]} if mode.startswith("rnn") else {}
        self.rnn = TORCH_MODULES[mode](
            cfg.input, cfg.hidden, cfg.layers, bidirectional=cfg.bidirectional, **kwargs
        )
        self.mode = mode

    def forward(self, x: Tensor, h0: Tensor, *rest: Tensor) -> Tensor:
        *c0, grad_y = rest
        hx = (h0, c0[0]) if self.mode == "lstm" else h0
        y, _ = self.rnn(x.detach().requires_grad_(), hx)
        return (y * grad_y).sum()


def _workload(mode: str, cfg: Config) -> Workload:
    def builder(batch: int, quick: bool):
        c = QUICK if quick else cfg
        D = 2 if c.bidirectional else 1

        def sample(g: torch.Generator) -> tuple[Tensor, ...]:
            x = torch.randn(c.T, batch, c.input, generator=g)
            states = [torch.randn(c.layers * D, batch, c.hidden, generator=g)]
            if mode == "lstm":
                states.append(torch.randn(c.layers * D, batch, c.hidden, generator=g))
            return x, *states, torch.randn(c.T, batch, D * c.hidden, generator=g)

        return RnnStep(mode, c), sample, ("rnn",)

    return Workload(
        name=f"rnn-{mode}-{cfg.name}",
        description=f"{mode} stack {cfg.name}, forward + backward",
        batch=cfg.batch,
        quick_batch=QUICK.batch,
        recurrent=True,
        compile_weight=1,
        builder=builder,
        update=False,
        flops=lambda batch, quick: step_flops(mode, QUICK if quick else cfg),
        grad_reference="eager",
        cpu_slice=cfg == CONFIGS[0],
    )


WORKLOADS: dict[str, Workload] = {
    w.name: w for w in (_workload(mode, cfg) for mode in SUITE_MODES for cfg in CONFIGS)
}

def _module_impls() -> dict[str, dict[str, str]]:
    """The module methods with a fixed implementation: name -> mirrorgrad.nn options."""
    from mirrorgrad.ops.rnn import IMPLS

    impls = [i for i in ("triton", "persistent", "cudnn") if i in IMPLS]
    methods = {f"mgnn-{impl}": {"impl": impl} for impl in impls}
    methods["mgnn-triton-stash"] = {"impl": "triton", "memory": "stash"}
    return methods


MODULE_IMPLS = _module_impls()
METHODS = (
    "eager",
    "cuda-graph",
    "eager+mgnn",
    *MODULE_IMPLS,
    "cuda-graph+mgnn",
    "kernel-auto",
    "kernel-recompute",
    "kernel-split",
    "kernel-fused",
    "kernel-split-nograph",
    "kernel-fused-nograph",
    "kernel-auto-graph",
)


# ---- the kernels without the module ------------------------------------------------


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
                weights = _layer_params(rnn, layer, d)
                y, _, _, saved = kernels.layer_forward(
                    mode, xin, h0[k], c, *weights, None, **opts
                )
                record.append((xin, c, weights, y, saved))
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
                xin, c, weights, y, saved = ctx.record[k]
                gy = g[..., d * H : (d + 1) * H]
                out = kernels.layer_backward(
                    ctx.mode, saved, xin, ctx.h0[k], c, *weights, None, y,
                    gy.flip(0) if d else gy, None, None, **ctx.opts,
                )  # fmt: skip
                gx = out[0].flip(0) if d else out[0]
                g_in = gx if g_in is None else g_in + gx
                grads[k] = list(out[3:7])
            g = g_in
        ctx.record = None
        flat = [t for k in range(rnn.num_layers * D) for t in grads[k]]
        return None, None, None, g, None, None, *flat


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


def _use_module(options: dict[str, str]):
    def wrap(model: nn.Module, blocks: tuple[str, ...], backend: str):
        import mirrorgrad.nn

        return mirrorgrad.nn.convert(model, **options)

    return wrap


def kernel_methods() -> list[Method]:
    """The suite's own methods, registered with the others: the module with a fixed
    implementation, and the kernels without the module."""
    modules = [
        Method(
            name=name,
            description="mirrorgrad.nn RNNs with "
            + ", ".join(f"{k}={v!r}" for k, v in options.items()),
            wrap=_use_module(options),
            compiles=False,
        )
        for name, options in MODULE_IMPLS.items()
    ]
    return modules + [
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


# --subset: the shapes where the module's overhead and the dispatch matter most (LM
# shapes at batch 20, the largest stack, batch 4), module level first.
SUBSET = {
    "workloads": [
        "rnn-lstm-L2-I650-H650-B20-T35",
        "rnn-lstm-L4-I1024-H1024-B128-T50",
        "rnn-lstm-L1-I1024-H1024-B4-T100",
        "rnn-gru-L2-I650-H650-B20-T35",
    ],
    "methods": [
        "eager", "cuda-graph", "eager+mgnn", *MODULE_IMPLS, "kernel-auto",
    ],
}


def main(argv: list[str] | None = None) -> int:
    """``mirrorgrad bench --suite rnn-kernels`` with these arguments (``--subset``: SUBSET's
    workloads and methods, 10 steps; later arguments override)."""
    from mirrorgrad import cli

    args = list(sys.argv[1:] if argv is None else argv)
    if "--subset" in args:
        args.remove("--subset")
        args = ["--workloads", *SUBSET["workloads"], "--methods", *SUBSET["methods"],
                "--steps", "10", *args]  # fmt: skip
    return cli.main(["bench", "--suite", "rnn-kernels", *args])


if __name__ == "__main__":
    sys.exit(main())
