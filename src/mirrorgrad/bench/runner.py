"""Measure methods on one workload, in this process: the worker behind `mirrorgrad bench`.

`mirrorgrad bench` starts ``python -m mirrorgrad.bench.runner`` once per workload, so
every workload starts with fresh allocator state.
Inside, methods run one after another on a freshly built, identically seeded model,
with the allocator emptied and its peak reset between them. Each result is printed
as one ``@@mirrorgrad {json}`` line on stdout as soon as it is known.

A step is ``zero_grad(set_to_none) -> loss = step_fn(*batch) -> backward -> SGD``; SGD
without momentum keeps no optimizer state, so the measured peak is parameters,
gradients and activations: what the planner estimates.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import math
import os
import platform
import sys
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mirrorgrad import _compat
from mirrorgrad._cuda_graphs import capture
from mirrorgrad._timing import synchronize, time_calls
from mirrorgrad.bench.gradients import GradCheck
from mirrorgrad.bench.methods import Backend, Method, StepFn
from mirrorgrad.bench.suites import get_method, get_workload
from mirrorgrad.bench.workloads import Built, Workload
from mirrorgrad.nn import dispatch_as_captured

MARKER = "@@mirrorgrad "
# Exit code after a method left the CUDA context unusable (its result was reported).
FATAL_EXIT = 3
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(kw_only=True, slots=True)
class RunOptions:
    dtype: str = "fp32"
    steps: int = 20
    warmup: int = 3
    quick: bool = False
    backend: Backend = "inductor"
    device: str = "cpu"
    batch: int | None = None
    # Unix time after which methods not yet started are skipped.
    deadline: float | None = None
    # Where a kernel-time profile of a few steps goes, one file per method (None: none).
    profile_dir: Path | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.steps < 1 or self.warmup < 1:
            raise ValueError("steps and warmup must be >= 1 (the first warm-up step compiles)")


@dataclass(kw_only=True, slots=True)
class MethodResult:
    workload: str
    method: str
    status: str  # "ok" | "failed" | "skipped"
    error: str | None = None
    batch: int | None = None
    median_ms: float | None = None
    p20_ms: float | None = None
    p80_ms: float | None = None
    samples_per_s: float | None = None
    # First call (compiles, if the method compiles), and that minus a median step.
    first_step_s: float | None = None
    compile_s: float | None = None
    peak_bytes: int | None = None
    # "cuda": torch.cuda.max_memory_allocated over the timed steps; "cpu-estimate":
    # parameters + gradients + tensors saved for backward (no allocator on the CPU).
    peak_source: str | None = None
    # The planner's estimated peak of the plan the method uses (mirror-* only).
    est_peak_bytes: int | None = None
    est_peak_unmirrored_bytes: int | None = None
    est_graphs: int = 0  # compiled graphs planned (graph breaks make more than one)
    est_error: str | None = None
    # mirror-balance: whether the plan reaches balance's target, and why not
    # (``BalanceTarget.to_dict``), worked out after the timed steps: compile skips it.
    balance_target: dict[str, Any] | None = None
    param_bytes: int | None = None
    first_loss: float | None = None
    step_ms: list[float] = field(default_factory=list)
    # Model FLOPs per step over the median step (workloads that declare their FLOPs).
    tflops: float | None = None
    tokens_per_s: float | None = None
    # mirrorgrad's MirrorgradFallbackWarning / MirrorgradBudgetWarning, first line.
    fallback: str | None = None
    budget_warning: str | None = None
    # First-step gradients against the workload's reference method (gradients.py).
    grad_error: float | None = None
    grad_worst: str | None = None
    grad_worst_error: float | None = None
    grads_ok: bool | None = None
    grad_note: str | None = None
    # mirrorgrad.nn methods: what impl="auto" ran, per RNN call shape, with the ms each
    # candidate took ("persistent (cudnn 1.41, persistent 1.30, triton 1.79)").
    auto_picks: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def environment(device: str) -> dict[str, Any]:
    """Versions and hardware, recorded with every result file."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": device,
        "host": platform.node(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        env["gpu"] = props.name
        env["gpu_memory_bytes"] = props.total_memory
        env["capability"] = f"{props.major}.{props.minor}"
        env["cudnn"] = torch.backends.cudnn.version()
        env["peak_tflops"] = dense_peak_tflops(props.name)
    else:
        env["gpu"] = None
    return env


# Dense tensor-core peaks (TFLOP/s) from the vendor's data sheets, by a substring of the
# device name: fp32 is TF32 (the suite runs fp32 GEMMs in TF32), bf16 without sparsity.
_DENSE_PEAKS = {
    "H200": {"fp32": 494.7, "bf16": 989.4},
    "H100 PCIe": {"fp32": 378.0, "bf16": 756.0},
    "H100": {"fp32": 494.7, "bf16": 989.4},
    "A100": {"fp32": 156.0, "bf16": 312.0},
}


def dense_peak_tflops(gpu_name: str) -> dict[str, float] | None:
    """The device's dense peak per dtype, or None for a device not in the table."""
    for key, peaks in _DENSE_PEAKS.items():
        if key in gpu_name:
            return peaks
    return None


def _fresh_allocator(device: str) -> None:
    torch.compiler.reset()
    graphs = sys.modules.get("mirrorgrad.ops.rnn.cuda_graphs")
    if graphs is not None:  # captured RNN step loops hold static buffers
        graphs.clear_graphs()
    gc.collect()
    if device.startswith("cuda"):
        # Each method pays for the cuBLAS workspaces of its own streams and threads (the
        # RNN loops' capture stream adds one per thread), not for an earlier method's.
        _compat.clear_cublas_workspaces()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


class SavedStorageBytes:
    """Bytes of the distinct storages autograd saves for backward, those of ``existing``
    (parameters, inputs) excluded: a stash measured on the CPU, which has no allocator to
    ask. ``pack`` is the saved-tensors hook."""

    def __init__(self, existing: Iterable[torch.Tensor]) -> None:
        self._existing = {t.untyped_storage().data_ptr() for t in existing}
        self._seen: dict[int, int] = {}

    @torch.compiler.disable  # a Python hook, not part of the model's graph
    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._existing:
            self._seen[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self._seen.values())


def _make_step(step_fn: StepFn, model: torch.nn.Module, batch: tuple, workload: Workload) -> Any:
    """zero_grad -> loss -> backward -> (clip) -> SGD, as the workload asks."""
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=workload.lr) if workload.update else None

    def step() -> torch.Tensor:
        for p in params:
            p.grad = None
        loss = step_fn(*batch)
        loss.backward()
        if workload.clip is not None:
            torch.nn.utils.clip_grad_norm_(params, workload.clip)
        if opt is not None:
            opt.step()
        return loss

    return step


def _graphed(step: Any, device: str) -> Any:
    """``step`` captured whole in one CUDA Graph on its first call, replayed after.

    Its eager warm-ups build kernels and fill caches (``impl="auto"`` times its
    candidates captured, as this step runs); the peak is reset before the recording, so
    the first call's peak is the graph's (what its replays use), not the warm-ups'."""
    captured: list[Any] = []

    def replay() -> torch.Tensor:
        if not captured:
            reset_peak = functools.partial(torch.cuda.reset_peak_memory_stats, device)
            captured.append(capture(step, warm_up_context=dispatch_as_captured,
                                    before_capture=reset_peak))  # fmt: skip
        graph, loss = captured[0]
        graph.replay()
        return loss

    return replay


def _auto_picks(*, captured: bool) -> list[str]:
    """impl="auto"'s choices timed as the method runs (captured or not), each with the
    candidates' ms."""
    from mirrorgrad.ops.rnn.dispatch import auto_choices

    picks = []
    for row in auto_choices():
        if row["captured"] == captured:
            times = ", ".join(f"{name} {ms:.2f}" for name, ms in sorted(row["times"].items()))
            picks.append(f"{row['choice']} ({times})" if times else row["choice"])
    return picks


def _cpu_peak(step: Any, model: torch.nn.Module) -> int:
    saved = SavedStorageBytes(model.parameters())
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        step()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return params + grads + saved.total


def _planner_estimate(
    method: Method, step_fn: StepFn, built: Built, batch: tuple
) -> tuple[int | None, int | None, int]:
    """(estimated step peak with the method's plan, without mirroring, graphs planned).

    Uses the plans the compiled model applied; where none was made (a cache served
    the graphs), asks ``mirrorgrad.explain`` for the same options. With
    graph breaks each graph has its own plan: the one with the largest peak is shown.
    """
    if method.mirror_options is None:
        return None, None, 0
    plans = list(getattr(step_fn, "_mirrorgrad_plans", None) or [])
    if not plans:
        import mirrorgrad

        plans = [mirrorgrad.explain(built.model, *batch, fullgraph=False, **method.mirror_options)]
    largest = max(plans, key=lambda p: p.peak_before)
    # What the step holds outside the graph (BLAS workspaces, the RNN op's graph cache)
    # is measured too: the same estimate peak_compare and the budget warning use.
    held = sum(largest.held.values())
    return int(largest.step_peak), int(largest.peak_before + held), len(plans)


def _balance_target(
    method: Method, built: Built, batch: tuple, backend: Backend
) -> dict[str, Any] | None:
    """Whether balance's plan reaches its target, and why not (mirror-balance only):
    ``mirrorgrad.explain`` traces and plans the step again to diagnose it, which a
    compiled step skips to keep its cold compile short. With graph breaks, the largest
    graph's plan, as ``_planner_estimate``."""
    options = method.mirror_options
    if options is None or options.get("mode", "balance") != "balance":
        return None
    import mirrorgrad

    p = mirrorgrad.explain(built.model, *batch, fullgraph=False, backend=backend, **options)
    return p.balance_target.to_dict() if p.balance_target is not None else None


def _short_error(e: BaseException) -> str:
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    text = lines[0] if lines else ""
    return f"{type(e).__name__}: {text}"[:300]


def _is_fatal(e: BaseException) -> bool:
    # After these the CUDA context is unusable: later methods need a new process.
    text = str(e)
    return "CUDA error" in text or "illegal memory access" in text or "CUBLAS_STATUS" in text


def _skip_reason(workload: Workload, method: Method, opts: RunOptions) -> str | None:
    if method.swap_rnn and not workload.recurrent:
        return "no torch.nn RNN modules to swap"
    if method.cuda_graph and not opts.device.startswith("cuda"):
        return "needs CUDA (the step is captured in a CUDA Graph)"
    if opts.deadline is not None and time.time() > opts.deadline:
        return "time limit reached before this method"
    missing = workload.missing_packages()
    if missing:
        return f"not installed: {', '.join(missing)}"
    return None


def _prepare(
    workload: Workload, method: Method, opts: RunOptions, result: MethodResult
) -> tuple[Built, tuple, StepFn, Any]:
    """Build the model and batch, wrap them by the method: (built, batch, step_fn, step)."""
    built = workload.build(
        batch=opts.batch, dtype=DTYPES[opts.dtype], device=opts.device, quick=opts.quick
    )
    if method.rebuild is not None:
        built.model = method.rebuild(built.model)
    result.batch = built.batch
    result.param_bytes = sum(p.numel() * p.element_size() for p in built.model.parameters())
    batch = built.make_batch()
    if method.make_step is not None:
        step_fn = built.model
        step = method.make_step(built.model, batch, opts.backend)
    else:
        step_fn = method.prepare(built.model, blocks=built.blocks, backend=opts.backend)
        step = _make_step(step_fn, built.model, batch, workload)
    if method.cuda_graph:
        step = _graphed(step, opts.device)
    return built, batch, step_fn, step


def _first_steps(step: Any, opts: RunOptions, result: MethodResult, after_first: Any) -> int:
    """The first call (timed alone: it compiles, or captures a CUDA Graph),
    ``after_first()``, the other warm-ups; returns the first call's peak (CUDA, else 0)."""
    cuda = opts.device.startswith("cuda")
    synchronize(opts.device)
    t0 = time.perf_counter()
    result.first_loss = step().detach().item()
    synchronize(opts.device)
    result.first_step_s = time.perf_counter() - t0
    first_peak = torch.cuda.max_memory_allocated(opts.device) if cuda else 0
    after_first()
    # The peak counts from here: the warm-ups after the compiling call and the timed
    # steps (the gradient check's copies and a compiler's autotuning are left out).
    if cuda:
        torch.cuda.reset_peak_memory_stats(opts.device)
    for _ in range(opts.warmup - 1):
        step()
    synchronize(opts.device)
    return first_peak


def _timed_steps(
    step: Any,
    workload: Workload,
    built: Built,
    opts: RunOptions,
    result: MethodResult,
    floor_bytes: int = 0,
) -> None:
    """Time ``opts.steps`` steps; the peak is theirs, or ``floor_bytes`` if larger."""
    device = opts.device
    timing = time_calls(step, repeats=opts.steps, device=device)
    if device.startswith("cuda"):
        result.peak_bytes = max(floor_bytes, torch.cuda.max_memory_allocated(device))
        result.peak_source = "cuda"
    else:
        result.peak_bytes = _cpu_peak(step, built.model)
        result.peak_source = "cpu-estimate"
    result.step_ms = [round(t, 4) for t in timing.samples_ms]
    result.median_ms, result.p20_ms = timing.median_ms, timing.p20_ms
    result.p80_ms = timing.p80_ms
    result.samples_per_s = built.batch / (timing.median_ms / 1e3)
    if built.flops is not None:
        result.tflops = built.flops / (timing.median_ms / 1e3) / 1e12
    if workload.tokens_per_sample is not None:
        result.tokens_per_s = result.samples_per_s * workload.tokens_per_sample(opts.quick)


def _profile(step: Any, opts: RunOptions, path: Path, steps: int = 5) -> None:
    """Device (or CPU) time per kernel over ``steps`` steps, as torch.profiler tables it."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    sort = "cpu_time_total"
    if opts.device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        sort = "cuda_time_total"
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        synchronize(opts.device)
    table = prof.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=60)
    path.write_text(f"{steps} steps of {path.stem}\n{table}\n")


def measure(
    workload: Workload, method: Method, opts: RunOptions, grads: GradCheck | None = None
) -> MethodResult:
    """Run warm-up and timed steps of ``method`` on ``workload``; never raises on
    a method failure (OOM, compile error): the result says ``failed`` and why."""
    result = MethodResult(workload=workload.name, method=method.name, status="ok")
    skip = _skip_reason(workload, method, opts)
    if skip is not None:
        result.status, result.error = "skipped", skip
        return result
    _fresh_allocator(opts.device)
    built = batch = step_fn = step = None
    with _mirrorgrad_warnings(result):
        try:
            built, batch, step_fn, step = _prepare(workload, method, opts, result)

            def check_gradients() -> None:
                if grads is not None:
                    for key, value in grads.check(method.name, built.model).items():
                        setattr(result, key, value)

            first_peak = _first_steps(step, opts, result, check_gradients)
            # A CUDA Graph allocates while it records (the first call) and never in its
            # replays: its peak is the recording's, in the graph's own memory pool.
            floor = first_peak if method.cuda_graph else 0
            _timed_steps(step, workload, built, opts, result, floor)
            if method.swap_rnn:
                result.auto_picks = _auto_picks(captured=method.cuda_graph)
            if opts.profile_dir is not None:
                _profile(step, opts, opts.profile_dir / f"{workload.name}.{method.name}.txt")
            if method.compiles:
                result.compile_s = max(0.0, result.first_step_s - result.median_ms / 1e3)
        except Exception as e:  # a failing method is a result, not the end of the run
            result.status, result.error = "failed", _short_error(e)
            if _is_fatal(e):
                _emit({"kind": "result", **result.to_dict()})
                # Exit now: any cleanup would touch the broken context and fail again.
                os._exit(FATAL_EXIT)
        else:
            try:
                (
                    result.est_peak_bytes,
                    result.est_peak_unmirrored_bytes,
                    result.est_graphs,
                ) = _planner_estimate(method, step_fn, built, batch)
            except Exception as e:  # the measurement stands without the estimate
                result.est_error = _short_error(e)
            try:
                result.balance_target = _balance_target(method, built, batch, opts.backend)
            except Exception as e:  # a report only
                result.balance_target = {"error": _short_error(e)}
        finally:
            built = batch = step_fn = step = None
            _fresh_allocator(opts.device)
    return result


# mirrorgrad's warnings, by class name -> the result field that records the first one.
_WARNING_FIELDS = {
    "MirrorgradFallbackWarning": "fallback",
    "MirrorgradBudgetWarning": "budget_warning",
}


@contextlib.contextmanager
def _mirrorgrad_warnings(result: MethodResult) -> Iterator[None]:
    """Records mirrorgrad's fallback and budget warnings on the result; others pass on."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        for w in caught:
            field_name = _WARNING_FIELDS.get(type(w.message).__name__)
            if field_name is None:
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
            elif getattr(result, field_name) is None:
                setattr(result, field_name, _short_error(w.message).split(": ", 1)[1])


def _emit(record: dict[str, Any]) -> None:
    print(MARKER + json.dumps(_finite(record), allow_nan=False), flush=True)


def _finite(value: Any) -> Any:
    """NaN and infinity (a diverged loss) as null: strict JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def default_device(quick: bool) -> str:
    return "cuda" if torch.cuda.is_available() and not quick else "cpu"


def check_device(device: str) -> None:
    """A ValueError naming ``--device`` unless it is the CPU or a GPU torch sees here."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r}: choose cpu, cuda or cuda:N")
    if parsed.type == "cpu":
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(
            f"--device {device}: torch sees no CUDA GPU; use --device cpu (or --quick)"
        )
    if parsed.index is not None and parsed.index >= count:
        raise ValueError(
            f"--device {device}: torch sees {count} GPU(s), cuda:0 to cuda:{count - 1}"
        )


def worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", required=True)
    parser.add_argument("--methods", required=True, help="comma-separated method names")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--backend", choices=["inductor", "eager"], default="inductor")
    parser.add_argument("--device", default=None)
    parser.add_argument("--deadline", type=float, default=None)
    parser.add_argument("--grads-file", type=Path, default=None,
                        help="compare gradients with the reference's")
    parser.add_argument("--profile-dir", type=Path, default=None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="mirrorgrad bench worker (one workload)")
    worker_arguments(parser)
    args = parser.parse_args(argv)
    device = args.device or default_device(args.quick)
    if device.startswith("cuda"):
        # Same for every method; TF32 GEMMs are what anyone training in fp32 would use.
        torch.set_float32_matmul_precision("high")
    given = ("dtype", "steps", "warmup", "quick", "backend", "deadline", "profile_dir")
    opts = RunOptions(device=device, **{name: getattr(args, name) for name in given})
    workload = get_workload(args.workload)
    methods = [get_method(name) for name in args.methods.split(",") if name]
    grads = None
    if args.grads_file is not None and workload.grad_reference is not None:
        grads = GradCheck(workload.grad_reference, args.grads_file, args.dtype)
    _emit({"kind": "env", **environment(device)})
    with contextlib.ExitStack() as stack:
        if any(m.compiles for m in methods):
            from mirrorgrad import _compat

            # Every compile then partitions (so mirror methods have their plans), and
            # with warm Inductor caches every method's compile time counts the same
            # stages: mirrorgrad.compile turns this cache off for its own compiles.
            stack.enter_context(_compat.without_autograd_cache())
        for method in methods:
            _emit({"kind": "result", **measure(workload, method, opts, grads).to_dict()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
