"""GPU measurement (run as a script): the RNN op's memory against cuDNN.

    TRITON_INTERPRET=0 PYTHONPATH=src:. python tests/ops/gpu_rnn_memory.py OUT_DIR

1. Forward+backward of a 2-layer LSTM 650 (T35, batch 20 and 128, fp32): peak bytes
   above the inputs and parameters, and bytes still allocated after the outputs and
   gradients are dropped (what the CUDA Graph cache keeps), for torch.nn.LSTM (cuDNN)
   and mirrorgrad.nn.LSTM (impl="triton", stash and recompute), and the cache's arenas.

The medium LM step's time, eager and compiled, cold compiles and profiles included, is
``gpu_lm_step.py``'s (``gpu_check_rnn.py`` runs both).

Writes OUT_DIR/rnn_memory.json; prints the tables last.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from benchmarks.peak_compare import _replay, _source
from torch import nn

import mirrorgrad.nn as mnn
from mirrorgrad import _compat
from mirrorgrad.ops.rnn import cuda_graphs

MiB = 2**20


def _lstm(kind: str) -> nn.Module:
    if kind == "cudnn":
        return nn.LSTM(650, 650, 2).cuda()
    return mnn.LSTM(650, 650, 2, impl="triton", memory=kind).cuda()


def memory_row(kind: str, batch: int) -> dict:
    torch.manual_seed(0)
    model = _lstm(kind)
    x = torch.randn(35, batch, 650, device="cuda", requires_grad=True)

    def step() -> None:
        y, (h, c) = model(x)
        (y.square().mean() + h.mean() + c.mean()).backward()
        model.zero_grad(set_to_none=True)
        x.grad = None

    step()  # warm: kernels, cuBLAS workspaces, graph capture
    cuda_graphs.clear_graphs()
    step()  # captures again, from a clean cache
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    _compat.record_memory_history(True, max_entries=200_000)  # Python frames only
    try:
        step()
        torch.cuda.synchronize()
        at_peak = _alive_at_peak(_compat.memory_snapshot())
    finally:
        _compat.record_memory_history(False)
    before_timing = cuda_graphs.counts()
    row = {
        "kind": kind,
        "batch": batch,
        "peak_MiB": (torch.cuda.max_memory_allocated() - start) / MiB,
        "retained_MiB": (torch.cuda.memory_allocated() - start) / MiB,
        "graph_cache_MiB": cuda_graphs.held_bytes() / MiB,
        "arenas_MiB": {name: a.numel() / MiB for (_, name), a in cuda_graphs._ARENAS.items()},
        "step_ms": _median_ms(step),
        "alive_at_peak_MiB": at_peak,
    }
    # Calls of the timed steps that captured or ran uncaptured: 0 once the loop's
    # allocations repeat (cuda_graphs.py finds its entries by the outputs' addresses).
    after = cuda_graphs.counts()
    row["timed_misses"] = {k: after[k] - before_timing[k] for k in ("captures", "uncaptured")}
    cuda_graphs.clear_graphs()
    return row


def _alive_at_peak(snapshot: dict, top: int = 10) -> dict[str, float]:
    """MiB alive at the step's peak by the line that allocated it (peak_compare's replay
    of the allocator's history); "before the recording": held from earlier steps."""
    peak, _, blocks = _replay(snapshot, torch.cuda.current_device())
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    by_source: dict[str, float] = {}
    for size, at in blocks.values():
        source = _source(trace[at]) if at >= 0 else "before the recording"
        by_source[source] = by_source.get(source, 0.0) + size / MiB
    ranked = sorted(by_source.items(), key=lambda kv: -kv[1])
    return {"peak (all alive)": peak / MiB, **dict(ranked[:top])}


def _median_ms(step, repeats: int = 10) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main(out_dir: str) -> None:
    memory = [memory_row(k, b) for b in (20, 128) for k in ("cudnn", "stash", "recompute")]
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    result = {"device": device, "torch": torch.__version__, "memory": memory}
    (Path(out_dir) / "rnn_memory.json").write_text(json.dumps(result, indent=2))
    print(f"\n{device}, torch {torch.__version__}")
    print(f"{'kind':>10} {'batch':>5} {'peak MiB':>9} {'graph cache MiB':>16} {'peak+cache':>11}"
          f" {'/ cuDNN':>8} {'step ms':>8} {'misses':>6}  arenas MiB")  # fmt: skip
    cudnn = {r["batch"]: r["peak_MiB"] for r in memory if r["kind"] == "cudnn"}
    for r in memory:
        total = r["peak_MiB"] + r["graph_cache_MiB"]
        arenas = ", ".join(f"{k} {v:.1f}" for k, v in r["arenas_MiB"].items())
        ratio = total / cudnn[r["batch"]]
        print(f"{r['kind']:>10} {r['batch']:>5} {r['peak_MiB']:>9.1f} "
              f"{r['graph_cache_MiB']:>16.1f} {total:>11.1f} {ratio:>7.2f}x "
              f"{r['step_ms']:>8.2f} {sum(r['timed_misses'].values()):>6}  {arenas}")  # fmt: skip
    for r in memory:
        if r["batch"] == 128:
            print(f"\nalive at the peak, {r['kind']} B128 (MiB by allocating line):")
            for source, mib in r["alive_at_peak_MiB"].items():
                print(f"  {mib:8.1f}  {source[:110]}")


if __name__ == "__main__":
    if len(sys.argv) != 2 or not torch.cuda.is_available():
        sys.exit("usage (needs CUDA): python tests/ops/gpu_rnn_memory.py OUT_DIR")
    main(sys.argv[1])
