"""Balance's target on a GPU: what the plan says, and the plan it names, measured (a GPU
measurement: run by hand, not collected by pytest).

    PYTHONPATH=src python tests/mirror/balance_target_gpu.py [--workloads gpt2 resnet50]

Per workload: balance's ``balance_target`` reason (estimated on this GPU's graph), then
torch.compile, balance, and budget mode asked for the target's peak in bytes (the plan
a miss names), each measured by the bench runner: median step and peak against
torch.compile's. Says whether the plan a reason names keeps its promise on the device.
"""

from __future__ import annotations

import argparse
import json

import torch

import mirrorgrad
from mirrorgrad._units import format_bytes
from mirrorgrad.bench.methods import Method
from mirrorgrad.bench.runner import RunOptions, measure
from mirrorgrad.bench.suites import get_method, get_workload


def _target(workload: str, opts: RunOptions):
    built = get_workload(workload).build(device=opts.device, quick=opts.quick)
    plan = mirrorgrad.explain(built.model, *built.make_batch(), mode="balance")
    del built
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return plan.balance_target


def _budget_method(budget: int) -> Method:
    """Budget mode asked for ``budget`` bytes of peak."""
    options = {"mode": "budget", "budget": budget}

    def wrap(model, blocks, backend):
        return mirrorgrad.compile(model, backend=backend, **options)

    name = f"mirror-budget-{format_bytes(budget).replace(' ', '')}"
    return Method(name=name, wrap=wrap, compiles=True, description="the plan the reason names",
                  mirror_options=options)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workloads", nargs="+", default=["gpt2", "resnet50", "transformer"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a CPU smoke run)")
    args = parser.parse_args()
    opts = RunOptions(device=args.device, steps=args.steps, quick=args.quick)
    for name in args.workloads:
        target = _target(name, opts)
        print(f"{name}: {target.reason()}", flush=True)
        methods = [get_method("compile"), get_method("mirror-balance")]
        if target.status != "met":
            methods.append(_budget_method(int(target.target * target.reference_peak)))
        workload = get_workload(name)
        results = [measure(workload, m, opts) for m in methods]
        base = results[0]
        for r in results:
            row = {"method": r.method, "status": r.status, "median_ms": r.median_ms,
                   "peak_mib": (r.peak_bytes or 0) / 2**20, "error": r.error}  # fmt: skip
            if r.status == "ok" and base.status == "ok":
                row["time_vs_compile"] = r.median_ms / base.median_ms
                row["peak_vs_compile"] = r.peak_bytes / base.peak_bytes
            print(json.dumps(row), flush=True)
        print(json.dumps({"workload": name, "target": target.to_dict()}), flush=True)


if __name__ == "__main__":
    main()
