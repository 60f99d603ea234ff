"""``mirrorgrad.compile``, ``mirrorgrad.backend`` and ``mirrorgrad.explain``.

(DESIGN.md calls this module compile.py; a module named like the public function
``mirrorgrad.compile`` would replace that function on the package once imported.)

``torch.compile`` with the mirror planner as its partitioner: Dynamo captures the
graph, AOTAutograd builds the joint forward+backward graph, the planner chooses what
to stash, and either Inductor generates code (``backend="inductor"``) or the two
graphs run as they are (``backend="eager"``: no code generation).
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from mirrorgrad import _compat
from mirrorgrad.mirror.budget_search import Plan, PlanOptions
from mirrorgrad.mirror.partition import MirrorPartitioner, PlanCallback, partition
from mirrorgrad.mirror.policy import policy_for

CODEGENS = ("inductor", "eager")


@dataclass(kw_only=True, slots=True, eq=False)  # a backend is compared by identity
class MirrorBackend:
    """A ``torch.compile`` backend that partitions with the mirror planner.

    ``plans`` collects every plan applied, one per compiled graph (AOTAutograd's cache,
    which would skip the partitioner, is off for these compiles); ``on_plan`` is called
    with each as well.
    """

    mode: str = "balance"
    budget: float | None = None
    max_overhead: float = 0.05
    codegen: str = "inductor"
    # Plan for Inductor's fusion (pointwise values kept in registers); default: on
    # exactly when Inductor generates the code.
    fusion: bool | None = None
    inductor_options: dict[str, Any] = field(default_factory=dict)
    root_module: nn.Module | None = None
    on_plan: PlanCallback | None = None
    strict: bool = False
    plans: list[Plan] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.codegen not in CODEGENS:
            raise ValueError(f"backend={self.codegen!r}: choose one of {', '.join(CODEGENS)}")
        if self.inductor_options and self.codegen != "inductor":
            raise ValueError("options= are Inductor settings: use them with backend='inductor'")
        self.plan_options()  # PlanOptions checks mode, budget and max_overhead

    def plan_options(self) -> PlanOptions:
        """Options as of now: ``mark``s and ``MIRRORGRAD_MIRROR`` are read at compile time."""
        policy = policy_for(self.root_module)
        # MIRRORGRAD_MIRROR=0 disables the policy: the graph still goes through our
        # partition, stashing everything, and the plan says mode "off".
        return PlanOptions(
            mode=self.mode if policy.enabled else "off",
            budget=self.budget,
            max_overhead=self.max_overhead,
            policy=policy,
            fusion=self.codegen == "inductor" if self.fusion is None else self.fusion,
        )

    def _record(self, plan: Plan) -> None:
        self.plans.append(plan)
        if self.on_plan is not None:
            self.on_plan(plan)

    def __call__(
        self,
        gm: GraphModule,
        example_inputs: Sequence[object],
        *,
        mode: str | None = None,
        options: dict[str, Any] | None = None,
    ):
        """Compile one Dynamo graph. ``mode`` and ``options`` are what ``torch.compile(...,
        mode=, options=)`` forwards to a backend: Inductor's, so Inductor codegen only."""
        if (mode or options) and self.codegen != "inductor":
            raise ValueError(
                "torch.compile mode=/options= are Inductor settings: use them "
                "with backend='inductor'"
            )
        # Without AOTAutograd's cache every compile runs the planner and records its plan.
        with _compat.without_autograd_cache():
            if self.codegen == "eager":
                return self._aot_eager()(gm, example_inputs)
            partitioner = MirrorPartitioner(self.plan_options(), on_plan=self._record)
            settings = {
                **(_compat.inductor_mode_options(mode) if mode else {}),
                **self.inductor_options,
                **(options or {}),
                # Patched for this compilation only: other torch.compile calls keep min-cut.
                _compat.INDUCTOR_PARTITIONER_CONFIG: partitioner,
            }
            # As config_patches: Inductor compiles the backward at the first backward call,
            # after this returns, and patches that compile with them too.
            return _compat.compile_fx(gm, example_inputs, config_patches=settings)

    def _aot_eager(self) -> Callable[..., Any]:
        """AOTAutograd with our partition and no code generation."""
        partition_fn = functools.partial(
            partition,
            options=self.plan_options(),
            on_plan=self._record,
            strict=self.strict,
        )
        functools.update_wrapper(partition_fn, partition)
        return _compat.aot_autograd(
            fw_compiler=_compat.boxed_nop,
            bw_compiler=_compat.boxed_nop,
            partition_fn=partition_fn,
            keep_inference_input_mutations=True,
        )


def backend(
    *,
    mode: str = "balance",
    budget: float | None = None,
    max_overhead: float = 0.05,
    backend: str = "inductor",
    on_plan: PlanCallback | None = None,
    root_module: nn.Module | None = None,
) -> MirrorBackend:
    """A backend for ``torch.compile(model, backend=mirrorgrad.backend(...))``.

    Options as for :func:`compile`. ``root_module`` (the compiled model) lets the
    planner see ``mirrorgrad.mark``s; ``on_plan`` receives each plan applied.
    """
    return MirrorBackend(
        mode=mode,
        budget=budget,
        max_overhead=max_overhead,
        codegen=backend,
        root_module=root_module,
        on_plan=on_plan,
    )


def parse_mode(text: str) -> dict[str, Any]:
    """``balance`` | ``off`` | ``budget:F`` (fraction of the unmirrored peak, 0 < F <= 1)
    | ``budget:BYTES`` -> the ``mode=`` and ``budget=`` options of ``compile``/``explain``.

    The one parser behind the CLIs' mode flags; ValueError on anything else."""
    name, _, value = text.partition(":")
    if name in ("balance", "off") and not value:
        return {"mode": name}
    if name == "budget" and value:
        try:
            budget = float(value)
        except ValueError:
            pass
        else:
            if math.isfinite(budget) and budget > 0:
                return {"mode": "budget", "budget": budget if budget <= 1 else int(budget)}
    raise ValueError(f"mode {text!r}: use balance, off, or budget:FRACTION (0-1] / budget:BYTES")


def compile(
    model_or_fn: nn.Module | Callable[..., Any],
    *,
    mode: str = "balance",
    budget: float | None = None,
    max_overhead: float = 0.05,
    backend: str = "inductor",
    **torch_compile_kwargs: Any,
) -> Callable[..., Any]:
    """``torch.compile`` with the mirror planner choosing what to stash for backward.

    - ``mode="balance"``: the lowest estimated peak within ``max_overhead`` (a fraction
      of the step time) of added recompute time.
    - ``mode="budget"``: the least added time whose estimated peak meets ``budget``
      (bytes, or a fraction <= 1 of the unmirrored peak).
    - ``mode="off"``: stash every value the backward reads (no mirroring).
    - ``backend="inductor"`` generates code; ``"eager"`` runs AOTAutograd's graphs
      without code generation.

    Other keyword arguments go to ``torch.compile`` (``fullgraph``, ``dynamic``;
    ``options`` are Inductor settings). The result's ``_mirrorgrad_plans`` lists the
    plans applied, one per compiled graph.
    """
    inductor_options = torch_compile_kwargs.pop("options", None) or {}
    mirror_backend = MirrorBackend(
        mode=mode,
        budget=budget,
        max_overhead=max_overhead,
        codegen=backend,
        inductor_options=inductor_options,
        root_module=model_or_fn if isinstance(model_or_fn, nn.Module) else None,
    )
    compiled = torch.compile(model_or_fn, backend=mirror_backend, **torch_compile_kwargs)
    # object.__setattr__: an OptimizedModule would forward the attribute to the user's
    # model, where deepcopy and pickle would then meet the plans' graph nodes.
    object.__setattr__(compiled, "_mirrorgrad_plans", mirror_backend.plans)
    return compiled


def explain(
    model: nn.Module | Callable[..., Any],
    *example_inputs: Any,
    mode: str = "balance",
    budget: float | None = None,
    max_overhead: float = 0.05,
    backend: str = "inductor",
    **torch_compile_kwargs: Any,
) -> Plan:
    """The plan the planner makes for ``model`` on ``example_inputs``, without codegen.

    ``backend`` is the one the plan is for (``mirrorgrad.compile``'s): with Inductor the
    estimate counts its fusion of pointwise ops.

    Runs the forward once through AOTAutograd (no backward); parameters, buffers
    (BatchNorm statistics) and the RNG state are as before afterwards. A planning error
    is raised, not fallen back from. The model must compile to one graph
    (``fullgraph=True`` unless overridden).
    """
    if backend not in CODEGENS:
        raise ValueError(f"backend={backend!r}: choose one of {', '.join(CODEGENS)}")
    mirror_backend = MirrorBackend(
        mode=mode,
        budget=budget,
        max_overhead=max_overhead,
        codegen="eager",
        fusion=backend == "inductor",
        root_module=model if isinstance(model, nn.Module) else None,
        strict=True,
    )
    torch_compile_kwargs.setdefault("fullgraph", True)
    compiled = torch.compile(_own_frame(model), backend=mirror_backend, **torch_compile_kwargs)
    state = _snapshot(model)
    devices = sorted(
        {x.device.index or 0 for x in example_inputs if _is_cuda_tensor(x)}
        | {t.device.index or 0 for t in state if t.is_cuda}
    )
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            compiled(*example_inputs)
    finally:
        _restore(state)
    if not mirror_backend.plans:
        raise ValueError(
            "explain(): no forward+backward graph was built; make a parameter or an "
            "input require grad"
        )
    # With fullgraph=False a graph break gives several plans: the largest one is shown.
    return max(mirror_backend.plans, key=lambda p: p.peak_before)


def _own_frame(model: Callable[..., Any]) -> Callable[..., Any]:
    """``model(*args)`` through a function with a code object of its own.

    Dynamo keeps compiled code per code object, at most ``recompile_limit`` (8) entries
    each; compiling ``model`` itself would add an entry to its class's ``forward`` at
    every call of explain (a new backend each time), and the ninth call, or the user's
    own compile after eight, would find the limit hit. Entries on a fresh code object
    die with it.
    """

    def run(*args: Any) -> Any:
        return model(*args)

    code = run.__code__.replace()
    return types.FunctionType(code, run.__globals__, "explain", None, run.__closure__)


def _is_cuda_tensor(x: object) -> bool:
    return isinstance(x, torch.Tensor) and x.is_cuda


def _snapshot(model: object) -> dict[torch.Tensor, torch.Tensor]:
    """Copies of the buffers: a forward pass changes those (BatchNorm statistics), never
    the parameters."""
    if not isinstance(model, nn.Module):
        return {}
    with torch.no_grad():
        return {t: t.detach().clone() for t in model.buffers()}


def _restore(state: dict[torch.Tensor, torch.Tensor]) -> None:
    with torch.no_grad():
        for tensor, saved in state.items():
            tensor.copy_(saved)
