"""The RNN module suite of `mirrorgrad bench`: recurrent layers alone, as users call them.

    mirrorgrad bench --suite rnn-modules --dtype fp32|bf16 --out DIR

Workloads: LSTM, GRU and RNN-tanh stacks at seven shapes (named
``rnn-<mode>-L<layers>-I<input>-H<hidden>-B<batch>-T<steps>[-bi]``); a step is forward
and backward of the stack with a random output gradient, no optimizer (``update=False``).
Methods, each a plain step and the same step captured whole in one CUDA Graph:

* ``eager`` / ``cuda-graph``: ``torch.nn.LSTM/GRU/RNN`` (cuDNN on the GPU);
* ``eager+mgnn`` / ``cuda-graph+mgnn``: the ``mirrorgrad.nn`` module as users get it
  (``mirrorgrad.nn.convert``: ``impl="auto"``, ``memory="auto"``);
* ``mgnn-<impl>`` / ``cuda-graph+mgnn-<impl>``: the module with ``impl`` fixed
  (``triton``, ``persistent``, ``cudnn``); by default only the graphed ones run.

Gradients of the first step are compared with ``eager``'s; TFLOP/s counts the gate GEMMs
(3x the forward's: dX and dW in backward). The suite's table (`suite_tables.module_table`)
sets each method against graphed cuDNN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mirrorgrad.bench.methods import Method
from mirrorgrad.bench.workloads import Workload
from mirrorgrad.ops.rnn.cell_modes import GATES

TORCH_MODULES = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn_tanh": nn.RNN, "rnn_relu": nn.RNN}


@dataclass(kw_only=True, slots=True, frozen=True)
class Config:
    layers: int
    input: int
    hidden: int
    batch: int
    T: int = 35
    bidirectional: bool = False

    @property
    def name(self) -> str:
        bi = "-bi" if self.bidirectional else ""
        return f"L{self.layers}-I{self.input}-H{self.hidden}-B{self.batch}-T{self.T}{bi}"


# Language-model stacks (2x650 and 2x1500 at batch 20), larger and deeper stacks, a
# single small layer over 100 steps, a large batch, and a bidirectional stack.
CONFIGS = (
    Config(layers=2, input=650, hidden=650, batch=20),
    Config(layers=2, input=1500, hidden=1500, batch=20),
    Config(layers=2, input=1024, hidden=1024, batch=64),
    Config(layers=4, input=1024, hidden=1024, batch=128),
    Config(layers=1, input=512, hidden=512, batch=16, T=100),
    Config(layers=2, input=512, hidden=512, batch=256),
    Config(layers=2, input=1024, hidden=1024, batch=64, bidirectional=True),
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


def workload(mode: str, cfg: Config, *, cpu_slice: bool = False) -> Workload:
    """Forward and backward of a ``mode`` stack of shape ``cfg``."""

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
        cpu_slice=cpu_slice,
    )


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        workload(mode, cfg, cpu_slice=cfg == CONFIGS[0]) for mode in SUITE_MODES for cfg in CONFIGS
    )
}

# mirrorgrad.nn's explicit implementations (not "reference": float64-exact, not fast).
IMPLS = ("triton", "persistent", "cudnn")


def use_module(options: dict[str, str]):
    """A method's wrap: the model's torch.nn RNNs swapped for mirrorgrad.nn's with ``options``."""

    def wrap(model: nn.Module, blocks: tuple[str, ...], backend: str):
        import mirrorgrad.nn

        return mirrorgrad.nn.convert(model, **options)

    return wrap


def module_methods() -> list[Method]:
    """``mgnn-<impl>`` and ``cuda-graph+mgnn-<impl>``: the module with ``impl`` fixed."""
    methods = []
    for impl in IMPLS:
        for graphed in (False, True):
            methods.append(
                Method(
                    name=("cuda-graph+" if graphed else "") + f"mgnn-{impl}",
                    description=f"mirrorgrad.nn RNNs with impl={impl!r}"
                    + (", the whole step in one CUDA Graph" if graphed else ""),
                    wrap=use_module({"impl": impl}),
                    compiles=True,  # Triton kernels at the first call
                    cuda_graph=graphed,
                )
            )
    return methods


# The table's methods: cuDNN plain and graphed, the module as users get it plain and
# graphed, and the module graphed with each implementation fixed.
METHODS = (
    "eager",
    "cuda-graph",
    "eager+mgnn",
    "cuda-graph+mgnn",
    *(f"cuda-graph+mgnn-{impl}" for impl in IMPLS),
)
