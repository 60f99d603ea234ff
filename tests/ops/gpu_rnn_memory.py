"""GPU measurement (run as a script): the RNN op's memory against cuDNN, and eager vs
compiled step time of the medium word LM.

    TRITON_INTERPRET=0 PYTHONPATH=src python tests/ops/gpu_rnn_memory.py OUT_DIR

1. Forward+backward of a 2-layer LSTM 650 (T35, batch 20 and 128, fp32): peak bytes
   above the inputs and parameters, and bytes still allocated after the outputs and
   gradients are dropped (what the CUDA Graph cache keeps), for torch.nn.LSTM (cuDNN)
   and mirrorgrad.nn.LSTM (impl="triton", stash and recompute).
2. The medium LM training step (embedding 650, LSTM 2x650, dropout 0.5, vocab 10k,
   batch 20, BPTT 35, SGD with clip 0.25): median ms per step, eager and compiled.
3. One profiled step of mirrorgrad.nn.LSTM's LM, eager and torch.compile: host-device
   syncs, kernel launches and the host ops that cost most (why compiled is slower).

Writes OUT_DIR/rnn_memory.json; prints the tables last.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

import mirrorgrad
import mirrorgrad.nn as mnn
from mirrorgrad.nn.functional import linear_cross_entropy
from mirrorgrad.ops.rnn import graphs

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
    graphs.clear_graphs()
    step()  # captures again, from a clean cache
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    row = {
        "kind": kind,
        "batch": batch,
        "peak_MiB": (torch.cuda.max_memory_allocated() - start) / MiB,
        "retained_MiB": (torch.cuda.memory_allocated() - start) / MiB,
        "graph_cache_MiB": graphs.held_bytes() / MiB,
    }
    graphs.clear_graphs()
    return row


class _Lm(nn.Module):
    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.encoder, self.rnn = nn.Embedding(10_000, 650), rnn
        self.drop = nn.Dropout(0.5)
        self.decoder = nn.Linear(650, 10_000)

    def forward(self, tokens, targets, state):
        out, state = self.rnn(self.drop(self.encoder(tokens)), state)
        out = self.drop(out)
        return linear_cross_entropy(out, self.decoder.weight, self.decoder.bias, targets), state


def _lm_step(rnn: nn.Module, wrap):
    """A closure running one medium-LM training step (the state carried, detached)."""
    torch.manual_seed(0)
    model = _Lm(rnn).cuda()
    run = wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    tokens = torch.randint(0, 10_000, (35, 20), device="cuda")
    targets = torch.randint(0, 10_000, (35, 20), device="cuda")
    state = [(torch.zeros(2, 20, 650, device="cuda"), torch.zeros(2, 20, 650, device="cuda"))]

    def step() -> None:
        loss, new_state = run(tokens, targets, state[0])
        state[0] = tuple(s.detach() for s in new_state)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        opt.step()

    return step


def step_time_row(name: str, rnn: nn.Module, wrap, steps: int = 50) -> dict:
    step = _lm_step(rnn, wrap)
    first = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = time.perf_counter() - first
    times = []
    for i in range(steps + 5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end))
    return {"step": name, "ms": statistics.median(times), "first_step_s": first}


def profile_row(name: str, wrap) -> dict:
    """Host-device syncs, launches and the costliest host ops of one warm step."""
    from torch.profiler import ProfilerActivity, profile

    step = _lm_step(mnn.LSTM(650, 650, 2, dropout=0.5), wrap)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.key_averages()

    def count(*names: str) -> int:
        return sum(e.count for e in events if any(n in e.key for n in names))

    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]
    return {
        "step": name,
        "syncs": count("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"),
        "d2h_copies": count("Memcpy DtoH", "aten::item", "aten::_local_scalar_dense"),
        "launches": count("cudaLaunchKernel", "cuLaunchKernel"),
        "graph_launches": count("cudaGraphLaunch"),
        "top_host_ops": [(e.key, round(e.self_cpu_time_total / 1e3, 3)) for e in top],
    }


def main(out_dir: str) -> None:
    memory = [memory_row(k, b) for b in (20, 128) for k in ("cudnn", "stash", "recompute")]
    def lstm(cls):
        return cls(650, 650, 2, dropout=0.5)

    timing = [
        step_time_row("torch.nn.LSTM eager", lstm(nn.LSTM), lambda m: m),
        step_time_row("mirrorgrad.nn.LSTM eager", lstm(mnn.LSTM), lambda m: m),
        step_time_row("mirrorgrad.nn.LSTM torch.compile", lstm(mnn.LSTM), torch.compile),
        step_time_row("mirrorgrad.nn.LSTM mirrorgrad.compile", lstm(mnn.LSTM), mirrorgrad.compile),
    ]
    profiles = [profile_row("eager", lambda m: m), profile_row("torch.compile", torch.compile)]
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    result = {"device": device, "torch": torch.__version__, "memory": memory, "timing": timing,
              "profile": profiles}  # fmt: skip
    (Path(out_dir) / "rnn_memory.json").write_text(json.dumps(result, indent=2))
    print(f"\n{device}, torch {torch.__version__}")
    print(f"{'kind':>10} {'batch':>5} {'peak MiB':>9} {'retained MiB':>13} {'graph cache MiB':>16}")
    for r in memory:
        print(f"{r['kind']:>10} {r['batch']:>5} {r['peak_MiB']:>9.1f} {r['retained_MiB']:>13.1f} "
              f"{r['graph_cache_MiB']:>16.1f}")  # fmt: skip
    for r in profiles:
        print(f"\n{r['step']}: syncs {r['syncs']}, D2H {r['d2h_copies']}, launches "
              f"{r['launches']}, graph launches {r['graph_launches']}; top host ms:")
        print("  " + ", ".join(f"{k} {ms}" for k, ms in r["top_host_ops"]))
    print(f"\n{'medium LM step':<40} {'ms':>7} {'first step s':>13}")
    for r in timing:
        print(f"{r['step']:<40} {r['ms']:>7.2f} {r['first_step_s']:>13.1f}")


if __name__ == "__main__":
    if len(sys.argv) != 2 or not torch.cuda.is_available():
        sys.exit("usage (needs CUDA): python tests/ops/gpu_rnn_memory.py OUT_DIR")
    main(sys.argv[1])
