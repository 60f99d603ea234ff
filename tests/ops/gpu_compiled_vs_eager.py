"""GPU script: compiled mirrorgrad.nn steps against the same model eager.

    python tests/ops/gpu_compiled_vs_eager.py OUT_DIR [--workloads NAME ...] [--rounds 8]
                                              [--steps 5] [--budget-s 190]

For each recurrent workload of the suite (``mirrorgrad bench``'s models, batches, step
(zero_grad, forward, backward, clip, SGD) and TF32 setting) three variants with mirrorgrad.nn RNNs:
``eager+mgnn``, ``compile+mgnn`` (torch.compile) and ``mirror-balance+mgnn``
(mirrorgrad.compile, mode="balance"), each on its own identically seeded model.

First every compiled variant of every workload compiles cold in a process of its own,
all at once (empty Inductor and Triton caches; "cold s" is under that contention). One
process per workload builds its three variants and waits for the GPU (a file lock, free
once every cold compile is done or ``--quiet-s`` passed; then one workload at a time):
in a first turn its eager first step (``impl="auto"`` times its candidates there,
alone), then, outside the lock, the compiled variants' first steps (from the warm
caches; their traces take eager's pick where it is one of the op's implementations),
and in a second turn warm-ups and ``--rounds`` rounds of ``--steps`` steps per
variant, the variants' order rotating each round: drift of clocks and host load hits
all three alike. "vs eager" is the median over rounds of the round's compiled / eager
median step time (< 1: faster than eager).

Per variant it also records: host ms per step (the time to issue a step, no sync), a
profile of 3 steps (kernel launches, CUDA Graph replays, copies, syncs per step and
device ms), which implementation ran each RNN layer, and for mirror-balance the op
memory choices of its plans. Writes OUT_DIR/compiled_vs_eager.json, one log per workload; prints a
table last.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import fcntl
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKLOADS = ("lstm-lm-medium", "lstm-lm-large", "nmt-attention", "deepspeech2")
VARIANTS = ("eager+mgnn", "compile+mgnn", "mirror-balance+mgnn")
# CUDA runtime / driver calls counted per step in the profile.
API_CALLS = {
    "launch": ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC"),
    "graph": ("cudaGraphLaunch",),
    "copy": ("cudaMemcpyAsync", "cudaMemsetAsync"),
    "sync": ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"),
}


def _precision(device: str) -> None:
    """TF32 GEMMs on CUDA, as `mirrorgrad bench`'s worker sets them (bench/runner.py)."""
    import torch

    if device == "cuda":
        torch.set_float32_matmul_precision("high")


def _variant_steps(workload_name: str, device: str) -> dict:
    """variant -> (step callable, step_fn), each on its own model, built and seeded alike
    (``quick`` sizes off CUDA: the CPU smoke test)."""
    from mirrorgrad.bench.runner import _make_step
    from mirrorgrad.bench.suites import get_method, get_workload

    workload = get_workload(workload_name)
    _precision(device)
    steps = {}
    for variant in VARIANTS:
        built = workload.build(device=device, quick=device == "cpu")
        method = get_method(variant)
        step_fn = method.prepare(built.model, blocks=built.blocks, backend="inductor")
        batch = built.make_batch()
        steps[variant] = (_make_step(step_fn, built.model, batch, workload), step_fn)
    return steps


@contextlib.contextmanager
def _impls_used(counts: collections.Counter):
    """Counts, while inside, which implementation ran each RNN layer call."""
    from mirrorgrad.ops.rnn import dispatch, op, reference

    modules = {"reference": reference}
    triton = op.triton_module()
    if triton is not None:
        modules["triton"] = triton
    with contextlib.suppress(ImportError, RuntimeError):
        modules["persistent"] = op._kernels("persistent")
    patched = []

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    for name, module in modules.items():
        for attr in ("layer_forward", "layer_backward"):
            fn = getattr(module, attr)
            patched.append((module, attr, fn))
            setattr(module, attr, counting(f"{name}.{attr.split('_')[1]}", fn))
    patched.append((dispatch, "_cudnn", dispatch._cudnn))
    dispatch._cudnn = counting("cudnn.forward", dispatch._cudnn)
    try:
        yield
    finally:
        for module, attr, fn in patched:
            setattr(module, attr, fn)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _profile(step, table: Path, steps: int = 3) -> dict:
    """Per step: runtime API calls by kind, and device ms (kernels, copies); the kernels
    by device time and the host ops by CPU time go to ``table``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _sync()
    events = prof.key_averages()
    sort = "cuda_time_total" if len(activities) > 1 else "cpu_time_total"
    table.write_text(
        f"{steps} steps\n"
        + events.table(sort_by=sort, row_limit=40)
        + "\n\nCPU\n"
        + events.table(sort_by="self_cpu_time_total", row_limit=30)
    )
    counts = {kind: 0 for kind in API_CALLS}
    for e in events:
        for kind, names in API_CALLS.items():
            if e.key in names:
                counts[kind] += e.count
    device_us = sum(getattr(e, "self_device_time_total", 0) for e in events)
    out = {kind: round(n / steps, 1) for kind, n in counts.items()}
    out["device_ms"] = round(device_us / steps / 1e3, 3)
    return out


def _timed_block(step, steps: int) -> tuple[list[float], float]:
    """(CUDA-event ms of each step, host ms per step to issue them)."""
    import torch

    if not torch.cuda.is_available():  # the CPU smoke test: wall time
        ms = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            ms.append((time.perf_counter() - t0) * 1e3)
        return ms, statistics.mean(ms)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(steps)]  # fmt: skip
    t0 = time.perf_counter()
    for start, end in events:
        start.record()
        step()
        end.record()
    host = (time.perf_counter() - t0) * 1e3 / steps
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events], host


def _rounds(steps: dict, rounds: int, per_round: int) -> dict:
    """Interleaved rounds; per variant every step's ms, host ms, and per round medians."""
    names = list(steps)
    samples = {n: [] for n in names}
    host = {n: [] for n in names}
    medians = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            ms, host_ms = _timed_block(steps[name][0], per_round)
            samples[name] += ms
            host[name].append(host_ms)
            medians[name].append(statistics.median(ms))
    return {"samples": samples, "host": host, "medians": medians}


def _op_memory(step_fn) -> list[str]:
    plans = getattr(step_fn, "_mirrorgrad_plans", None) or []
    return [f"{c.module or c.node}: {c.choice} ({c.reason})" for p in plans
            for c in getattr(p, "op_memory", ())]  # fmt: skip


@contextlib.contextmanager
def _gpu_turn(lock: Path):
    """The GPU to this process alone while inside (the other workloads wait)."""
    with open(lock, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _cold(workload: str, variant: str) -> dict:
    """One variant's first step, compiling with whatever the caches hold."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    from mirrorgrad.bench.runner import _make_step
    from mirrorgrad.bench.suites import get_method, get_workload

    spec = get_workload(workload)
    _precision(device)
    built = spec.build(device=device, quick=device == "cpu")
    step_fn = get_method(variant).prepare(built.model, blocks=built.blocks, backend="inductor")
    step = _make_step(step_fn, built.model, built.make_batch(), spec)
    t0 = time.perf_counter()
    step()
    _sync()
    return {"workload": workload, "variant": variant, "cold_s": round(time.perf_counter() - t0, 2)}


def _child(workload: str, out: Path, lock: Path, rounds: int, per_round: int) -> dict:
    import torch

    from mirrorgrad.ops.rnn import cuda_graphs, dispatch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # Three variants' captured loops in one process: room for all of them (each alone
    # fits the defaults), so that no variant evicts another's (deepspeech2: 20 keys each).
    result = {"workload": workload, "variants": {}, "device": device,
              "cache_size_raised": hasattr(cuda_graphs, "_GRAPH_CACHE_SIZE")}  # fmt: skip
    cuda_graphs._GRAPH_CACHE_SIZE = 256
    steps = _variant_steps(workload, device)
    with _gpu_turn(lock):
        # impl="auto" times its candidates here, alone on the GPU; the compiled variants'
        # traces then take its pick where it is one of the op's implementations.
        t0 = time.perf_counter()
        steps["eager+mgnn"][0]()
        _sync()
        result["variants"]["eager+mgnn"] = {"first_s": round(time.perf_counter() - t0, 2)}
    for name, (step, _) in steps.items():  # from warm caches, in parallel with the others
        if name == "eager+mgnn":
            continue
        t0 = time.perf_counter()
        step()
        _sync()
        result["variants"][name] = {"warm_s": round(time.perf_counter() - t0, 2)}
    with _gpu_turn(lock):
        result["turn_at_s"] = round(time.time(), 1)
        for step, _ in steps.values():
            for _ in range(3):
                step()
        timed = _rounds(steps, rounds, per_round)
        for name, (step, step_fn) in steps.items():
            impls = collections.Counter()
            with _impls_used(impls):
                step()
            info = result["variants"][name]
            info.update(
                median_ms=round(statistics.median(timed["samples"][name]), 3),
                min_ms=round(min(timed["samples"][name]), 3),
                host_ms=round(statistics.median(timed["host"][name]), 3),
                round_medians=[round(m, 3) for m in timed["medians"][name]],
                impls=dict(impls), op_memory=_op_memory(step_fn),
                profile=_profile(step, out / f"prof_{workload}_{name}.txt"),
            )  # fmt: skip
        eager = timed["medians"]["eager+mgnn"]
        for name in VARIANTS[1:]:
            ratios = [c / e for c, e in zip(timed["medians"][name], eager)]
            result["variants"][name]["vs_eager"] = round(statistics.median(ratios), 3)
            result["variants"][name]["rounds_slower"] = sum(r > 1 for r in ratios)
        result["auto_times"] = {str(k): v for k, v in dispatch.AUTO_TIMES.items()}
        result["auto_choice"] = {str(k): v for k, v in dispatch._AUTO_CHOICE.items()}
    return result


def _start(args, env: dict, name: str, extra: list[str]):
    command = [sys.executable, __file__, str(args.out), *extra]
    log = open(args.out / f"log_{name}.txt", "w")  # noqa: SIM115 (closed by _finish)
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT), log


def _finish(args, name: str, proc, log, deadline: float) -> dict | None:
    """The child's RESULT line (None: none, the log's tail goes to ``error``)."""
    try:
        proc.wait(timeout=max(1.0, deadline - time.perf_counter()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()
    text = (args.out / f"log_{name}.txt").read_text()
    found = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    if found:
        return json.loads(found[-1][len("RESULT ") :])
    tail = " | ".join(text.strip().splitlines()[-3:])[-300:]
    return {"error": f"exit {proc.returncode}: {tail}"}


def _run_all(args) -> list[dict]:
    caches = Path(tempfile.mkdtemp(prefix="compiled-vs-eager-"))
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
               TRITON_CACHE_DIR=str(caches / "triton"), PYTHONUNBUFFERED="1",
               MIRRORGRAD_RNN_GRAPH_CACHE_MB="16384")  # fmt: skip
    # ^ three variants' captured loops in one process: room for all (each alone fits the
    # default), so that no variant evicts another's.
    deadline = time.perf_counter() + args.budget_s
    colds = {(w, v): _start(args, env, f"cold_{w}_{v}", ["--cold", w, v])
             for w in args.workloads for v in VARIANTS[1:]}  # fmt: skip
    timing, results = {}, {}
    lock = caches / "gpu.lock"
    timing_args = ["--lock", str(lock), "--rounds", str(args.rounds), "--steps", str(args.steps)]
    held = open(lock, "w")  # noqa: SIM115 (released below)
    fcntl.flock(held, fcntl.LOCK_EX)  # no timing while cold compiles load the host
    quiet_until = time.perf_counter() + args.quiet_s
    while len(results) < len(args.workloads) and time.perf_counter() < deadline:
        running = [name for name, (proc, _) in colds.items() if proc.poll() is None]
        if not held.closed and (not running or time.perf_counter() > quiet_until):
            held.close()
            print(f"GPU turns open; cold compiles still running: {running}", flush=True)
        for w in args.workloads:
            mine = [colds[w, v] for v in VARIANTS[1:]]
            if w not in timing and all(proc.poll() is not None for proc, _ in mine):
                timing[w] = _start(args, env, w, ["--child", w, *timing_args])
            if w in timing and w not in results and timing[w][0].poll() is not None:
                results[w] = _finish(args, w, *timing[w], deadline)
        time.sleep(0.5)
    held.close()
    out = []
    for w in args.workloads:
        result = results.get(w) or (
            _finish(args, w, *timing[w], deadline)
            if w in timing
            else {"error": "its compiles did not finish in time"}
        )
        result["workload"] = w
        for v in VARIANTS[1:]:
            cold = _finish(args, f"cold_{w}_{v}", *colds[w, v], deadline)
            result.setdefault("variants", {}).setdefault(v, {})["cold_s"] = cold.get(
                "cold_s", cold.get("error")
            )
        out.append(result)
    return out


def _table(results: list[dict]) -> str:
    cols = ("workload", "variant", "cold s", "warm s", "median ms", "min ms", "vs eager",
            "rounds slower", "host ms", "device ms", "launches", "graph replays", "copies",
            "syncs", "impls")  # fmt: skip
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['workload']} | FAILED: {r['error'].replace('|', '/')} |")
        for name in VARIANTS:
            v = r["variants"].get(name, {})
            p = v.get("profile", {})
            impls = ", ".join(f"{k} {n}" for k, n in sorted(v.get("impls", {}).items()))
            row = (r["workload"], name, v.get("cold_s", "-"), v.get("warm_s", "-"),
                   v.get("median_ms"), v.get("min_ms"), v.get("vs_eager", "-"),
                   v.get("rounds_slower", "-"), v.get("host_ms"),
                   p.get("device_ms"), p.get("launch"), p.get("graph"), p.get("copy"),
                   p.get("sync"), impls)  # fmt: skip
            lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5, help="steps per variant per round")
    parser.add_argument("--budget-s", type=float, default=190.0)
    parser.add_argument(
        "--quiet-s",
        type=float,
        default=75.0,
        help="no timing while cold compiles run, for at most this long",
    )
    parser.add_argument("--child", choices=WORKLOADS, help=argparse.SUPPRESS)
    parser.add_argument("--lock", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--cold", nargs=2, metavar=("WORKLOAD", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.cold:
        print("RESULT " + json.dumps(_cold(*args.cold)), flush=True)
        return
    if args.child:
        result = _child(args.child, args.out, args.lock, args.rounds, args.steps)
        print("RESULT " + json.dumps(result), flush=True)
        return
    results = _run_all(args)
    (args.out / "compiled_vs_eager.json").write_text(json.dumps(results, indent=1))
    print(_table(results))
    for r in results:
        for name, v in r.get("variants", {}).items():
            if v.get("op_memory"):
                print(f"{r['workload']} {name} op memory: {'; '.join(v['op_memory'])}")


if __name__ == "__main__":
    main()
