"""The backward guard on the GPU: a planned backward that fails on its first call.

    PYTHONPATH=src python tests/gpu_backward_guard_check.py OUT_DIR [--device cpu]

What tests/test_compile.py checks on the CPU, on CUDA and under CUDA Graph trees
(``torch.compile(..., mode="reduce-overhead")``, where the first call of the backward is
the trees' warm-up run): the planned backward (budget 0.3: the dropout mask and the first
Linear are recomputed) is made to raise after running its compiled code; training goes
on for 3 steps (the RNG seeded once). Per case: the fallback warnings (1 expected), the
planned backward's calls (1), the plans left (0) and the largest gradient difference
from ``torch.compile``'s (same mode, same dropout masks) relative to the largest one.
Writes OUT_DIR/backward_guard.json after each case and prints a table last.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

import mirrorgrad
from mirrorgrad import _compat, compiler
from mirrorgrad.mirror.partition import MirrorgradFallbackWarning, MirrorPartitioner

STEPS = 3


def net(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.BatchNorm1d(128), torch.nn.GELU(),
        torch.nn.Dropout(0.5), torch.nn.Linear(128, 16),
    ).to(device)  # fmt: skip


def fail_the_plans_backward(calls: list[int]) -> None:
    real = _compat.compile_fx_inner

    def compile_fx_inner(gm, inputs, **kwargs):
        compiled = real(gm, inputs, **kwargs)
        planned = isinstance(_compat.inductor_config.custom_partitioner_fn, MirrorPartitioner)
        if not (kwargs.get("is_backward") and planned):
            return compiled

        def run(args):
            calls.append(1)
            out = compiled(args)
            if len(calls) == 1:
                raise RuntimeError("injected: backward kernel cannot take this shape")
            return out

        run._boxed_call = True
        return run

    compiler._compat.compile_fx_inner = compile_fx_inner


def train(model, xs) -> list[list[torch.Tensor]]:
    """Each step's gradients, cloned at once (under CUDA Graph trees a gradient may live
    in the trees' pool until the next replay); the RNG is seeded once."""
    torch.manual_seed(1)
    grads = []
    for _ in range(STEPS):
        torch.compiler.cudagraph_mark_step_begin()
        model.zero_grad(set_to_none=True)
        sum(model(x).square().sum() for x in xs).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return grads


def run_case(device: str, torch_mode: str | None, microbatches: int) -> dict:
    torch._dynamo.reset()
    calls: list[int] = []
    fail_the_plans_backward(calls)
    reference = net(device)
    model = copy.deepcopy(reference)
    kwargs = {"mode": torch_mode} if torch_mode else {}
    backend = mirrorgrad.backend(mode="budget", budget=0.3, root_module=model)
    xs = [torch.randn(256, 64, device=device) for _ in range(microbatches)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = train(torch.compile(model, backend=backend, **kwargs), xs)
    want = train(torch.compile(reference, **kwargs), xs)
    worst = 0.0
    for step_got, step_want in zip(got, want):
        # Relative to the largest gradient entry: the first bias's gradient is zero but
        # for rounding (BatchNorm follows it).
        scale = max(q.abs().max().item() for q in step_want)
        diff = max((p - q).abs().max().item() for p, q in zip(step_got, step_want))
        worst = max(worst, diff / scale)
    caught = [w for w in caught if issubclass(w.category, MirrorgradFallbackWarning)]
    fallbacks = [str(w.message) for w in caught]
    return {
        "warnings": len(fallbacks),
        "first_warning": fallbacks[0][:200] if fallbacks else "",
        "planned_backward_calls": len(calls),
        "plans_left": len(backend.plans),
        "max_rel_grad_diff": worst,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cases = [("cudagraph trees", "reduce-overhead", 1), ("plain", None, 2)]
    if args.device == "cpu":
        cases = cases[1:]
    results = {}
    for name, torch_mode, microbatches in cases:
        start = time.perf_counter()
        try:
            result = {"status": "ok", **run_case(args.device, torch_mode, microbatches)}
        except Exception as exc:
            traceback.print_exc()
            result = {"status": f"crash: {type(exc).__name__}: {str(exc)[:200]}"}
        result["seconds"] = round(time.perf_counter() - start, 1)
        results[name] = result
        (args.out / "backward_guard.json").write_text(json.dumps(results, indent=2))
    print(f"torch {torch.__version__}, device {args.device}")
    header = ("case", "status", "warn", "bw calls", "plans", "rel diff", "s")
    print("{:<16} {:<8} {:>4} {:>8} {:>5} {:>9} {:>5}".format(*header))
    for name, r in results.items():
        diff = r.get("max_rel_grad_diff", float("nan"))
        print(
            f"{name:<16} {r['status'][:8]:<8} {r.get('warnings', '-'):>4} "
            f"{r.get('planned_backward_calls', '-'):>8} {r.get('plans_left', '-'):>5} "
            f"{diff:>9.1e} {r['seconds']:>5}"
        )
    for name, r in results.items():
        if r["status"] != "ok":
            print(name, r["status"], file=sys.stderr)


if __name__ == "__main__":
    main()
