"""``mirrorgrad.compile``, ``mirrorgrad.backend`` and ``mirrorgrad.explain``.

(DESIGN.md calls this module compile.py; a module named like the public function
``mirrorgrad.compile`` would replace that function on the package once imported.)

``torch.compile`` with the mirror planner as its partitioner: Dynamo captures the
graph, AOTAutograd builds the joint forward+backward graph, the planner chooses what
to stash, and either Inductor generates code (``backend="inductor"``) or the two
graphs run as they are (``backend="eager"``: no code generation).
"""

from __future__ import annotations

import copy
import functools
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from mirrorgrad import _compat
from mirrorgrad.mirror.fused_loss import FusedLoss, fuse_lm_head_losses
from mirrorgrad.mirror.partition import (
    MirrorgradFallbackWarning,
    MirrorPartitioner,
    PlanCallback,
    PlannedGraphPass,
    partition,
)
from mirrorgrad.mirror.plan import Plan, PlanOptions
from mirrorgrad.mirror.policy import policy_for
from mirrorgrad.options import DEFAULT_MAX_OVERHEAD, MirrorOptions, Mode
from mirrorgrad.safety_copies import Room, SafetyCopies, device_room

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
    # Plans say whether balance reaches its target, and why not (explain sets it).
    diagnose_balance: bool = False
    # Plan each graph and generate no code: the graph then runs as Dynamo traced it
    # (explain). With Inductor, the plan is of the joint graph Inductor partitions.
    plan_only: bool = False
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
            diagnose_balance=self.diagnose_balance,
        )

    def _fuse_losses(self, gm: GraphModule) -> list[FusedLoss]:
        """The LM-head loss rewrite on Dynamo's graph, before AOTAutograd traces it."""
        if self.options.fuse_loss:
            return fuse_lm_head_losses(gm, True)
        # Off unless asked: the fused op recomputes the head's GEMM in backward and runs
        # its chunks as unfused torch ops. On GPT-2 at budget 0.5 (H100) it cut the peak
        # 5,869 -> 4,461 MiB but made the step 1.30x slower: no budget asked for that.
        why = "fuse_loss=True fuses it" if self.options.fuse_loss is None else "fuse_loss=False"
        return fuse_lm_head_losses(gm, False, why)

    def _record(self, plan: Plan, fused_losses: Sequence[FusedLoss] = ()) -> None:
        plan.fused_losses = list(fused_losses)
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
        fused_losses = self._fuse_losses(gm)
        # Without AOTAutograd's cache every compile runs the planner and records its plan.
        with _compat.without_autograd_cache():
            if self.codegen == "eager":
                return self._aot_eager(fused_losses)(gm, example_inputs)
            settings = {
                **(_compat.inductor_mode_options(mode) if mode else {}),
                **self.inductor_options,
                **(options or {}),
            }
            if self.plan_only:
                return self._inductor_plan(gm, example_inputs, settings, fused_losses)
            return self._inductor(gm, example_inputs, settings, fused_losses)

    def _inductor_plan(
        self,
        gm: GraphModule,
        example_inputs: Sequence[object],
        settings: dict[str, Any],
        fused_losses: Sequence[FusedLoss],
    ) -> Callable[..., Any]:
        """Plan the joint graph Inductor partitions (after its decompositions and
        joint-graph passes: what ``compile`` plans), then stop before code generation;
        ``gm`` runs as it is, without autograd (``_without_autograd``). A planning error
        is raised (``strict``)."""
        applied: list[Plan] = []
        partitioner = _StrictPartitioner(self.plan_options(), on_plan=applied.append)
        patch = {**settings, _compat.INDUCTOR_PARTITIONER_CONFIG: partitioner}
        try:
            with _compat.inductor_config.patch(patch):
                _compat.compile_fx(gm, example_inputs, inner_compile=_stop_before_codegen)
        except Exception as exc:  # Dynamo may wrap what the compile raises
            if not any(isinstance(e, _BeforeCodegen) for e in _causes(exc)):
                raise
        for applied_plan in applied:
            self._record(applied_plan, fused_losses)
        return _without_autograd(gm)

    def _inductor(
        self,
        gm: GraphModule,
        example_inputs: Sequence[object],
        settings: dict[str, Any],
        fused_losses: Sequence[FusedLoss],
    ) -> Callable[..., Any]:
        """Inductor with our partition; if Inductor rejects the plan's forward or backward,
        or either fails on its first call, PyTorch's partition (min-cut) with one
        ``MirrorgradFallbackWarning``."""
        applied: list[Plan] = []
        partitioner = MirrorPartitioner(self.plan_options(), on_plan=applied.append)
        # Patched for this compilation only: other torch.compile calls keep min-cut. The
        # backward compiles now, not at the first backward, so that a plan Inductor
        # rejects is found while PyTorch's partition can still take over.
        pin = PlannedGraphPass(
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
        backward_failed = _BackwardFailed()
        inner_compile = functools.partial(
            _compile_guarding_the_backward,
            guarded=lambda: bool(applied) and not self.strict,
            on_failure=backward_failed.record,
            parameters=self._parameters,
            room=device_room(lambda: applied[-1] if applied else None),
        )
        try:
            with _compat.inductor_config.patch(patch), _compat.eager_backward_compile():
                compiled = _compat.compile_fx(gm, example_inputs, inner_compile=inner_compile)
        except Exception as exc:
            if self.strict or not applied:  # no plan of ours was in it: not ours to fix
                raise
            compiled = _compile_min_cut(gm, example_inputs, settings)
            _warn_fallback(f"Inductor rejected the plan ({_describe(exc)})")
            return compiled
        for applied_plan in applied:
            self._record(applied_plan, fused_losses)
        if not applied or self.strict:  # min-cut ran (planning fell back): nothing to guard
            return compiled

        def min_cut() -> Callable[..., Any]:
            for applied_plan in applied:
                if applied_plan in self.plans:
                    self.plans.remove(applied_plan)
            with _compat.tracing(context):
                return _compile_min_cut(gm, example_inputs, settings)

        return FirstCallGuard(
            compiled,
            min_cut,
            _compat.mutated_input_indices(context, len(example_inputs)),
            backward_failed,
        )

    def _parameters(self) -> list[torch.Tensor]:
        """The compiled model's parameters as they are now (none known without it)."""
        return [] if self.root_module is None else list(self.root_module.parameters())

    def _aot_eager(self, fused_losses: Sequence[FusedLoss]) -> Callable[..., Any]:
        """AOTAutograd with our partition and no code generation."""
        partition_fn = functools.partial(
            partition,
            options=self.plan_options(),
            on_plan=functools.partial(self._record, fused_losses=fused_losses),
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
    fuse_loss: bool | None = None,
    backend: str = "inductor",
    on_plan: PlanCallback | None = None,
    root_module: nn.Module | None = None,
) -> MirrorBackend:
    """The planner as a backend: ``torch.compile(model, backend=mirrorgrad.backend())``.

    Args:
        mode, budget, max_overhead, fuse_loss, backend: as for :func:`compile`.
        on_plan: called with each plan applied.
        root_module: the compiled model, so that the planner sees its
            ``mirrorgrad.mark`` tags (``mirrorgrad.compile`` passes it).

    One backend object plans each distinct graph once; give the same object to every
    block compiled on its own (FSDP2), so that Dynamo does not recompile a shared
    ``forward`` once per backend.

    Example::

        >>> planner = mirrorgrad.backend(mode="budget", budget="2GiB")
        >>> compiled = torch.compile(model, backend=planner)
    """
    return MirrorBackend(
        options=MirrorOptions(
            mode=mode, budget=budget, max_overhead=max_overhead, fuse_loss=fuse_loss
        ),
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
    fuse_loss: bool | None = None,
    backend: str = "inductor",
    **torch_compile_kwargs: Any,
) -> Callable[..., Any]:
    """``torch.compile`` with the mirror planner choosing what to keep for the backward.

    The planner sees the joint forward+backward graph and decides, value by value,
    what the forward keeps ("stash") and what the backward recomputes ("mirror"),
    judged by the estimated peak memory of the whole step and the estimated time of
    the recomputation. Gradients are those of the model without mirroring; a graph the
    planner cannot handle falls back to PyTorch's own partition with one
    ``MirrorgradFallbackWarning``.

    Args:
        model_or_fn: an ``nn.Module`` or a function of tensors, as ``torch.compile``
            takes. ``mirrorgrad.mark(submodule, mirror=...)`` tags on a module are seen.
        mode: ``"balance"`` (default): the lowest estimated peak whose added recompute
            time stays within ``max_overhead`` of the step. ``"budget"``: the least
            added time whose estimated peak meets ``budget``. ``"off"``: stash every
            value the backward reads.
        budget: only with ``mode="budget"``. Peak bytes (``2_000_000_000``,
            ``"2GiB"``) or a fraction in (0, 1] on the scale of PyTorch's
            ``activation_memory_budget`` (``0.5`` asks for about the peak that
            ``activation_memory_budget=0.5`` reaches). A budget no plan meets gets the
            lowest peak found and one ``MirrorgradBudgetWarning``.
        max_overhead: balance mode's cap on added time, a fraction of the estimated
            step time (default 0.03).
        fuse_loss: ``True`` rewrites an LM head's ``F.cross_entropy(F.linear(h,
            w), target)`` (views, ``.float()``, a shift slice between them allowed) to
            the fused ``linear_cross_entropy``, whose ``[tokens, vocab]`` logits never
            exist whole: less memory, more time (it recomputes the head's GEMM; GPT-2
            small at budget 0.5 on an H100: 0.76x the peak at 1.30x the step). ``None``
            (default) and ``False``: not rewritten. Logits that the model also returns
            or reuses are never rewritten. The plan names each head.
        backend: ``"inductor"`` (default) generates fused code; ``"eager"`` runs
            AOTAutograd's forward and backward graphs op by op (CPU examples, tests).
        **torch_compile_kwargs: passed to ``torch.compile`` (``fullgraph``,
            ``dynamic``, ...); ``options`` are Inductor settings for both graphs, e.g.
            ``options={"triton.cudagraphs": True}`` replays each as a CUDA Graph.

    Returns:
        The compiled callable, called like ``model_or_fn``. Its ``_mirrorgrad_plans``
        lists the plans applied, one per compiled graph (see :func:`explain`).

    Raises:
        ValueError: an unknown ``mode``, a ``budget`` outside ``mode="budget"`` or out
            of range, a negative ``max_overhead``.

    Example::

        >>> layers = [nn.Linear(256, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 10)]
        >>> model = nn.Sequential(*layers)
        >>> step = mirrorgrad.compile(model, mode="budget", budget=0.5, backend="eager")
        >>> step(torch.randn(4096, 256)).square().mean().backward()
        >>> plan = step._mirrorgrad_plans[0]
        >>> plan.peak_after <= plan.peak_before
        True
    """
    inductor_options = torch_compile_kwargs.pop("options", None) or {}
    mirror_backend = MirrorBackend(
        options=MirrorOptions(
            mode=mode, budget=budget, max_overhead=max_overhead, fuse_loss=fuse_loss
        ),
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
    fuse_loss: bool | None = None,
    backend: str = "inductor",
    **torch_compile_kwargs: Any,
) -> Plan:
    """The plan :func:`compile` would make for ``model`` on ``example_inputs``, without running it.

    Plans the joint graph ``compile`` would plan (with ``backend="inductor"`` the one
    Inductor partitions, after its decompositions: dropout as seeded draws, layer norm
    and cross-entropy as pointwise ops), runs the forward as Dynamo traced it (no
    backward, no code generation) and returns the plan: what is stashed and what is
    mirrored, the stash and the estimated peak before and after, the added FLOPs and
    time, and for a budget whether it is met and what holds the floor. Parameters,
    buffers (BatchNorm statistics) and the RNG state are as they were afterwards. A
    planning error is raised, not fallen back from.

    Args:
        model: an ``nn.Module`` or a function of tensors; it must compile to one graph
            (``fullgraph=True`` unless overridden), and a parameter or an input must
            require grad.
        *example_inputs: the inputs of one call, at the sizes to plan for.
        mode, budget, max_overhead, fuse_loss: as for :func:`compile`.
        backend: the backend the plan is for: with ``"inductor"`` (default) the
            estimate counts Inductor's fusion of pointwise ops; ``"eager"`` does not.
        **torch_compile_kwargs: passed to ``torch.compile`` (``fullgraph=True`` and
            ``dynamic=False``, the sizes given, unless overridden).

    Returns:
        A ``Plan``. ``print(plan)`` lists every saved and mirrored value with its op,
        shape and bytes; ``plan.summary_line()`` says it in one line;
        ``plan.to_dict()`` is JSON-able. Attributes include ``peak_before`` /
        ``peak_after`` (estimated bytes), ``added_time_s``, ``budget_met``, ``floor``
        and ``op_memory`` (the memory mode chosen for each ``mirrorgrad.nn`` RNN).

    Raises:
        ValueError: bad options, or no forward+backward graph (nothing requires grad).

    Example::

        >>> layers = [nn.Linear(256, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 10)]
        >>> model = nn.Sequential(*layers)
        >>> plan = mirrorgrad.explain(model, torch.randn(4096, 256), mode="budget", budget=0.5)
        >>> print(plan.summary_line())  # doctest: +SKIP
        mirror budget: estimated peak ... MiB (... MiB unmirrored), +...% time; budget ... met
    """
    if backend not in CODEGENS:
        raise ValueError(f"backend={backend!r}: choose one of {', '.join(CODEGENS)}")
    mirror_backend = MirrorBackend(
        options=MirrorOptions(
            mode=mode, budget=budget, max_overhead=max_overhead, fuse_loss=fuse_loss
        ),
        codegen=backend,
        root_module=model if isinstance(model, nn.Module) else None,
        strict=True,
        diagnose_balance=True,
        plan_only=True,
    )
    torch_compile_kwargs.setdefault("fullgraph", True)
    # Static shapes, as compile's first call plans them: every explain's frame shares
    # Dynamo's record of the shapes seen, and a second explain at other sizes would
    # plan a graph with symbolic sizes.
    torch_compile_kwargs.setdefault("dynamic", False)
    step = own_frame(model, "explain")
    compiled = torch.compile(step, backend=mirror_backend, **torch_compile_kwargs)
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


class _StrictPartitioner(MirrorPartitioner):
    """The planner as Inductor's partitioner, raising a planning error (explain)."""

    def __call__(self, gm: GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        return super().__call__(gm, joint_inputs, strict=True, **kwargs)


class _BeforeCodegen(Exception):
    """Raised where Inductor would generate code: the plan, if any, is made."""


def _stop_before_codegen(gm: GraphModule, example_inputs: Sequence[object], **kwargs: Any):
    raise _BeforeCodegen("planned; no code generated")


def _without_autograd(gm: GraphModule) -> Callable[..., Any]:
    """``gm`` run under ``no_grad``: no activation is kept for a backward that never runs
    (GPT-2's eager forward kept over 20 GB on a CPU). Outputs Dynamo traced as requiring
    grad come back as leaves that do, so a graph after a break traces as it would."""
    (outputs,) = (n.args[0] for n in gm.graph.nodes if n.op == "output")
    flat = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    wants_grad = [
        isinstance(n, torch.fx.Node)
        and getattr(n.meta.get("example_value"), "requires_grad", False)
        for n in flat
    ]

    def run(*args: Any) -> Any:
        with torch.no_grad():
            out = gm(*args)
        if not isinstance(out, (tuple, list)):
            return out.detach().requires_grad_() if wants_grad[0] else out
        return type(out)(
            o.detach().requires_grad_() if grad and isinstance(o, torch.Tensor) else o
            for o, grad in zip(out, wants_grad, strict=True)
        )

    return run


def _causes(exc: BaseException | None) -> Iterator[BaseException]:
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else "no message"


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {_first_line(exc)}"


MIN_CUT_NOW = "using PyTorch's min-cut partition for this graph instead"


def _warn_fallback(cause: str, now: str = MIN_CUT_NOW, stacklevel: int = 3) -> None:
    warnings.warn(f"mirrorgrad: {cause}; {now}", MirrorgradFallbackWarning, stacklevel=stacklevel)


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
    surface only when the generated code runs (a conv-augmented attention encoder's
    attention layout did). The first call that raises
    inside the planned code is run again by ``min_cut()``'s graph (PyTorch's own
    partition, compiled then), and every later call goes there too.

    Re-running the call is sound because a forward that raised returned nothing and
    queued no backward, and because its only other effects are undone first: the RNG
    state (restored, so dropout draws what it would have drawn) and the inputs the
    graph mutates (BatchNorm statistics: copies taken before the first call). Anything
    else the compiled forward wrote to (outside its inputs) is assumed not to exist.
    Running out of memory is raised, not fallen back from: min-cut saves more.

    A planned backward that failed on its first call (``BackwardGuard``) sets
    ``backward_failed``: the next call, and every later one, goes to min-cut's graph
    (its forward saves what its own backward reads).
    """

    def __init__(
        self,
        planned: Callable[..., Any],
        min_cut: Callable[[], Callable[..., Any]],
        mutated_inputs: Sequence[int] | None,
        backward_failed: _BackwardFailed,
    ) -> None:
        self.planned = planned
        self.min_cut = min_cut
        self.mutated_inputs = mutated_inputs  # None: unknown, every non-grad tensor
        self.backward_failed = backward_failed
        self.verified = False
        self.fallback: Callable[..., Any] | None = None

    def __call__(self, *args: Any) -> Any:
        if self.fallback is None and self.backward_failed.cause is not None:
            self.fallback = self.min_cut()  # warned when the backward failed
        if self.fallback is not None:
            return self.fallback(*args)
        if self.verified:
            return self.planned(*args)
        # A list argument (compiled autograd's boxed inputs) is emptied by the call.
        kept = [list(a) if isinstance(a, list) else a for a in args]
        undo = _UndoLog.before(args, self.mutated_inputs)
        try:
            out = self.planned(*args)
        except torch.OutOfMemoryError:
            raise  # not a plan the code generator cannot handle: min-cut saves more
        except Exception as exc:
            # Outside this block the failed call's frames (and their buffers) are freed.
            cause = f"the plan's compiled forward failed on its first call ({_describe(exc)})"
        else:
            self.verified = True
            return out
        undo.restore()
        self.fallback = self.min_cut()
        _warn_fallback(cause)
        return self.fallback(*kept)

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


@dataclass(slots=True)
class _BackwardFailed:
    """Set by a planned backward whose first call failed; read by its forward's guard."""

    cause: str | None = None  # a description: an exception would keep its frames alive

    def record(self, cause: str) -> None:
        self.cause = cause


def _compile_guarding_the_backward(
    gm: GraphModule,
    example_inputs: Sequence[object],
    *,
    guarded: Callable[[], bool],
    on_failure: Callable[[str], None],
    parameters: Callable[[], list[torch.Tensor]] = list,
    room: Room | None = None,
    **kwargs: Any,
) -> Any:
    """Inductor's inner compile; a planned backward comes back inside a ``BackwardGuard``.

    ``guarded()`` is asked when the backward compiles, after partitioning: whether the
    graph is ours (a plan was applied) rather than min-cut's. ``parameters()``: the
    model's, which the guard need not copy; ``room``: how much of the copies may go on
    the device (``safety_copies.device_room``)."""
    if not kwargs.get("is_backward") or not guarded():
        return _compat.compile_fx_inner(gm, example_inputs, **kwargs)
    # Inductor's post-grad passes rewrite gm in place: keep the graph as partitioned (a
    # module is made of it only if the compiled backward fails: that costs a codegen).
    as_partitioned = PartitionedGraph.of(gm)
    compiled = _compat.compile_fx_inner(gm, example_inputs, **kwargs)
    return BackwardGuard(compiled, as_partitioned, on_failure, parameters, room)


@dataclass(slots=True)
class PartitionedGraph:
    """A copy of a backward graph as partitioned, and the attributes it reads."""

    graph: torch.fx.Graph
    attributes: dict[str, Any]

    @classmethod
    def of(cls, gm: GraphModule) -> PartitionedGraph:
        targets = {n.target for n in gm.graph.find_nodes(op="get_attr")}
        return cls(copy.deepcopy(gm.graph), {t: _attribute(gm, t) for t in targets})

    def module(self) -> GraphModule:
        return GraphModule(self.attributes, self.graph)

    def read_inputs(self) -> list[bool]:
        """Per input, whether the graph reads it."""
        return [bool(n.users) for n in self.graph.find_nodes(op="placeholder")]


def _attribute(module: nn.Module, target: str) -> Any:
    for name in target.split("."):
        module = getattr(module, name)
    return module


class BackwardGuard:
    """A planned graph's compiled backward, and what to do if its first call fails.

    By the time the backward runs, the forward has run with the plan's saved values, so
    min-cut's backward (another saved set) cannot take over. The first call that raises
    is run again by the *same* backward graph without Inductor (``EagerBackward``: the
    same inputs, so the same gradients), with one ``MirrorgradFallbackWarning``, and
    ``on_failure`` tells the forward's guard to use min-cut's graph from its next call.
    A backward of a forward that ran before then (gradient accumulation) runs eagerly.

    The compiled code frees its inputs as it goes and may write into saved values it
    was donated, so copies of them are taken before the first call (``SafetyCopies``:
    on the device as far as ``room`` allows, else in host memory) and
    dropped when it returns; values on the storage of a parameter of the model
    (``parameters()``), which the model keeps alive and the backward never writes
    (AOTAutograd donates no saved value that aliases an input), are kept as they are. A
    failure after a first call that succeeded is raised: that code has run, so it is
    no plan the code generator could not handle, and there are no copies to run again
    from; so is running out of memory (the eager graph holds more).

    Under CUDA Graph trees (``mode="reduce-overhead"``) the compiled backward's first
    call is the trees' warm-up run, which executes the same generated kernels outside a
    graph: a failure there is caught, and the eager run allocates outside the trees'
    pool. Compiled autograd traces the backward graph itself and never calls this.
    """

    def __init__(
        self,
        compiled: Callable[[list[Any]], Any],
        graph: PartitionedGraph,
        on_failure: Callable[[str], None],
        parameters: Callable[[], list[torch.Tensor]] = list,
        room: Room | None = None,
    ) -> None:
        self.compiled = compiled
        self.graph = graph
        self.on_failure = on_failure
        self.parameters = parameters
        self.room = room if room is not None else device_room(lambda: None)
        self.verified = False
        self.eager: EagerBackward | None = None
        # AOTAutograd passes the inputs as one list, which the call empties. An instance
        # attribute: Dynamo's disable() wrapper copies the instance's __dict__ only.
        self._boxed_call = True

    def __call__(self, args: list[Any]) -> Any:
        if self.eager is not None:
            return self.eager.boxed_run(args)
        if self.verified:
            return self.compiled(args)
        copies = self._copies(args)
        try:
            out = self.compiled(args)
        except torch.OutOfMemoryError:
            copies.release()
            raise  # not a plan the code generator cannot handle: eager holds more
        except Exception as exc:
            # Outside this block the failed call's frames (and their buffers) are freed.
            cause = f"the plan's compiled backward failed on its first call ({_describe(exc)})"
        else:
            copies.release()  # before the step goes on: they may hold GBs
            self.verified = True
            return out
        args.clear()
        self.eager = EagerBackward(self.graph.module())
        inputs = copies.restore()
        copies.release()
        out = self.eager.boxed_run(inputs)
        self.on_failure(cause)
        _warn_fallback(
            cause,
            "this backward ran the plan's backward graph without Inductor (the same saved "
            f"values, so the same gradients); from its next call, {MIN_CUT_NOW}",
            stacklevel=2,
        )
        return out

    def _copies(self, args: list[Any]) -> SafetyCopies:
        """Copies of what the eager graph reads but for the parameters' storages."""
        # Storages alive now (the parameters hold them): no other tensor is at their address.
        kept = {_storage_address(p) for p in self.parameters()} - {None, 0}
        keep = [isinstance(a, torch.Tensor) and _storage_address(a) in kept for a in args]
        return SafetyCopies.of(args, keep=keep, needed=self.graph.read_inputs(), room=self.room)

    def __getattr__(self, name: str) -> Any:
        # What AOTAutograd reads off the compiled backward (compile times, cache keys).
        if name == "compiled":
            raise AttributeError(name)
        return getattr(self.compiled, name)


def _storage_address(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without a storage
        return None


class EagerBackward(torch.fx.Interpreter):
    """A backward graph run op by op on PyTorch's own kernels.

    Inductor's seeded draws (``inductor_random``: a dropout mask recomputed from the
    forward's seed) are the exception: their eager kernel ignores the seed, so each is
    compiled alone by Inductor, whose draw depends only on the seed and the element's
    position: the mask the forward's generated code drew."""

    def __init__(self, graph: GraphModule) -> None:
        super().__init__(graph)
        self.draws: dict[str, Callable[..., Any]] = {}

    def call_function(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if target not in _compat.inductor_seeded_random_ops():
            return super().call_function(target, args, kwargs)
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        key = repr(
            (target, [_signature(a) for a in args], {k: _signature(v) for k, v in kwargs.items()})
        )
        if key not in self.draws:
            devices = sorted({t.device.index or 0 for t in tensors if t.is_cuda})
            with torch.random.fork_rng(devices=devices):  # compiling draws nothing
                self.draws[key] = _compile_alone(target, args, kwargs)
        return self.draws[key](*tensors)[0]


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.device, tuple(value.shape))
    return value


def _compile_alone(
    target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Callable[..., Any]:
    """``target(*args, **kwargs)`` compiled by Inductor, its tensor arguments as inputs."""
    graph = torch.fx.Graph()
    inputs: list[torch.Tensor] = []

    def lift(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        inputs.append(value)
        return graph.placeholder(f"input_{len(inputs)}")

    node = graph.call_function(
        target, tuple(lift(a) for a in args), {k: lift(v) for k, v in kwargs.items()}
    )
    graph.output((node,))
    return _compat.compile_fx(GraphModule({}, graph), inputs)


def own_frame(model: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``model(*args)`` through a function ``name`` with a code object of its own.

    Dynamo keeps compiled code per code object, at most ``recompile_limit`` (8) entries
    each, and a new backend makes a new entry: compiling ``model`` itself at every
    `explain` or every `mirrorgrad train` run in one process (a notebook, a sweep) would
    add an entry to its class's ``forward`` each time, and the ninth would run eagerly.
    Entries on a fresh code object die with it.
    """

    def run(*args: Any) -> Any:
        return model(*args)

    code = run.__code__.replace(co_name=name)
    return types.FunctionType(code, run.__globals__, name, None, run.__closure__)


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
