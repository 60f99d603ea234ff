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
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from mirrorgrad import _compat
from mirrorgrad.mirror.budget_search import Plan, PlanOptions
from mirrorgrad.mirror.partition import (
    MirrorgradFallbackWarning,
    MirrorPartitioner,
    PinViewedOutputStrides,
    PlanCallback,
    partition,
)
from mirrorgrad.mirror.policy import policy_for
from mirrorgrad.options import DEFAULT_MAX_OVERHEAD, MirrorOptions, Mode

CODEGENS = ("inductor", "eager")


@dataclass(kw_only=True, slots=True, eq=False)  # a backend is compared by identity
class MirrorBackend:
    """A ``torch.compile`` backend that partitions with the mirror planner.

    ``plans`` collects every plan applied, one per compiled graph (AOTAutograd's cache,
    which would skip the partitioner, is off for these compiles); ``on_plan`` is called
    with each as well.
    """

    options: MirrorOptions = field(default_factory=MirrorOptions)
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

    def plan_options(self) -> PlanOptions:
        """Options as of now: ``mark``s and ``MIRRORGRAD_MIRROR`` are read at compile time."""
        policy = policy_for(self.root_module)
        # MIRRORGRAD_MIRROR=0 disables the policy: the graph still goes through our
        # partition, stashing everything, and the plan says mode "off".
        mirror = self.options if policy.enabled else MirrorOptions(mode="off")
        return PlanOptions(
            mode=mirror.mode,
            budget=mirror.budget,
            max_overhead=mirror.max_overhead,
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
            settings = {
                **(_compat.inductor_mode_options(mode) if mode else {}),
                **self.inductor_options,
                **(options or {}),
            }
            return self._inductor(gm, example_inputs, settings)

    def _inductor(
        self, gm: GraphModule, example_inputs: Sequence[object], settings: dict[str, Any]
    ) -> Callable[..., Any]:
        """Inductor with our partition; if Inductor rejects the plan's forward or backward,
        PyTorch's partition (min-cut) with one ``MirrorgradFallbackWarning``."""
        applied: list[Plan] = []
        partitioner = MirrorPartitioner(self.plan_options(), on_plan=applied.append)
        # Patched for this compilation only: other torch.compile calls keep min-cut. The
        # backward compiles now, not at the first backward, so that a plan Inductor
        # rejects is found while PyTorch's partition can still take over.
        pin = PinViewedOutputStrides(
            settings.get(
                _compat.INDUCTOR_POST_GRAD_PASS_CONFIG,
                getattr(_compat.inductor_config, _compat.INDUCTOR_POST_GRAD_PASS_CONFIG),
            )
        )
        patch = {
            **settings,
            _compat.INDUCTOR_PARTITIONER_CONFIG: partitioner,
            _compat.INDUCTOR_POST_GRAD_PASS_CONFIG: pin,
        }
        context = _compat.tracing_context()
        try:
            with _compat.inductor_config.patch(patch), _compat.eager_backward_compile():
                compiled = _compat.compile_fx(gm, example_inputs)
        except Exception as exc:
            if self.strict or not applied:  # no plan of ours was in it: not ours to fix
                raise
            compiled = _compile_min_cut(gm, example_inputs, settings)
            _warn_fallback(f"Inductor rejected the plan ({_describe(exc)})")
            return compiled
        for applied_plan in applied:
            self._record(applied_plan)
        if not applied or self.strict:  # min-cut ran (planning fell back): nothing to guard
            return compiled

        def fall_back(exc: BaseException) -> Callable[..., Any]:
            for applied_plan in applied:
                self.plans.remove(applied_plan)
            with _compat.tracing(context):
                fallback = _compile_min_cut(gm, example_inputs, settings)
            cause = f"the plan's compiled forward failed on its first call ({_describe(exc)})"
            _warn_fallback(cause)
            return fallback

        return FirstCallGuard(
            compiled, fall_back, _compat.mutated_input_indices(context, len(example_inputs))
        )

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
    mode: Mode = "balance",
    budget: float | int | str | None = None,
    max_overhead: float = DEFAULT_MAX_OVERHEAD,
    backend: str = "inductor",
    on_plan: PlanCallback | None = None,
    root_module: nn.Module | None = None,
) -> MirrorBackend:
    """A backend for ``torch.compile(model, backend=mirrorgrad.backend(...))``.

    Options as for :func:`compile`. ``root_module`` (the compiled model) lets the
    planner see ``mirrorgrad.mark``s; ``on_plan`` receives each plan applied.
    """
    return MirrorBackend(
        options=MirrorOptions(mode=mode, budget=budget, max_overhead=max_overhead),
        codegen=backend,
        root_module=root_module,
        on_plan=on_plan,
    )


def registered_backend(
    gm: GraphModule,
    example_inputs: Sequence[object],
    *,
    mode: str | None = None,
    options: dict[str, Any] | None = None,
):
    """``torch.compile(model, backend="mirrorgrad", options={...})``: the backend that the
    ``torch_dynamo_backends`` entry point names.

    ``options`` holds the planner's keys (``mode``, ``budget``, ``max_overhead``; see
    ``MirrorOptions``) and, beside them, Inductor settings; ``mode`` is
    ``torch.compile``'s own (an Inductor mode such as ``"max-autotune"``). Without the
    model at hand, ``mirrorgrad.mark``s are not seen: use ``mirrorgrad.compile`` for them.
    """
    mirror_keys = {f.name for f in fields(MirrorOptions)}
    options = dict(options or {})
    mirror = {k: options.pop(k) for k in list(options) if k in mirror_keys}
    unknown = sorted(set(options) - _compat.inductor_setting_names())
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(map(repr, unknown))} for backend='mirrorgrad': "
            f"the planner's are {', '.join(sorted(mirror_keys))}; any other must be an "
            "Inductor setting (torch._inductor.config)"
        )
    return MirrorBackend(options=MirrorOptions(**mirror))(
        gm, example_inputs, mode=mode, options=options
    )


def compile(
    model_or_fn: nn.Module | Callable[..., Any],
    *,
    mode: Mode = "balance",
    budget: float | int | str | None = None,
    max_overhead: float = DEFAULT_MAX_OVERHEAD,
    backend: str = "inductor",
    **torch_compile_kwargs: Any,
) -> Callable[..., Any]:
    """``torch.compile`` with the mirror planner choosing what to stash for backward.

    - ``mode="balance"``: the lowest estimated peak within ``max_overhead`` (a fraction
      of the step time) of added recompute time.
    - ``mode="budget"``: the least added time whose estimated peak meets ``budget``
      (bytes: an int or ``"2GiB"``; or a fraction in (0, 1] on the scale of PyTorch's
      ``activation_memory_budget``: of the saved activations of torch.compile's default).
    - ``mode="off"``: stash every value the backward reads (no mirroring).
    - ``backend="inductor"`` generates code; ``"eager"`` runs AOTAutograd's graphs
      without code generation.

    Other keyword arguments go to ``torch.compile`` (``fullgraph``, ``dynamic``;
    ``options`` are Inductor settings). The result's ``_mirrorgrad_plans`` lists the
    plans applied, one per compiled graph.
    """
    inductor_options = torch_compile_kwargs.pop("options", None) or {}
    mirror_backend = MirrorBackend(
        options=MirrorOptions(mode=mode, budget=budget, max_overhead=max_overhead),
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
    mode: Mode = "balance",
    budget: float | int | str | None = None,
    max_overhead: float = DEFAULT_MAX_OVERHEAD,
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
        options=MirrorOptions(mode=mode, budget=budget, max_overhead=max_overhead),
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


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else "no message"


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {_first_line(exc)}"


def _warn_fallback(cause: str) -> None:
    warnings.warn(
        f"mirrorgrad: {cause}; using PyTorch's min-cut partition for this graph instead",
        MirrorgradFallbackWarning,
        stacklevel=3,
    )


def _compile_min_cut(
    gm: GraphModule, example_inputs: Sequence[object], settings: dict[str, Any]
) -> Callable[..., Any]:
    # The backward compiles now too, inside the patch (options such as triton.cudagraphs
    # would miss a backward compiled at the first backward call, after this returns).
    with (
        _compat.without_autograd_cache(),
        _compat.inductor_config.patch(settings),
        _compat.eager_backward_compile(),
    ):
        return _compat.compile_fx(gm, example_inputs)


class FirstCallGuard:
    """A planned graph's compiled code, and what to do if its first call fails.

    Compile-time checks cannot see every layout Inductor settles on, so an error can
    surface only when the generated code runs (issue 18). The first call that raises
    inside the planned code is run again by ``fall_back(exc)``'s graph (PyTorch's own
    partition, compiled then), and every later call goes there too.

    Re-running the call is sound because a forward that raised returned nothing and
    queued no backward, and because its only other effects are undone first: the RNG
    state (restored, so dropout draws what it would have drawn) and the inputs the
    graph mutates (BatchNorm statistics: copies taken before the first call). Anything
    else the compiled forward wrote to (outside its inputs) is assumed not to exist.
    A failure in the backward, which runs later, is not covered.
    """

    def __init__(
        self,
        planned: Callable[..., Any],
        fall_back: Callable[[BaseException], Callable[..., Any]],
        mutated_inputs: Sequence[int] | None,
    ) -> None:
        self.planned = planned
        self.fall_back = fall_back
        self.mutated_inputs = mutated_inputs  # None: unknown, every non-grad tensor
        self.verified = False
        self.fallback: Callable[..., Any] | None = None

    def __call__(self, *args: Any) -> Any:
        if self.fallback is not None:
            return self.fallback(*args)
        if self.verified:
            return self.planned(*args)
        # A list argument (compiled autograd's boxed inputs) is emptied by the call.
        kept = [list(a) if isinstance(a, list) else a for a in args]
        undo = _UndoLog.before(args, self.mutated_inputs)
        try:
            out = self.planned(*args)
        except Exception as exc:
            undo.restore()
            self.fallback = self.fall_back(exc)
            return self.fallback(*kept)
        self.verified = True
        return out

    def __getattr__(self, name: str) -> Any:
        # What else Dynamo and AOTAutograd read off the compiled function (named_parameters,
        # zero_grad, serialize) is the planned code's.
        if name == "planned":
            raise AttributeError(name)
        return getattr(self.planned, name)


@dataclass(slots=True)
class _UndoLog:
    """What a first call changes outside its outputs: the RNG states and mutated inputs."""

    cpu_rng: torch.Tensor
    cuda_rng: dict[int, torch.Tensor]
    inputs: list[tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def before(cls, args: Sequence[Any], mutated: Sequence[int] | None) -> _UndoLog:
        flat = [x for a in args for x in (a if isinstance(a, list) else [a])]
        tensors = [(i, a) for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
        devices = sorted({a.device.index or 0 for _, a in tensors if a.is_cuda})
        wanted = set(mutated) if mutated is not None else set()
        chosen = [
            a for i, a in tensors if (not a.requires_grad if mutated is None else i in wanted)
        ]
        with torch.no_grad():
            copies = [(a, a.detach().clone()) for a in chosen]
        return cls(
            cpu_rng=torch.get_rng_state(),
            cuda_rng={d: torch.cuda.get_rng_state(d) for d in devices},
            inputs=copies,
        )

    def restore(self) -> None:
        torch.set_rng_state(self.cpu_rng)
        for device, state in self.cuda_rng.items():
            torch.cuda.set_rng_state(state, device)
        with torch.no_grad():
            for tensor, copy in self.inputs:
                tensor.copy_(copy)


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
