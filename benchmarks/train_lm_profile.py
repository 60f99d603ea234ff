"""Where `mirrorgrad train lm`'s step time goes, on a GPU: the kernels of its steps by kind.

    PYTHONPATH=src python benchmarks/train_lm_profile.py --data corpus [--batch 20]
        [--precision bf16] [--steps 60] [--profiled 10]

Runs `train lm --model medium` (one CUDA Graph per step on one GPU) and profiles
``--profiled`` steps after the first ``--steps - --profiled`` with torch.profiler (CUDA
activity: the kernels inside the replayed graph). Prints the wall time per step between
the profiled steps' first and last, the kernels' device time per step grouped by kind
(the recurrent kernels, GEMMs, Inductor's generated kernels, the rest) and the top
kernels: what the step spends beside the recurrence, and the gaps between kernels.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from mirrorgrad.bench.lm_step import run_train_lm
from mirrorgrad.train import loop

# First match wins: Inductor's kernels are named triton_{poi,red,per,tem}_fused_*.
KINDS = (
    ("recurrence (CUDA C++)", ("lstm_persistent_",)),
    ("Inductor (generated)", ("triton_",)),
    ("GEMM", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas")),
    ("recurrence (Triton)", ("persistent", "lstm", "gru", "rnn", "cell")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, needles in KINDS:
        if any(low.startswith(n) if n == "triton_" else n in low for n in needles):
            return kind
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="corpus folder")
    parser.add_argument("--batch", type=int, default=20)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--profiled", type=int, default=10)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    if not args.data.is_dir():
        parser.error(f"--data {args.data}: no such folder")
    if not 0 < args.profiled < args.steps - 5:
        parser.error("--profiled must be positive and leave 5 warm-up steps of --steps")

    step, calls, state = loop.StepLoop._step, [0], {}
    first = args.steps - args.profiled

    def profiled_step(self, x, y):
        calls[0] += 1
        if calls[0] == first + 1:
            torch.cuda.synchronize()
            state["prof"] = profile(activities=[ProfilerActivity.CUDA])
            state["prof"].__enter__()
            state["start"] = time.perf_counter()
        out = step(self, x, y)
        if calls[0] == args.steps:
            torch.cuda.synchronize()
            state["wall"] = time.perf_counter() - state["start"]
            state["prof"].__exit__(None, None, None)
        return out

    loop.StepLoop._step = profiled_step
    summary = run_train_lm(args.batch, args.precision, args.steps, args.data)
    if "wall" not in state:
        raise SystemExit("the profiled steps did not run (fewer windows than --steps?)")

    per_kernel: Counter[str] = Counter()
    launches: Counter[str] = Counter()
    for event in state["prof"].events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name] += event.device_time_total
            launches[event.name] += 1
    n = args.profiled
    wall_us = state["wall"] / n * 1e6
    busy_us = sum(per_kernel.values()) / n
    by_kind: Counter[str] = Counter()
    for name, us in per_kernel.items():
        by_kind[kind_of(name)] += us / n
    print(f"\nmedium, batch {args.batch}, {args.precision}, {torch.cuda.get_device_name()}; "
          f"{summary.tokens_per_s / 1e3:.1f}k tokens/s over the run")  # fmt: skip
    print(f"per step: {wall_us:.0f} us wall, {busy_us:.0f} us in kernels, "
          f"{wall_us - busy_us:.0f} us of gaps and host\n")  # fmt: skip
    print("| kind | us per step | share of wall |\n|---|---:|---:|")
    for kind, us in by_kind.most_common():
        print(f"| {kind} | {us:.0f} | {us / wall_us:.0%} |")
    print("\n| kernel | us per step | launches per step |\n|---|---:|---:|")
    for name, us in per_kernel.most_common(args.top):
        print(f"| {name[:90]} | {us / n:.1f} | {launches[name] / n:.1f} |")


if __name__ == "__main__":
    main()
