"""Where the persistent module's time beyond its layer functions goes.

    python benchmarks/persistent_overhead.py --out DIR [--cases lstm:bf16:0,...]
        [--rounds 4] [--reps 5] [--time-limit S]

Per case (``persistent_rnn.CONFIGS``; TF32 on), forward+backward of one input and one
set of weights, in four ways:

* ``module``: ``mirrorgrad.nn.LSTM/GRU(impl="persistent")`` as ``persistent_rnn.py``
  times it (``.grad`` accumulates: one add per parameter per call);
* ``fresh``: the same with every ``.grad`` set to None first (``zero_grad()``'s default);
* ``layer``: the layer functions alone (``persistent_rnn.py``'s ``layer-persistent``);
* ``thread``: the same with the backward in a worker thread, as autograd runs the module's;
* ``onethread``: ``fresh`` with autograd's backward on the calling thread
  (``torch.autograd.set_multithreading_enabled(False)``, no hand-off to its device thread);
* ``graph``: ``module`` captured in one CUDA Graph and replayed (no host work: the GPU's
  own time for the module's kernels).

Timed interleaved (``rounds`` x ``reps`` calls of each in turn, CUDA events), so that
drift of the GPU's clocks hits all four alike; then per call: the host's own ms (calls
launched back to back, no sync) and, under torch.profiler, the GPU's kernel ms, its idle
ms between the first kernel and the last, the persistent kernels' ms, the kernel count and
the CUDA calls that can make the host wait. A module whose kernel ms match the layer's
but whose wall ms do not is paying on the host (or in a wait); one whose persistent kernels
run longer is paying on the GPU. Writes ``overhead.json`` (every sample) and a cProfile of
the module's host path per case; prints a table last.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from mirrorgrad._timing import host_ms, time_calls
from mirrorgrad.bench.rnn_modules import Config

# Run as a script, the repository root is not on the path: its sibling comes from there.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.persistent_rnn import (
    CONFIGS,
    DTYPES,
    _graphed,
    _layer_passes,
    _modules,
)

WAYS = ("module", "fresh", "onethread", "layer", "thread", "graph")
# CUDA calls after which the host may wait for the device (or for the driver's lock).
WAITING_PREFIXES = ("cudaMalloc", "cudaFree", "cudaHostAlloc", "cuMemAlloc", "cuMemFree",
                    "cuModuleLoad")  # fmt: skip
DEFAULT_CASES = "lstm:bf16:0,lstm:bf16:7,lstm:fp32:0,lstm:fp32:7"


def _ways(mode: str, cfg: Config, dtype: torch.dtype, pool: ThreadPoolExecutor,
          chosen: tuple[str, ...] = WAYS) -> dict:  # fmt: skip
    """name -> forward+backward callable, every way on the same weights and input."""
    torch.manual_seed(0)
    module = _modules(mode, cfg, dtype, impls=("persistent",))["persistent"]
    D = 2 if cfg.bidirectional else 1
    x = torch.randn(cfg.T, cfg.batch, cfg.input, device="cuda", dtype=dtype, requires_grad=True)
    gy = torch.randn(cfg.T, cfg.batch, D * cfg.hidden, device="cuda", dtype=dtype)

    def module_step() -> None:
        y, _ = module(x)
        torch.autograd.backward(y, gy)

    def fresh_step() -> None:
        module.zero_grad(set_to_none=True)
        x.grad = None
        module_step()

    def onethread_step() -> None:
        with torch.autograd.set_multithreading_enabled(False):
            fresh_step()

    forward, backward = _layer_passes("persistent", mode, module, x.detach(), gy)

    def layer_step() -> None:
        backward(forward())

    def thread_step() -> None:
        record = forward()
        pool.submit(backward, record).result()

    ways = {"module": lambda: module_step, "fresh": lambda: fresh_step,
            "onethread": lambda: onethread_step, "layer": lambda: layer_step,
            "thread": lambda: thread_step, "graph": lambda: _graphed(module_step)}  # fmt: skip
    return {name: ways[name]() for name in chosen}


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (us in, ms out)."""
    total, end = 0.0, -float("inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total / 1e3


def _profiled(step: Callable[[], None], calls: int = 3) -> dict:
    """Per call under torch.profiler: GPU kernel ms, idle ms inside the GPU's span, the
    persistent kernels' ms, kernel count, and the CUDA calls that may wait (counts)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = [(e.time_range.start, e.time_range.end) for e in gpu]
    busy = _union_ms(spans)
    span = (max(e for _, e in spans) - min(s for s, _ in spans)) / 1e3 if spans else 0.0
    persistent = [e for e in gpu if "_fwd_kernel" in e.name or "_bwd_kernel" in e.name]
    waits = {row.key: row.count / calls for row in prof.key_averages() if _may_wait(row.key)}
    return {
        "kernel_ms": sum(e.time_range.elapsed_us() for e in gpu) / 1e3 / calls,
        "busy_ms": busy / calls,
        "idle_ms": (span - busy) / calls,
        "persistent_ms": sum(e.time_range.elapsed_us() for e in persistent) / 1e3 / calls,
        "persistent_each_us": [round(e.time_range.elapsed_us(), 1) for e in persistent],
        "kernels": len(gpu) // calls,
        "waits": waits,
    }


def _may_wait(name: str) -> bool:
    """A CUDA call after which the host may wait: a synchronize, a blocking copy, an
    allocation or free of device memory, a module load."""
    return "Synchronize" in name or name == "cudaMemcpy" or name.startswith(WAITING_PREFIXES)


def write_cprofile(step: Callable[[], None], path: Path, calls: int = 10) -> None:
    """cProfile of ``calls`` steps (the GPU drained at the end), by own time, into ``path``."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        step()
    torch.cuda.synchronize()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    path.write_text(text.getvalue())


def measure(mode: str, cfg: Config, dtype_name: str, rounds: int, reps: int, out: Path,
            chosen: tuple[str, ...] = WAYS) -> dict:  # fmt: skip
    """One case: interleaved samples, host ms and the profile of each way."""
    with ThreadPoolExecutor(1) as pool:
        ways = _ways(mode, cfg, DTYPES[dtype_name], pool, chosen)
        for step in ways.values():  # compile, resident checks, allocator warm
            for _ in range(3):
                step()
        samples: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(rounds):
            for name, step in ways.items():
                timing = time_calls(step, repeats=reps, warmup=1, device="cuda")
                samples[name].extend(timing.samples_ms)
        row = {"mode": mode, "config": cfg.name, "dtype": dtype_name, "samples_ms": samples}
        row["ms"] = {n: float(np.median(s)) for n, s in samples.items()}
        row["p20_p80"] = {n: np.percentile(s, [20, 80]).tolist() for n, s in samples.items()}
        row["host_ms"] = {n: host_ms(step) for n, step in ways.items()}
        row["profile"] = {n: _profiled(step) for n, step in ways.items()}
        write_cprofile(ways["module"], out / f"cprofile_{mode}_{cfg.name}_{dtype_name}.txt")
    return row


def table(rows: list[dict]) -> str:
    head = ["case", "way", "ms (p20-p80)", "host ms", "kernel ms", "GPU idle ms",
            "persistent ms", "kernels", "waiting calls"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        for way in r["ms"]:
            p, (lo, hi) = r["profile"][way], r["p20_p80"][way]
            waits = ", ".join(f"{k} {v:g}" for k, v in p["waits"].items()) or "-"
            cells = [f"{r['mode']} {r['dtype']} {r['config']}", way,
                     f"{r['ms'][way]:.2f} ({lo:.2f}-{hi:.2f})", f"{r['host_ms'][way]:.2f}",
                     f"{p['kernel_ms']:.2f}", f"{p['idle_ms']:.2f}", f"{p['persistent_ms']:.2f}",
                     str(p["kernels"]), waits]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", default=DEFAULT_CASES, help="mode:dtype:config,...")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"some of {WAYS}")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--time-limit", type=float, default=float("inf"),
                        help="start no case after this many seconds")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("persistent_overhead: needs a CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    args.out.mkdir(parents=True, exist_ok=True)
    rows, start = [], time.monotonic()
    for case in args.cases.split(","):
        if time.monotonic() - start > args.time_limit:
            print(f"time limit: skipped {case}", flush=True)
            continue
        mode, dtype_name, i = case.split(":")
        ways = tuple(args.ways.split(","))
        rows.append(measure(mode, CONFIGS[int(i)], dtype_name, args.rounds, args.reps, args.out,
                            ways))  # fmt: skip
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "samples_ms"}), flush=True)
        (args.out / "overhead.json").write_text(json.dumps(rows, indent=1))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; forward+backward per call")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
