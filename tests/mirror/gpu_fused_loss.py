"""The LM-head loss rewrite (``fuse_loss``) on the language-model workloads, by hand (not
collected by pytest).

    python tests/mirror/gpu_fused_loss.py estimate [--workloads gpt2 transformer]
    python tests/mirror/gpu_fused_loss.py measure [--workloads gpt2] [--methods ...]

``estimate`` (any device, nothing runs): the joint graph Inductor would partition,
captured as bench/frontier.py captures it, without and with the rewrite; the estimated
peak and step time (the cost model's) of min-cut's default partition, balance and
budget 0.5 on each, with an H100's rates on the CPU (``--gpu-layout``: and a GPU's
padded matmuls). ``measure`` (a GPU): per method, the first step's
loss and gradients against ``compile``'s (fused against unfused), then the peak memory
(``max_memory_allocated``) and the median time of forward+backward over ``--steps``.
``--quick`` (tiny sizes) checks the script itself on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import warnings

import torch

METHODS = {
    "compile": None,
    "mirror-balance": {"mode": "balance"},
    "mirror-balance-nofuse": {"mode": "balance", "fuse_loss": False},
    "mirror-budget-0.5": {"mode": "budget", "budget": 0.5},
    "mirror-budget-0.5-nofuse": {"mode": "budget", "budget": 0.5, "fuse_loss": False},
}


def _capture(model, batch, fuse: bool):
    """The joint graph Inductor hands its partitioner, the loss fused or not."""
    from mirrorgrad import _compat
    from mirrorgrad.bench import frontier
    from mirrorgrad.mirror.fused_loss import fuse_lm_head_losses

    found = []

    def backend(gm, example_inputs):
        found.extend(fuse_lm_head_losses(gm, fuse))
        return _compat.compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    patch = {_compat.INDUCTOR_PARTITIONER_CONFIG: frontier._CapturePartitioner()}
    try:
        with _compat.inductor_config.patch(patch):
            torch.compile(model, backend=backend, fullgraph=True)(*batch)
    except Exception as e:  # Dynamo wraps what the partitioner raises
        cause = e
        while cause is not None and not isinstance(cause, frontier._Captured):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        return cause.joint, found
    finally:
        torch._dynamo.reset()
    raise RuntimeError("the model compiled without a backward graph")


def estimate(args) -> None:
    from mirrorgrad.bench import frontier
    from mirrorgrad.bench.suites import get_workload
    from mirrorgrad.graph.cost import H100, StepCost, rates_for

    print("| workload | loss | plan | est. peak MiB | / unfused compile | est. step ms |")
    print("|---|---|---|---:|---:|---:|")
    for name in args.workloads:
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        built = get_workload(name).build(device=args.device, quick=args.quick, dtype=dtype)
        base = None
        for fuse in (False, True):
            layout = frontier._as_on_a_gpu() if args.gpu_layout else contextlib.nullcontext()
            with layout:
                joint, found = _capture(built.model, built.make_batch(), fuse)
                rows = frontier.compare(joint, fractions=(0.5,))
            rates = rates_for(joint.device) if joint.device.type == "cuda" else H100
            step_ms = StepCost(joint, rates, fusion=True).step_seconds * 1e3
            base = base or rows[0]["peak_mib"]
            loss = ", ".join(f"fused {f.rows}x{f.vocab}" for f in found if f.fused) or "unfused"
            for row in rows:
                if row["plan"] in ("compile (min-cut)", "mirror-balance", "mirror-budget-0.5"):
                    print(
                        f"| {name} | {loss} | {row['plan']} | {row['peak_mib']:,.0f} "
                        f"| {row['peak_mib'] / base:.3f}x "
                        f"| {step_ms * (1 + row['added_time']):.1f} |",
                        flush=True,
                    )


def _step(fn, batch, params):
    for p in params:
        p.grad = None
    loss = fn(*batch)
    loss.backward()
    return loss


def measure(args) -> None:
    import mirrorgrad
    from mirrorgrad.bench.suites import get_workload

    torch.set_float32_matmul_precision("high")  # TF32, as `mirrorgrad bench` runs
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    print("| workload | method | peak MiB | step ms (median) | loss vs compile | max grad diff |")
    print("|---|---|---:|---:|---:|---:|")
    for name in args.workloads:
        built = get_workload(name).build(device=device, quick=args.quick, dtype=dtype)
        model = built.model.eval()  # dropout off: every method takes the same step
        params = [p for p in model.parameters() if p.requires_grad]
        batch = built.make_batch()
        reference = None
        for method in args.methods:
            torch._dynamo.reset()
            options = METHODS[method]
            if options is None:
                fn = torch.compile(model, backend=args.backend)
            else:
                fn = mirrorgrad.compile(model, backend=args.backend, **options)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loss = _step(fn, batch, params).detach().float()
            grads = [p.grad.float().clone() for p in params]
            if reference is None:
                reference = (loss, grads)
            loss_diff = (loss - reference[0]).abs().item()
            grad_diff = max((g - r).abs().max().item() for g, r in zip(grads, reference[1]))
            del grads
            for _ in range(args.warmup):
                _step(fn, batch, params)
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                _step(fn, batch, params)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else 0.0
            fused = [str(f) for p in getattr(fn, "_mirrorgrad_plans", []) for f in p.fused_losses]
            print(
                f"| {name} | {method} | {peak:,.0f} | {statistics.median(times) * 1e3:.1f} "
                f"| {loss_diff:.2e} | {grad_diff:.2e} |",
                flush=True,
            )
            if fused:
                print(f"|  | ({'; '.join(fused)}) | | | | |", flush=True)
            del fn


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tests/mirror/gpu_fused_loss.py")
    parser.add_argument("what", choices=("estimate", "measure"))
    parser.add_argument("--workloads", nargs="+", default=["gpt2", "transformer"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="fp32")
    parser.add_argument("--backend", choices=("inductor", "eager"), default="inductor")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (checks the script)")
    parser.add_argument("--gpu-layout", action="store_true",
                        help="estimate: on the CPU, lay out as a GPU does (frontier.py's flag)")
    args = parser.parse_args(argv)
    (estimate if args.what == "estimate" else measure)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
