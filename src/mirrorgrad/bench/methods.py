"""Registry of training methods: what wraps a workload's model before the step loop.

Every method turns a model into a callable ``step_fn(*batch) -> loss``. Methods that
compile do so on the first call; the runner times that call separately.
``X+mgnn`` is method X after ``mirrorgrad.nn.convert`` swapped the model's
``torch.nn`` RNN modules for ``mirrorgrad.nn`` ones (recurrent workloads only).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

Backend = Literal["inductor", "eager"]
StepFn = Callable[..., Tensor]
# (model, batch, backend) -> step(): a method that brings its own training step
StepMaker = Callable[[nn.Module, tuple[Tensor, ...], Backend], Callable[[], Tensor]]
# (model, checkpoint block names, backend) -> step function
Wrap = Callable[[nn.Module, tuple[str, ...], Backend], StepFn]

# `--backend eager` runs the same partitioners without code generation (CPU tests):
# this torch backend decomposes and partitions with min-cut like Inductor does.
_TORCH_BACKEND = {"inductor": "inductor", "eager": "aot_eager_decomp_partition"}


@dataclass(kw_only=True, slots=True, frozen=True)
class Method:
    name: str
    description: str
    wrap: Wrap
    compiles: bool
    # mirrorgrad.compile options; the runner asks the planner for its estimated peak.
    mirror_options: dict[str, Any] | None = None
    swap_rnn: bool = False
    # The whole step (forward, backward, update) captured in one CUDA Graph and replayed.
    cuda_graph: bool = False
    # Replaces the workload's model before anything else (word-lm: the train package's).
    rebuild: Callable[[nn.Module], nn.Module] | None = None
    # A step of the method's own instead of zero_grad -> loss -> backward -> SGD.
    make_step: StepMaker | None = None

    def prepare(self, model: nn.Module, *, blocks: tuple[str, ...], backend: Backend) -> StepFn:
        """Return ``step_fn(*batch) -> loss``; may modify ``model`` in place (RNN swap)."""
        if backend not in _TORCH_BACKEND:
            raise ValueError(f"backend must be one of {sorted(_TORCH_BACKEND)}, got {backend!r}")
        if self.swap_rnn:
            import mirrorgrad.nn

            mirrorgrad.nn.convert(model)
        return self.wrap(model, blocks, backend)


def _eager(model: nn.Module, blocks: tuple[str, ...], backend: Backend) -> StepFn:
    return model


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _checkpoint(model: nn.Module, blocks: tuple[str, ...], backend: Backend) -> StepFn:
    if not blocks:
        raise ValueError("this workload declares no blocks to checkpoint")
    for name in blocks:
        module = model.get_submodule(name)
        # Instance attribute shadows the class's forward; nn.Module.__call__ uses it.
        module.forward = functools.partial(_checkpointed, module.forward)
    return model


def _torch_compile(model: nn.Module, blocks: tuple[str, ...], backend: Backend) -> StepFn:
    return torch.compile(model, backend=_TORCH_BACKEND[backend])


def _torch_compile_budget(fraction: float) -> Wrap:
    def wrap(model: nn.Module, blocks: tuple[str, ...], backend: Backend) -> StepFn:
        from mirrorgrad import _compat  # imports torch._dynamo: only when compiling

        compiled = torch.compile(model, backend=_TORCH_BACKEND[backend])

        # The partitioner reads the budget when it runs (first call, recompiles).
        def step_fn(*batch: Tensor) -> Tensor:
            with _compat.activation_memory_budget(fraction):
                return compiled(*batch)

        return step_fn

    return wrap


def _mirror(options: dict[str, Any]) -> Wrap:
    def wrap(model: nn.Module, blocks: tuple[str, ...], backend: Backend) -> StepFn:
        import mirrorgrad

        return mirrorgrad.compile(model, backend=backend, **options)

    return wrap


# The fractions of the frontier: torch.compile's activation_memory_budget and our budget
# at each, beside compile itself (fraction 1) and balance.
FRACTIONS = (0.7, 0.5, 0.3, 0.1)
# Only in the frontier: the planner suite's default run leaves them out (each is a compile).
FRONTIER_ONLY = ("compile-budget-0.7", "mirror-budget-0.7", "mirror-budget-0.1")


def _base_methods() -> list[Method]:
    budgets = [Method(name=f"compile-budget-{f}", wrap=_torch_compile_budget(f), compiles=True,
                      description=f"torch.compile, activation_memory_budget={f}")
               for f in FRACTIONS]  # fmt: skip
    mirror_modes: list[tuple[str, dict[str, Any]]] = [("mirror-balance", {"mode": "balance"})]
    mirror_modes += [(f"mirror-budget-{f}", {"mode": "budget", "budget": f}) for f in FRACTIONS]
    mirrors = [Method(name=name, wrap=_mirror(options), compiles=True, mirror_options=options,
                      description=f"mirrorgrad.compile({_keywords(options)})")
               for name, options in mirror_modes]  # fmt: skip
    plain = [
        Method(name="eager", description="plain PyTorch", wrap=_eager, compiles=False),
        Method(name="compile", description="torch.compile, default options",
               wrap=_torch_compile, compiles=True),
    ]  # fmt: skip
    others = [
        Method(name="cuda-graph", description="plain PyTorch, the whole step captured in one "
               "CUDA Graph", wrap=_eager, compiles=False, cuda_graph=True),
        Method(name="checkpoint", description="torch.utils.checkpoint around each block of the "
               "workload", wrap=_checkpoint, compiles=False),
    ]  # fmt: skip
    return [*plain, *budgets, *others, *mirrors]


def _keywords(options: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in options.items())


# The `+mgnn` methods run by default on recurrent workloads (all exist, for --methods).
MGNN_BASES = ("eager", "compile", "mirror-balance", "mirror-budget-0.3")


def _registry() -> dict[str, Method]:
    bases = _base_methods()
    methods = {m.name: m for m in bases}
    for m in bases:
        name = f"{m.name}+mgnn"
        # mirrorgrad.nn's Triton kernels compile at the first call: --precompile-jobs
        # warms their cache too.
        described = m.description + ", mirrorgrad.nn RNNs"
        methods[name] = dataclasses.replace(m, name=name, description=described, swap_rnn=True,
                                            compiles=True)  # fmt: skip
    return methods


# The general methods; suites.METHODS adds the rnn-kernels and word-lm suites' own.
BASE_METHODS: dict[str, Method] = _registry()
# The planner suite's methods (the other suites name their own): all but cuda-graph.
PLANNER_METHODS = tuple(m.name for m in _base_methods()
                        if m.name != "cuda-graph" and m.name not in FRONTIER_ONLY)  # fmt: skip
# The frontier of one workload: `mirrorgrad bench --workloads W --methods *FRONTIER_METHODS`.
FRONTIER_METHODS = ("compile", *(f"compile-budget-{f}" for f in FRACTIONS), "checkpoint",
                    "mirror-balance", *(f"mirror-budget-{f}" for f in FRACTIONS))  # fmt: skip


def default_methods(recurrent: bool) -> list[str]:
    """The planner suite's methods, and on recurrent workloads the MGNN_BASES ones with
    mirrorgrad.nn RNNs."""
    mgnn = [f"{base}+mgnn" for base in MGNN_BASES] if recurrent else []
    return [*PLANNER_METHODS, *mgnn]
