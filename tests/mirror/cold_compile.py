"""Cold compile time of torch.compile against mirrorgrad.compile, each in a fresh process
(a GPU measurement: run by hand, not collected by pytest).

    python tests/mirror/cold_compile.py [--workloads gpt2 transformer] [--repeats 2]

Per (workload, method): seconds from the compile call to the end of the first
forward+backward (CUDA synchronized), and for mirrorgrad the seconds spent within them
in the planner (``mirror.planner.plan``) and in the whole partitioner. Inductor's
caches are off (cold compile every time, no FX graph or autotune cache from an earlier
process). ``--device cpu --quick`` checks the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

METHODS = {
    "torch.compile": {},
    "balance": {"mode": "balance"},
    "budget 0.5": {"mode": "budget", "budget": 0.5},
}


def _one(workload: str, method: str, device: str, quick: bool) -> dict:
    import torch

    import mirrorgrad
    from mirrorgrad.bench.suites import get_workload
    from mirrorgrad.mirror import partition, planner

    spent = {"planning_s": 0.0, "partitioner_s": 0.0}

    def timed(fn, key):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - start

        return run

    # The planner alone, and the whole partitioner (the plan, the RNN ops' memory
    # modes, the split into forward and backward modules).
    planner.plan = timed(planner.plan, "planning_s")
    partition.partition = timed(partition.partition, "partitioner_s")
    built = get_workload(workload).build(device=device, quick=quick)
    batch = built.make_batch()
    sync = torch.cuda.synchronize if device.startswith("cuda") else lambda: None
    sync()
    start = time.perf_counter()
    if method == "torch.compile":
        step = torch.compile(built.model)
    else:
        step = mirrorgrad.compile(built.model, **METHODS[method])
    step(*batch).backward()
    sync()
    return {"cold_s": time.perf_counter() - start, **spent}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workloads", nargs="+", default=["gpt2", "transformer"])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="the workloads' small sizes")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_one(*args.child, args.device, args.quick)))
        return
    for workload in args.workloads:
        base = None
        for method in METHODS:
            for _ in range(args.repeats):
                with tempfile.TemporaryDirectory() as cache:
                    env = {
                        **os.environ,
                        "TORCHINDUCTOR_CACHE_DIR": cache,
                        "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
                        "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
                    }
                    out = subprocess.run(
                        [sys.executable, __file__, "--child", workload, method,
                         "--device", args.device, *(["--quick"] if args.quick else [])],
                        env=env, capture_output=True, text=True, check=True,
                    )  # fmt: skip
                row = json.loads(out.stdout.strip().splitlines()[-1])
                base = row["cold_s"] if method == "torch.compile" and base is None else base
                ratio = f"{row['cold_s'] / base:.2f}x" if base else ""
                print(
                    f"{workload:12} {method:14} cold {row['cold_s']:6.1f} s {ratio:>6}  "
                    f"planning {row['planning_s']:.2f} s, partitioner {row['partitioner_s']:.2f} s",
                    flush=True,
                )


if __name__ == "__main__":
    main()
