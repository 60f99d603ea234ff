"""What is alive at the measured peak of one training step, against the planner's estimate.

``python -m mirrorgrad.bench.peak_compare --out DIR`` runs, per workload and plan, one
step under ``mirrorgrad.compile`` with the CUDA allocator's history recorded, replays
that history to the moment of the peak, and sorts the blocks alive then by kind
(parameters, gradients, optimizer state, inputs, saved activations, temporaries,
workspace); the plan's own estimate (``Plan.floor``: ``liveness.peak_breakdown``) is
sorted the same way. It prints one table per run and writes ``peak_compare.json``.
Blocks are matched to estimated values by size (the allocator rounds to 512 bytes),
largest first, so what the model misses shows by name on one side or the other.

Without CUDA (or with ``--quick``) it plans on the CPU and reports the estimate only.
The step is the bench runner's: zero_grad(set_to_none), forward, backward, SGD.
"""

from __future__ import annotations

import argparse
import bisect
import json
import linecache
import sys
from pathlib import Path
from typing import Any

import torch

from mirrorgrad.bench.runner import DTYPES, default_device
from mirrorgrad.bench.suites import WORKLOADS, get_workload

# Comparison rows: (row, the liveness kinds estimated under it).
ROWS = (
    ("parameters", ("parameters",)),
    ("gradients", ("gradients",)),
    ("optimizer state", ()),
    ("inputs", ("inputs",)),
    ("saved activations", ("saved activations", "forward outputs")),
    ("forward temporaries", ("forward temporaries",)),
    ("backward temporaries", ("backward temporaries", "recomputed")),
    ("workspace", ("op temporaries",)),
)
ROUND = 512  # the caching allocator's block granularity
TOP = 12  # values listed per side
_TORCH_DIR = str(Path(torch.__file__).parent)


def _estimate(plans: list) -> dict[str, Any]:
    """The estimated peak by row, and every value alive there, from the largest plan."""
    plan = max(plans, key=lambda p: p.peak_before)
    floor = plan.floor
    by_row = {row: sum(floor.bytes_by_kind.get(k, 0) for k in kinds) for row, kinds in ROWS}
    row_of = {k: row for row, kinds in ROWS for k in kinds}
    values = [
        {"name": n.name, "row": row_of[kind], "bytes": b} for n, kind, b in floor.values if b
    ]
    return {
        "peak": floor.peak,
        "phase": floor.phase,
        "node": floor.node,
        "by_row": by_row,
        "values": values,
        "peak_before": plan.peak_before,
        "budget_bytes": plan.budget_bytes,
        "graphs": len(plans),
    }


def _replay(snapshot: dict, device: int) -> tuple[int, int, dict[int, tuple[int, int]]]:
    """(peak bytes, trace position of the peak, blocks alive then: addr -> (size, position
    of their allocation, -1 if before the recording))."""
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
    current = peak = sum(alive.values())
    peak_at, peak_blocks = -1, dict(blocks)
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            blocks[e["addr"]] = (e["size"], i)
            current += e["size"]
            if current > peak:
                peak, peak_at, peak_blocks = current, i, dict(blocks)
        elif e["action"] == "free_completed" and e["addr"] in blocks:
            current -= blocks.pop(e["addr"])[0]
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


def _classify(snapshot, device, marks, pointers) -> dict[str, Any]:
    """The measured peak by row, and every block alive there."""
    peak, peak_at, blocks = _replay(snapshot, device)
    trace = snapshot["device_traces"][device]
    owner = _owner(blocks, pointers)
    by_row = {row: 0 for row, _ in ROWS}
    values = []
    for addr, (size, at) in sorted(blocks.items(), key=lambda kv: -kv[1][0]):
        row = owner.get(addr)
        if row is None:
            if at < 0:
                row = "workspace"  # alive before the step: cuBLAS/cuDNN workspaces, caches
            elif at < marks["forward"]:
                row = "saved activations" if peak_at >= marks["forward"] else "forward temporaries"
            elif at < marks["backward"]:
                row = "backward temporaries"
            else:
                row = "optimizer state"
        by_row[row] += size
        source = _source(trace[at]) if at >= 0 else "before the step"
        values.append({"row": row, "bytes": size, "source": source})
    phase = "forward" if peak_at < marks["forward"] else "backward"
    if peak_at >= marks["backward"]:
        phase = "optimizer"
    return {"peak": peak, "phase": phase, "by_row": by_row, "values": values}


def _measure(built, compiled, device: str) -> dict[str, Any]:
    """One recorded step after two warm-up steps; the measured breakdown at its peak."""
    from mirrorgrad import _compat

    model, batch = built.model, built.make_batch()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    index = torch.device(device).index or 0
    marks: dict[str, int] = {}
    pointers: dict[str, set[int]] = {
        "parameters": {p.data_ptr() for p in model.parameters()},
        "inputs": {t.data_ptr() for t in (*batch, *model.buffers())},
    }

    def mark(name: str) -> None:
        if recording:
            marks[name] = len(_compat.memory_snapshot()["device_traces"][index])

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = compiled(*batch)
        mark("forward")
        loss.backward()
        mark("backward")
        pointers["gradients"] = {
            p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None
        }
        opt.step()

    recording = False
    step(), step()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    _compat.record_memory_history(True)
    recording = True
    try:
        step()
        torch.cuda.synchronize(device)
        snapshot = _compat.memory_snapshot()
    finally:
        _compat.record_memory_history(False)
    pointers["optimizer state"] = {
        t.data_ptr() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)
    }
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
    from mirrorgrad.bench.explain import parse_mode

    options = parse_mode(plan_text)
    device = args.device or default_device(args.quick)
    workload = get_workload(workload_name)
    built = workload.build(
        batch=args.batch, dtype=DTYPES[args.dtype], device=device, quick=args.quick
    )
    result: dict[str, Any] = {
        "workload": workload_name, "plan": plan_text, "device": device, "batch": built.batch
    }
    if device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")
        compiled = mirrorgrad.compile(built.model, **options)
        result["measured"] = _measure(built, compiled, device)
        plans = compiled._mirrorgrad_plans
    else:
        plans = [mirrorgrad.explain(built.model, *built.make_batch(), fullgraph=False, **options)]
    result["estimated"] = _estimate(plans)
    if "measured" in result:
        missed, extra = _match(result["measured"]["values"], result["estimated"]["values"])
        result["measured_unmatched"], result["estimated_unmatched"] = missed[:TOP], extra[:TOP]
        result["measured"]["values"] = result["measured"]["values"][:TOP]
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
    if meas:
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
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}")
    results = []
    for name in names:
        for plan_text in (p for p in args.plans.split(",") if p):
            torch._dynamo.reset()
            results.append(compare(name, plan_text, args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peak_compare.json").write_text(json.dumps(results, indent=1))
    print("\n\n".join(table(r) for r in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
