"""Cold compile time of torch.compile against mirrorgrad.compile, each in a fresh process,
one after another (a GPU measurement: run by hand, not collected by pytest).

    python tests/mirror/cold_compile.py [--workloads gpt2 transformer] [--repeats 1] [--phases]

(six fresh processes, one after another.)

Per (workload, method): seconds from the compile call to the end of the first
forward+backward (device synchronized), and where they went:

- ``partition``: the partitioner (ours: the planner and the split into forward and
  backward modules; torch.compile's: min-cut), of which ``plan`` is ``planner.plan``;
- ``fw``/``bw``: Inductor compiling the forward and the backward graph
  (``compile_fx_inner``: post-grad passes, lowering, code generation, kernel builds);
- ``guards``: our first-call guards (the backward graph kept as partitioned, the
  backward's inputs copied before its first call and dropped after it: the copies
  timed to their end on the device);
- ``rest``: the remainder (Dynamo, AOTAutograd's tracing and joint-graph passes, the
  step itself);
- ``kernels``: distinct kernels built (C++ shared objects on a CPU, cubins on a GPU);
- ``copies``: where the guards' copies went (MiB on the device, in host memory).

Inductor's caches are cold (a fresh ``TORCHINDUCTOR_CACHE_DIR`` per process, FX graph
and AOTAutograd caches off). ``--device cpu --batch 1 --length 128`` measures on a CPU
(the full models; several minutes); ``--quick`` builds the workloads' small sizes.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

METHODS = {
    "torch.compile": None,
    "balance": {"mode": "balance"},
    "budget 0.5": {"mode": "budget", "budget": 0.5},
}
PARTS = ("partition", "plan", "fw", "bw", "guards", "rest")
# Inductor's phases within fw and bw (Dynamo's compile_times keys), for --phases.
PHASES = {
    "post-grad": "_recursive_post_grad_passes",
    "lowering": "GraphLowering.run",
    "codegen": "GraphLowering.codegen",
    "kernel wait": "async_compile.wait",
    # Triton kernels built in this process (the worker pool not up yet), one at a time.
    "in-process builds": "async_compile.precompile",
}


def _timed(spent: dict, key: str, fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - start

    return run


def _one(workload: str, method: str, args: argparse.Namespace) -> dict:
    import torch
    from torch._inductor.compile_fx import compile_fx

    import mirrorgrad
    from mirrorgrad import _compat, compiler, safety_copies
    from mirrorgrad.bench.workloads import WORKLOADS
    from mirrorgrad.mirror import partition, planner

    spent: dict[str, float] = defaultdict(float)
    device = args.device
    sync = torch.cuda.synchronize if device.startswith("cuda") else lambda: None
    inner = _compat.compile_fx_inner

    def compile_inner(gm, example_inputs, **kwargs):
        key = "bw" if kwargs.get("is_backward") else "fw"
        return _timed(spent, key, inner)(gm, example_inputs, **kwargs)

    # Ours: mirrorgrad's inner compile goes through _compat (guards included).
    _compat.compile_fx_inner = compile_inner
    compiler._compile_guarding_the_backward = _timed(
        spent, "guarded", compiler._compile_guarding_the_backward
    )
    copies, take_copies = safety_copies.SafetyCopies, safety_copies.SafetyCopies.of.__func__
    placed: dict[str, int] = defaultdict(int)

    def take(cls, args, **kwargs):
        taken = take_copies(cls, args, **kwargs)
        sync()  # device copies run asynchronously: count them here, not in the backward
        for where, nbytes in taken.placed().items():
            placed[where] += nbytes
        return taken

    copies.of = classmethod(_timed(spent, "guards", take))
    copies.release = _timed(spent, "guards", copies.release)
    planner.plan = _timed(spent, "plan", planner.plan)
    partition.partition = _timed(spent, "partition", partition.partition)
    # torch.compile's: min-cut, as Inductor calls it.
    fx_module = sys.modules[compile_fx.__module__]
    fx_module.min_cut_rematerialization_partition = _timed(
        spent, "partition", fx_module.min_cut_rematerialization_partition
    )

    def inductor(gm, example_inputs):  # torch.compile's default backend, its parts timed
        return compile_fx(gm, example_inputs, inner_compile=compile_inner)

    if device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")  # as mirrorgrad bench sets it
    torch.manual_seed(0)
    built = WORKLOADS[workload].build(batch=args.batch, device=device, quick=args.quick)
    batch = built.make_batch()
    if args.length:
        batch = tuple(t[:, : args.length] for t in batch)
    sync()
    start = time.perf_counter()
    options = METHODS[method]
    if options is None:
        step = torch.compile(built.model, backend=inductor)
    else:
        step = mirrorgrad.compile(built.model, **options)
    step(*batch).backward()
    sync()
    total = time.perf_counter() - start
    # The guard's copy of the backward graph: what its wrapper spent beyond Inductor.
    inductor_s = spent["fw"] + spent["bw"]
    spent["guards"] += spent.pop("guarded", inductor_s) - inductor_s
    known = sum(spent[k] for k in ("partition", "fw", "bw", "guards"))
    return {
        "cold_s": total,
        **{k: spent[k] for k in PARTS if k != "rest"},
        "rest": total - known,
        "kernels": _kernels_built(),
        "copied_mib": {k: round(v / 2**20, 1) for k, v in placed.items()},
        "phases": _phases(),
    }


def _kernels_built() -> int:
    """Kernels built in this (fresh) cache: distinct kernels, what costs compile time.
    The CPU's C++ kernels are shared objects, Triton's cubins."""
    root = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    return sum(name.endswith((".so", ".cubin")) for _, _, names in os.walk(root) for name in names)


def _phases() -> dict[str, list[float]]:
    """Seconds of each of ``PHASES``, one entry per graph compiled (forward first)."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv")
    found = dict(zip(names, values))
    return {
        phase: [float(v) for v in found[key].split(",")] if key in found else []
        for phase, key in PHASES.items()
    }


def _copied(row: dict) -> str:
    """Where the guard's copies went (MiB on the device, in host memory)."""
    return " ".join(f"{where} {mib} MiB" for where, mib in sorted(row["copied_mib"].items()))


def _seconds(values: list[float]) -> str:
    """Per graph (forward/backward), or the sum of a phase timed per kernel."""
    if len(values) <= 2:
        return "/".join(f"{v:.2f}" for v in values) or "-"
    return f"{sum(values):.2f} ({len(values)} kernels)"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workloads", nargs="+", default=["gpt2", "transformer"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, help="the workload's batch unless given")
    parser.add_argument("--length", type=int, help="tokens: the first LENGTH of each sample")
    parser.add_argument("--quick", action="store_true", help="the workloads' small sizes")
    parser.add_argument("--phases", action="store_true", help="Inductor's phases per graph")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_one(*args.child, args)))
        return
    forwarded = ["--device", args.device, *(["--quick"] if args.quick else [])]
    forwarded += [f"--{k}={getattr(args, k)}" for k in ("batch", "length") if getattr(args, k)]
    print(f"{'workload':12} {'method':14} {'cold s':>7} {'ratio':>6} "
          + " ".join(f"{p:>9}" for p in PARTS) + "  kernels  copies", flush=True)  # fmt: skip
    for workload in args.workloads:
        base = None
        for method in args.methods:
            rows = []
            for _ in range(args.repeats):
                with tempfile.TemporaryDirectory() as cache:
                    env = {
                        **os.environ,
                        "TORCHINDUCTOR_CACHE_DIR": cache,
                        "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
                        "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
                    }
                    out = subprocess.run(
                        [sys.executable, __file__, "--child", workload, method, *forwarded],
                        env=env, capture_output=True, text=True,
                    )  # fmt: skip
                if out.returncode:
                    sys.exit(f"{workload} {method} failed:\n{out.stderr[-3000:]}")
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            row = min(rows, key=lambda r: r["cold_s"])  # the least disturbed run
            if method == "torch.compile":
                base = row["cold_s"]
            ratio = f"{row['cold_s'] / base:.2f}x" if base else ""
            print(f"{workload:12} {method:14} {row['cold_s']:7.1f} {ratio:>6} "
                  + " ".join(f"{row[p]:9.2f}" for p in PARTS)
                  + f"  {row['kernels']:7d}  {_copied(row)}", flush=True)  # fmt: skip
            if args.phases:
                print(" " * 28 + "  ".join(
                    f"{phase} {_seconds(values)}" for phase, values in row["phases"].items()
                ), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
