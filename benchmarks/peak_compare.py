"""What is alive at the measured peak of one training step, against the planner's estimate.

``python benchmarks/peak_compare.py --out DIR`` runs, per workload and plan, one
step under ``mirrorgrad.compile`` with the CUDA allocator's history recorded from
before the model is built, replays that history to the moment of the step's peak, and
sorts the blocks alive then by kind (parameters, gradients, optimizer state, inputs,
saved activations, temporaries, what was held from before the step: workspaces,
caches, CUDA Graph pools), each with the line of code that allocated it; the plan's
own estimate (``Plan.floor``: ``liveness.peak_breakdown``) is sorted the same way. It
prints one table per run and writes ``peak_compare.json``. Blocks are matched to
estimated values by size (the allocator rounds to 512 bytes), largest first, so what
the model misses shows by name on one side or the other.

Workloads: the suite's by name; ``NAME+mgnn`` with its RNN modules swapped for
``mirrorgrad.nn``'s (``mirrorgrad.nn.convert``); ``word-lm-medium-b20`` (any word-lm
workload) is the step ``mirrorgrad train lm`` runs (its model, compile and SGD step
with clipping, the state carried between windows), without CUDA Graphs as the train
loop's peak probe runs it.

Without CUDA (or with ``--quick``) it plans on the CPU and reports the estimate only.
The step is the bench runner's: zero_grad(set_to_none), forward, backward, SGD; the
"backward" mark is the optimizer's step pre-hook (gradient clipping counts as backward).
"""

from __future__ import annotations

import argparse
import bisect
import json
import linecache
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mirrorgrad.bench.runner import DTYPES, default_device
from mirrorgrad.bench.suites import WORKLOADS, get_workload

HELD = "held before the step"
# Comparison rows: (row, the liveness kinds estimated under it). The estimate's "op
# temporaries" (what ops declare beyond their values) go to the row of its peak's phase.
ROWS = (
    ("parameters", ("parameters",)),
    ("gradients", ("gradients",)),
    ("optimizer state", ()),
    ("inputs", ("inputs",)),
    ("saved activations", ("saved activations", "forward outputs")),
    ("forward temporaries", ("forward temporaries",)),
    ("backward temporaries", ("backward temporaries", "recomputed")),
    (HELD, ()),
)
MGNN = "+mgnn"
ROUND = 512  # the caching allocator's block granularity
TOP = 12  # values listed per side
_TORCH_DIR = str(Path(torch.__file__).parent)


def _estimate(plans: list) -> dict[str, Any]:
    """The estimated peak by row, and every value alive there, from the largest plan."""
    plan = max(plans, key=lambda p: p.peak_before)
    floor = plan.floor
    temporaries = f"{floor.phase} temporaries"
    row_of = {k: row for row, kinds in ROWS for k in kinds} | {"op temporaries": temporaries}
    by_row = {row: 0 for row, _ in ROWS}
    for kind, nbytes in floor.bytes_by_kind.items():
        by_row[row_of[kind]] += nbytes
    by_row[HELD] = sum(plan.held.values())  # the BLAS workspaces (graph/held.py)
    values = [
        {"name": n.name, "row": row_of[kind], "bytes": b} for n, kind, b in floor.values if b
    ]
    return {
        "peak": floor.peak + by_row[HELD],
        "phase": floor.phase,
        "node": floor.node,
        "by_row": by_row,
        "values": values,
        "peak_before": plan.peak_before,
        "budget_bytes": plan.budget_bytes,
        "budget_met": plan.budget_met,
        "op_memory": [str(c) for c in plan.op_memory],
        "graphs": len(plans),
    }


def _replay(
    snapshot: dict, device: int, start: int = 0
) -> tuple[int, int, dict[int, tuple[int, int]]]:
    """(peak bytes from trace position ``start`` on, its position, blocks alive then:
    addr -> (size, position of their allocation, -1 if before the recording))."""
    trace = snapshot["device_traces"][device]
    alive: dict[int, int] = {}
    for seg in snapshot["segments"]:
        if seg.get("device", device) != device:
            continue
        addr = seg["address"]
        for block in seg["blocks"]:
            if block["state"] == "active_allocated":
                alive[block.get("address", addr)] = block["size"]
            addr += block["size"]
    for e in reversed(trace):  # walk back from the end to the start of the recording
        if e["action"] == "alloc":
            alive.pop(e["addr"], None)
        elif e["action"] == "free_completed":
            alive[e["addr"]] = e["size"]
    blocks = {addr: (size, -1) for addr, size in alive.items()}
    current = sum(alive.values())
    peak, peak_at, peak_blocks = -1, -1, dict(blocks)
    for i, e in enumerate(trace):
        if i == start and current > peak:
            peak, peak_at, peak_blocks = current, i - 1, dict(blocks)
        if e["action"] == "alloc":
            blocks[e["addr"]] = (e["size"], i)
            current += e["size"]
            if i >= start and current > peak:
                peak, peak_at, peak_blocks = current, i, dict(blocks)
        elif e["action"] == "free_completed" and e["addr"] in blocks:
            current -= blocks.pop(e["addr"])[0]
    if peak < 0:  # nothing recorded from ``start`` on
        peak, peak_at, peak_blocks = current, len(trace) - 1, dict(blocks)
    return peak, peak_at, peak_blocks


def _owner(blocks: dict[int, tuple[int, int]], pointers: dict[str, set[int]]) -> dict[int, str]:
    """Block address -> the row of a known tensor (parameter, gradient, ...) inside it."""
    starts = sorted(blocks)
    owner: dict[int, str] = {}
    for row, ptrs in pointers.items():
        for ptr in ptrs:
            k = bisect.bisect_right(starts, ptr) - 1
            if k >= 0 and ptr < starts[k] + blocks[starts[k]][0]:
                owner.setdefault(starts[k], row)
    return owner


def _source(entry: dict) -> str:
    """Where a block was allocated: the innermost frame outside torch itself (the
    generated Inductor code, or the model), with its line of code."""
    frames = entry.get("frames") or []
    frame = next((f for f in frames if not f["filename"].startswith(_TORCH_DIR)), None)
    frame = frame or (frames[0] if frames else None)
    if frame is None:
        return "?"
    code = linecache.getline(frame["filename"], frame["line"]).strip()[:90]
    return f"{Path(frame['filename']).name}:{frame['line']} {frame['name']}: {code}"


def _row_by_time(at: int, peak_at: int, marks: dict[str, int]) -> str:
    """The row of a block no known tensor owns, from when it was allocated."""
    if at < marks.get("step", 0):
        return HELD  # cuBLAS workspaces, caches, CUDA Graph pools, carried copies
    if at < marks["forward"]:
        return "saved activations" if peak_at >= marks["forward"] else "forward temporaries"
    if at < marks["backward"]:
        return "backward temporaries"
    return "optimizer state"


def _classify(snapshot, device, marks, pointers) -> dict[str, Any]:
    """The measured peak of the step (from ``marks["step"]``) by row, every block alive
    there with where it was allocated, and the bytes by allocating line."""
    peak, peak_at, blocks = _replay(snapshot, device, marks.get("step", 0))
    trace = snapshot["device_traces"][device]
    owner = _owner(blocks, pointers)
    by_row = {row: 0 for row, _ in ROWS}
    values, by_source = [], {}
    for addr, (size, at) in sorted(blocks.items(), key=lambda kv: -kv[1][0]):
        row = owner.get(addr) or _row_by_time(at, peak_at, marks)
        by_row[row] += size
        source = _source(trace[at]) if at >= 0 else "before the recording"
        values.append({"row": row, "bytes": size, "source": source})
        by_source[(row, source)] = by_source.get((row, source), 0) + size
    phase = "forward" if peak_at < marks["forward"] else "backward"
    if peak_at >= marks["backward"]:
        phase = "optimizer"
    sources = sorted(by_source.items(), key=lambda kv: -kv[1])
    return {
        "peak": peak,
        "phase": phase,
        "by_row": by_row,
        "values": values,
        "by_source": [{"row": r, "source": src, "bytes": b} for (r, src), b in sources],
    }


@dataclass(kw_only=True, slots=True)
class _Setup:
    """One workload under one plan, ready to step: ``step()`` runs a whole training step
    and calls ``marks`` at the end of the forward and of the backward."""

    model: nn.Module
    compiled: Any  # has ``_mirrorgrad_plans``
    step: Callable[[], None]
    optimizer: torch.optim.Optimizer
    inputs: list[torch.Tensor]  # the step's inputs as of its last call (carried state too)
    example: tuple  # the compiled model's arguments, for ``mirrorgrad.explain``


def _marked(fn: Callable[..., Any], inputs: list, mark: Callable[[str], None]):
    """``fn`` that records its tensor arguments in ``inputs`` and marks "forward" after."""

    def call(*args: Any) -> Any:
        flat = [t for a in args for t in (a if isinstance(a, (tuple, list)) else (a,))]
        inputs[:] = [t for t in flat if isinstance(t, torch.Tensor)]
        out = fn(*args)
        mark("forward")
        return out

    return call


def _setup(name: str, options: dict, args, device: str, mark: Callable[[str], None]) -> _Setup:
    """Build, swap (``+mgnn``) and compile one workload; word-lm ones as the train step."""
    import mirrorgrad
    import mirrorgrad.nn

    base = name.removesuffix(MGNN)
    built = get_workload(base).build(
        batch=args.batch, dtype=DTYPES[args.dtype], device=device, quick=args.quick
    )
    inputs: list[torch.Tensor] = []
    if base.startswith("word-lm-"):
        return _train_step_setup(built, options, device, inputs, mark)
    model = built.model
    if name.endswith(MGNN):
        model = mirrorgrad.nn.convert(model)
    compiled = mirrorgrad.compile(model, **options)
    forward = _marked(compiled, inputs, mark)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    optimizer.register_step_pre_hook(lambda *_: mark("backward"))
    batch = built.make_batch()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        forward(*batch).backward()
        optimizer.step()

    return _Setup(model=model, compiled=compiled, step=step, optimizer=optimizer,
                  inputs=inputs, example=batch)  # fmt: skip


def _train_step_setup(built, options: dict, device: str, inputs: list, mark) -> _Setup:
    """The step of ``mirrorgrad train lm`` (train.step), as its peak probe runs it."""
    from mirrorgrad.bench.word_lm import CLIP, LR, _to_train_model
    from mirrorgrad.options import MirrorOptions
    from mirrorgrad.train import step as train_step

    model = _to_train_model(built.model)
    mirror = MirrorOptions(**options)
    compiled = train_step.compile_for_training(
        model, mirror, torch.device(device), cuda_graphs=False
    )
    forward = _marked(compiled, inputs, mark)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    optimizer.register_step_pre_hook(lambda *_: mark("backward"))
    tokens, targets = built.make_batch()
    state = [model.initial_state(tokens.shape[1], device)]

    def step() -> None:
        _, _, state[0] = train_step.sgd_step(
            forward, model, optimizer, tokens, targets, state[0], clip=CLIP
        )

    return _Setup(model=model, compiled=compiled, step=step, optimizer=optimizer,
                  inputs=inputs, example=(tokens, targets, state[0]))  # fmt: skip


def _measure(setup: _Setup, device: str, marks: dict[str, int], mark) -> dict[str, Any]:
    """One recorded step after two warm-up steps; the measured breakdown at its peak.
    The allocator's history is being recorded (since before the build)."""
    from mirrorgrad import _compat

    setup.step(), setup.step()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    marks.clear()
    mark("step")
    setup.step()
    torch.cuda.synchronize(device)
    snapshot = _compat.memory_snapshot()
    model, opt = setup.model, setup.optimizer
    pointers: dict[str, set[int]] = {
        "parameters": {p.data_ptr() for p in model.parameters()},
        "gradients": {p.grad.data_ptr() for p in model.parameters() if p.grad is not None},
        "inputs": {t.data_ptr() for t in (*setup.inputs, *model.buffers())},
        "optimizer state": {
            t.data_ptr() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)
        },
    }
    index = torch.device(device).index or 0
    measured = _classify(snapshot, index, marks, pointers)
    measured["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
    return measured


def _match(measured: list[dict], estimated: list[dict]) -> tuple[list[dict], list[dict]]:
    """Pair measured blocks with estimated values of the same rounded size, largest
    first; return what stays unpaired on each side."""
    pool: dict[int, list[dict]] = {}
    for v in estimated:
        pool.setdefault(-(-v["bytes"] // ROUND) * ROUND, []).append(v)
    unmatched_measured = []
    for block in measured:
        candidates = pool.get(block["bytes"])
        if candidates:
            same_row = next((c for c in candidates if c["row"] == block["row"]), candidates[0])
            candidates.remove(same_row)
        else:
            unmatched_measured.append(block)
    unmatched_estimated = sorted(
        (v for vs in pool.values() for v in vs), key=lambda v: -v["bytes"]
    )
    return unmatched_measured, unmatched_estimated


def compare(workload_name: str, plan_text: str, args: argparse.Namespace) -> dict[str, Any]:
    """Plan (and, on CUDA, measure) one workload under one plan."""
    import mirrorgrad
    from mirrorgrad import _compat
    from mirrorgrad.bench.explain import parse_mode

    options = parse_mode(plan_text)
    device = args.device or default_device(args.quick)
    result: dict[str, Any] = {"workload": workload_name, "plan": plan_text, "device": device}
    cuda = device.startswith("cuda")
    index = torch.device(device).index or 0
    marks: dict[str, int] = {}

    def mark(name: str) -> None:
        if cuda and (name == "step" or "step" in marks):
            marks[name] = len(_compat.memory_snapshot()["device_traces"][index])

    if cuda:
        torch.set_float32_matmul_precision("high")
        _compat.record_memory_history(True)
    try:
        setup = _setup(workload_name, options, args, device, mark)
        if cuda:
            result["measured"] = _measure(setup, device, marks, mark)
            plans = setup.compiled._mirrorgrad_plans
        else:
            plans = [mirrorgrad.explain(setup.model, *setup.example, fullgraph=False, **options)]
    finally:
        if cuda:
            _compat.record_memory_history(False)
    result["estimated"] = _estimate(plans)
    if "measured" in result:
        missed, extra = _match(result["measured"]["values"], result["estimated"]["values"])
        result["measured_unmatched"], result["estimated_unmatched"] = missed[:TOP], extra[:TOP]
        result["measured"]["values"] = result["measured"]["values"][:TOP]
        result["measured"]["by_source"] = result["measured"]["by_source"][:TOP]
    result["estimated"]["values"] = result["estimated"]["values"][:TOP]
    return result


def table(result: dict[str, Any]) -> str:
    """The rows, measured against estimated, and the largest unmatched values."""
    est, meas = result["estimated"], result.get("measured")
    unit, mib = ("MiB", 2**20) if est["peak"] >= 2**26 else ("KiB", 2**10)
    lines = [f"{result['workload']} / {result['plan']} on {result['device']}"]
    lines.append(f"{'':22}{'measured ' + unit:>14}{'estimated ' + unit:>15}")
    for row, _ in ROWS:
        m = f"{meas['by_row'][row] / mib:,.0f}" if meas else "-"
        lines.append(f"{row:22}{m:>14}{est['by_row'][row] / mib:>15,.0f}")
    m = f"{meas['peak'] / mib:,.0f} ({meas['phase']})" if meas else "-"
    lines.append(f"{'peak':22}{m:>14}{est['peak'] / mib:>9,.0f} ({est['phase']}, {est['node']})")
    lines += [f"op memory: {c}" for c in est["op_memory"]]
    if est["budget_bytes"] is not None:  # within 5% of the budget, or a warning
        met = {True: "met", False: "declared unmet (warned)", None: "-"}[est["budget_met"]]
        # A budget bounds the graph's peak (README): what the step holds outside it is not asked.
        ratio = ""
        if meas:
            graph_peak = meas["peak"] - est["by_row"][HELD]
            ratio = f", measured less held / asked {graph_peak / est['budget_bytes']:.3f}"
        lines.append(f"budget asked: {est['budget_bytes'] / mib:,.0f} {unit}, {met}{ratio}")
    if meas:
        lines.append(f"max_memory_allocated: {meas['max_memory_allocated'] / mib:,.1f} {unit}")
        lines.append("measured at the peak, by allocating line:")
        lines += [
            f"  {v['bytes'] / mib:9,.1f}  {v['row']:20} {v['source']}"
            for v in meas["by_source"][:8]
        ]
        lines.append("measured, no estimated value of that size:")
        lines += [
            f"  {v['bytes'] / mib:9,.1f}  {v['row']:20} {v['source']}"
            for v in result["measured_unmatched"][:6]
        ]
        lines.append("estimated, no measured block of that size:")
        lines += [
            f"  {v['bytes'] / mib:9,.1f}  {v['row']:20} {v['name']}"
            for v in result["estimated_unmatched"][:6]
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for peak_compare.json")
    parser.add_argument("--workloads", default="transformer,resnet50")
    parser.add_argument("--plans", default="budget:0.5", help="comma-separated, as --mirror")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, on the CPU")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--device", default=None)
    args = parser.parse_args(argv)
    names = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in names if w.removesuffix(MGNN) not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}")
    results = []
    args.out.mkdir(parents=True, exist_ok=True)
    for name in names:
        for plan_text in (p for p in args.plans.split(",") if p):
            torch._dynamo.reset()
            results.append(compare(name, plan_text, args))
            (args.out / "peak_compare.json").write_text(json.dumps(results, indent=1))
            print(table(results[-1]), end="\n\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
