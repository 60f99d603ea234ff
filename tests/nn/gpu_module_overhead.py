"""GPU measurement (run as a script): what mirrorgrad.nn adds to the op's kernels, and
its peak memory against cuDNN.

    TRITON_INTERPRET=0 PYTHONPATH=src:. python tests/nn/gpu_module_overhead.py OUT_DIR \
        [--quick] [--modes lstm,gru] [--no-memory]

1. Time, forward+backward (CUDA events, median): ``torch.nn.LSTM`` (cuDNN), the
   per-layer kernels driven directly (``_kernel_forward`` of benchmarks/rnn_kernels.py,
   what its ``kernel-*`` methods run) and ``mirrorgrad.nn.LSTM(impl="triton")`` with the
   same memory mode, plus the module with its defaults (``impl="auto"``). Also the host's
   own time per step (launching 20 steps, no sync inside, over 20) and a cProfile of the
   module's steps (OUT_DIR/cprofile_<config>.txt: where the host time goes).
2. Memory, 2x650 LSTM at T 35 (lstm-lm-medium's stack), batch 20 and 128, fp32: peak
   above the inputs and parameters, what stays allocated after the step (the CUDA Graph
   cache) and the cache's own account (``cuda_graphs.held``, by arena and entry).

Writes OUT_DIR/module_overhead.json; prints the tables last.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from benchmarks import rnn_kernels
from benchmarks.persistent_overhead import write_cprofile
from torch import nn

import mirrorgrad.nn as mnn
from mirrorgrad._timing import host_ms, time_calls
from mirrorgrad.ops.rnn import cuda_graphs, dispatch

# One memory measurement for both GPU scripts: tests/ops/gpu_rnn_memory.py's.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ops"))
from gpu_rnn_memory import memory_row

MiB = 2**20
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (mode, layers, input = hidden, batch, T, dtype)
CONFIGS = [("lstm", 2, 650, 20, 35, "fp32"), ("lstm", 2, 650, 20, 35, "bf16"),
           ("lstm", 4, 1024, 128, 50, "bf16"), ("gru", 2, 650, 20, 35, "bf16"),
           ("gru", 4, 1024, 128, 50, "bf16")]  # fmt: skip
MODULES = {"lstm": (nn.LSTM, mnn.LSTM), "gru": (nn.GRU, mnn.GRU)}


def _inputs(layers, hidden, batch, T, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, batch, hidden, device="cuda", dtype=dtype, generator=g)
    h0 = torch.randn(layers, batch, hidden, device="cuda", dtype=dtype, generator=g)
    c0 = torch.randn(layers, batch, hidden, device="cuda", dtype=dtype, generator=g)
    gy = torch.randn(T, batch, hidden, device="cuda", dtype=dtype, generator=g)
    return x, h0, c0, gy


def _steps(mode, layers, hidden, batch, T, dtype):
    """name -> forward+backward callable, all on the same weights."""
    torch_class, ours = MODULES[mode]
    reference = torch_class(hidden, hidden, layers).cuda().to(dtype)
    x, h0, c0, gy = _inputs(layers, hidden, batch, T, dtype)
    xg = x.detach().requires_grad_()
    hx = (h0, c0) if mode == "lstm" else h0

    def module(**options):
        m = ours(hidden, hidden, layers, **options).cuda().to(dtype)
        m.load_state_dict(reference.state_dict())
        return lambda: m(xg, hx)[0]

    def direct(memory):
        return lambda: rnn_kernels._kernel_forward(reference, mode, {"memory": memory}, xg, hx)[0]

    forwards = {
        "cudnn": lambda: reference(xg, hx)[0],
        "kernels-recompute": direct("recompute"),
        "module-recompute": module(impl="triton", memory="recompute"),
        "kernels-stash": direct("stash"),
        "module-stash": module(impl="triton", memory="stash"),
        "module-auto": module(),
    }

    def step(forward):
        def run():
            forward().backward(gy)

        return run

    return {name: step(f) for name, f in forwards.items()}


def overhead_rows(out: Path, reps: int, modes: list[str]) -> list[dict]:
    rows = []
    for mode, layers, hidden, batch, T, dt in CONFIGS:
        if mode not in modes:
            continue
        name = f"{mode}-L{layers}-H{hidden}-B{batch}-T{T}-{dt}"
        steps = _steps(mode, layers, hidden, batch, T, DTYPES[dt])
        row = {"config": name}
        for method, step in steps.items():
            timing = time_calls(step, repeats=reps, warmup=3, device="cuda")
            row[method] = timing.median_ms
            row[f"{method} host"] = host_ms(step, n=20)
        write_cprofile(steps["module-recompute"], out / f"cprofile_{name}.txt", calls=20)
        cuda_graphs.clear_graphs()
        rows.append(row)
        print(name, {k: round(v, 3) for k, v in row.items() if k != "config"}, flush=True)
        (out / "overhead_rows.json").write_text(json.dumps(rows, indent=2))  # if cut short
    return rows


def main(out: Path, quick: bool, modes: list[str], memory_too: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    # Both sides in TF32 in fp32, as the benchmark runs them (cuDNN's default).
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32
    if quick:
        CONFIGS[:] = CONFIGS[:1]
    rows = overhead_rows(out, reps=10 if quick else 20, modes=modes)
    kinds = ("cudnn", "stash", "recompute")
    memory = [memory_row(k, b) for b in (20, 128) for k in kinds] if memory_too else []
    device = torch.cuda.get_device_name()
    picks = {str(key): {"picked": impl, "ms": dispatch.AUTO_TIMES.get(key)}
             for key, impl in dispatch._AUTO_CHOICE.items()}  # fmt: skip
    result = {"device": device, "torch": torch.__version__, "overhead": rows, "memory": memory,
              "auto_picks": picks}  # fmt: skip
    (out / "module_overhead.json").write_text(json.dumps(result, indent=2))
    print(f"\n{device}, torch {torch.__version__}; ms per forward+backward (host ms)")
    methods = [k for k in rows[0] if k != "config" and not k.endswith(" host")]
    print("| config | " + " | ".join(methods) + " | module/kernels recompute | stash |")
    for r in rows:
        cells = [f"{r[m]:.2f} ({r[m + ' host']:.2f})" for m in methods]
        ratio = [r[f"module-{m}"] / r[f"kernels-{m}"] for m in ("recompute", "stash")]
        print(f"| {r['config']} | " + " | ".join(cells) + f" | {ratio[0]:.3f} | {ratio[1]:.3f} |")
    for key, pick in picks.items():
        print(f"impl='auto' picked {pick['picked']} for {key}: {pick['ms']}")
    print("\n| kind | batch | peak MiB | retained MiB | graph cache MiB | arenas MiB |")
    for r in memory:
        arenas = ", ".join(f"{k} {v:.1f}" for k, v in r["arenas_MiB"].items())
        print(f"| {r['kind']} | {r['batch']} | {r['peak_MiB']:.1f} | {r['retained_MiB']:.1f} | "
              f"{r['graph_cache_MiB']:.1f} | {arenas} |")  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) < 2 or not torch.cuda.is_available():
        sys.exit("usage (needs CUDA): python tests/nn/gpu_module_overhead.py OUT_DIR [--quick]")
    args = sys.argv[2:]
    modes = args[args.index("--modes") + 1].split(",") if "--modes" in args else ["lstm"]
    main(Path(sys.argv[1]), "--quick" in args, modes, "--no-memory" not in args)
