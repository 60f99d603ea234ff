"""Kernels per step and step time of torch.compile against mirrorgrad's balance, timed
in alternating rounds in one process (a GPU diagnostic: run by hand).

    PYTHONPATH=src python benchmarks/step_kernels.py [--workload resnet152] [--rounds 6]

Both methods are compiled first; then ``--rounds`` rounds of ``--steps`` steps each,
alternating the methods, so that drift of the host (a launch-bound step's clock) falls
on both alike. Per method: median and p20/p80 step time over all rounds, then one
profiled window of ``--profile-steps`` steps: GPU kernels per step, GPU busy time per
step, and the kernels whose count per step differs between the methods (by Inductor's
fused name, its trailing index dropped), the largest differences first.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections import Counter

import torch

from mirrorgrad._timing import synchronize
from mirrorgrad.bench.runner import MethodResult, RunOptions, _prepare
from mirrorgrad.bench.suites import get_method, get_workload

# A Triton kernel's name ends in an index Inductor gives per graph (``..._relu_39``).
KERNEL_INDEX = re.compile(r"_\d+$")


def kernel_census(step, steps: int, device: str) -> tuple[Counter, float]:
    """Per kernel name (index dropped): launches per step; and GPU ms per step."""
    activity = torch.profiler.ProfilerActivity
    kinds = [activity.CPU] + ([activity.CUDA] if device.startswith("cuda") else [])
    with torch.profiler.profile(activities=kinds) as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    launches: Counter = Counter()
    busy_us = 0.0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            launches[KERNEL_INDEX.sub("", event.name)[:90]] += 1
            busy_us += event.time_range.elapsed_us()
    return Counter({k: v / steps for k, v in launches.items()}), busy_us / steps / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/step_kernels.py")
    parser.add_argument("--workload", default="resnet152")
    parser.add_argument("--methods", nargs=2, default=["compile", "mirror-balance"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10, help="steps per round")
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run, no kernels counted")
    parser.add_argument("--quick", action="store_true", help="the workload's small size")
    args = parser.parse_args()
    opts = RunOptions(device=args.device, quick=args.quick)
    workload = get_workload(args.workload)
    steps = {}
    for name in args.methods:
        t0 = time.perf_counter()
        _, _, _, step = _prepare(
            workload,
            get_method(name),
            opts,
            MethodResult(workload=workload.name, method=name, status="ok"),
        )
        for _ in range(3):
            step()
        synchronize(opts.device)
        print(f"{name}: compiled and warmed in {time.perf_counter() - t0:.0f} s", flush=True)
        steps[name] = step
    times: dict[str, list[float]] = {name: [] for name in args.methods}
    for _ in range(args.rounds):
        for name, step in steps.items():
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step()
                synchronize(opts.device)
                times[name].append((time.perf_counter() - t0) * 1e3)
    census = {}
    for name, step in steps.items():
        census[name] = kernel_census(step, args.profile_steps, opts.device)
        q = statistics.quantiles(times[name], n=5)
        launches, busy_ms = census[name]
        print(
            f"{name:16s} median {statistics.median(times[name]):6.2f} ms  p20/p80 "
            f"{q[0]:6.2f}/{q[3]:6.2f}  kernels/step {sum(launches.values()):6.0f}  "
            f"GPU busy {busy_ms:6.2f} ms/step"
        )
    (a, _), (b, _) = census[args.methods[0]], census[args.methods[1]]
    diff = {k: b[k] - a[k] for k in a.keys() | b.keys() if b[k] != a[k]}
    print(f"kernels per step, {args.methods[1]} minus {args.methods[0]} (largest first):")
    for k, d in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:25]:
        print(f"  {d:+6.0f}  {k}")


if __name__ == "__main__":
    main()
