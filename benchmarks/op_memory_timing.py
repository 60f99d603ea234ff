"""What the RNN op's memory mode costs on this GPU: forward and backward time, stash vs recompute.

``python benchmarks/op_memory_timing.py --out DIR``: per size (mode, layers x hidden,
batch, steps, directions) a ``mirrorgrad.nn`` RNN with ``memory="stash"`` and one with
``"recompute"`` (same weights), timed in alternating rounds (the order flips each round,
so drift of clocks and host load hits both modes alike). Each step is timed by three
CUDA events: before the forward, between forward and backward, after the backward; so
the two phases are parts of one step, as in training (a forward timed on its own, as
before, ran without its backward's allocations and gave forward times apart by 2x
between modes). Medians over all rounds. Also the planner's estimates of the same: the
op's forward and backward calls as the cost model prices them (the op's time formula,
ops/rnn/time_model.py's rule for the split Triton kernels: ``priced``) and the GEMMs alone at
this GPU's rates (``gemm_ms_est``), so the cost model that balance mode's cap reads can
be checked; ``ops/rnn/time_model.py`` refits ``RECOMPUTE_EXTRA`` and ``FORWARD_SHARE`` from it.
Writes ``op_memory_timing.json``; prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

# (mode, layers, hidden, batch, steps, directions): the suite's LMs (2x650, 2x1500, BPTT
# 35), their batch-128 variants, deepspeech2's biGRU layer (T 150, B 32), and sizes in
# between, so that the rule's four features vary apart.
SIZES = (
    ("lstm", 2, 650, 20, 35, 1),
    ("lstm", 2, 650, 128, 35, 1),
    ("lstm", 2, 1500, 20, 35, 1),
    ("lstm", 2, 1500, 64, 35, 1),
    ("lstm", 1, 1024, 64, 50, 1),
    ("lstm", 4, 1024, 128, 50, 1),
    ("lstm", 2, 256, 32, 100, 1),
    ("lstm", 1, 1000, 80, 50, 2),
    ("gru", 2, 650, 20, 35, 1),
    ("gru", 1, 800, 32, 150, 2),
    ("gru", 2, 1024, 64, 50, 1),
)
MEMORY = ("stash", "recompute")


def _module(mode: str, layers: int, hidden: int, directions: int, memory: str, device: str):
    import mirrorgrad.nn

    cls = {"lstm": mirrorgrad.nn.LSTM, "gru": mirrorgrad.nn.GRU}[mode]
    torch.manual_seed(0)
    # The split Triton kernels, whose constants the times refit (auto might take cuDNN).
    impl = "triton" if device == "cuda" else "auto"
    return cls(hidden, hidden, layers, bidirectional=directions == 2, memory=memory,
               impl=impl).to(device)  # fmt: skip


def _phases(rnn, x: torch.Tensor, device: str) -> tuple[float, float]:
    """(forward ms, backward ms) of one step; wall ms off CUDA."""
    params = list(rnn.parameters())

    def backward(y, h) -> None:
        torch.autograd.grad(y.sum() + h.sum(), params)

    if device != "cuda":
        import time

        t0 = time.perf_counter()
        y, h = rnn(x)
        t1 = time.perf_counter()
        backward(y, h[0] if isinstance(h, tuple) else h)
        t2 = time.perf_counter()
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3
    events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    events[0].record()
    y, h = rnn(x)
    events[1].record()
    backward(y, h[0] if isinstance(h, tuple) else h)
    events[2].record()
    torch.cuda.synchronize()
    return events[0].elapsed_time(events[1]), events[1].elapsed_time(events[2])


def _time(size: tuple, device: str, rounds: int, per_round: int) -> dict[str, dict]:
    """Per memory mode: median forward and backward ms over alternating rounds."""
    mode, layers, hidden, batch, steps, directions = size
    rnns = {m: _module(mode, layers, hidden, directions, m, device) for m in MEMORY}
    x = torch.randn(steps, batch, hidden, device=device)
    for rnn in rnns.values():
        for _ in range(3):  # kernels compile, loops are captured, impl="auto" times
            _phases(rnn, x, device)
    samples = {m: ([], []) for m in MEMORY}
    for r in range(rounds):
        for memory in MEMORY if r % 2 == 0 else MEMORY[::-1]:
            for _ in range(per_round):
                fwd, bwd = _phases(rnns[memory], x, device)
                samples[memory][0].append(fwd)
                samples[memory][1].append(bwd)
    return {
        m: {"forward_ms": statistics.median(f), "backward_ms": statistics.median(b),
            "step_ms": statistics.median(a + b for a, b in zip(f, b))}
        for m, (f, b) in samples.items()
    }  # fmt: skip


def _estimate(size: tuple, device: str) -> dict:
    """The cost model's price of the op's calls (ms per memory mode and phase), and of its
    forward GEMMs at this GPU's rates."""
    from mirrorgrad.graph.cost import rates_for
    from mirrorgrad.ops.rnn import time_model
    from mirrorgrad.ops.rnn.cell_modes import GATES
    from mirrorgrad.ops.rnn.op import _stack_flops

    mode, layers, hidden, batch, steps, directions = size
    shape = time_model.Shape(mode=mode, T=steps, B=batch, H=hidden, layers=layers,
                       directions=directions)  # fmt: skip
    priced = {
        memory: {f"{phase}_ms": time_model.phase_ms("triton", memory, torch.float32, shape,
                                              backward=phase == "backward")
                 for phase in ("forward", "backward")}
        for memory in MEMORY
    }  # fmt: skip
    rates = rates_for(torch.device(device))
    gh = GATES[mode] * hidden
    weights = []
    for layer in range(layers):
        n_in = hidden if layer == 0 else directions * hidden
        weights += [(gh, n_in), (gh, hidden)] * directions  # no biases needed
    flops = _stack_flops((steps, batch, hidden), weights, (layers * directions, batch, hidden),
                         mode, layers, directions == 2, False, 0)  # fmt: skip
    return {"gemm_ms_est": flops / rates.matmul_flops_per_s * 1e3, "priced": priced}


def _line(row: dict) -> str:
    stash, recompute, priced = row["stash"], row["recompute"], row["priced"]
    added = recompute["step_ms"] - stash["step_ms"]
    priced_added = priced["recompute"]["backward_ms"] - priced["stash"]["backward_ms"]
    bi = "bi" if row["directions"] == 2 else ""
    return (f"{row['mode']} {row['layers']}x{row['hidden']}{bi} B{row['batch']} T{row['T']}: "
            f"stash {stash['forward_ms']:.3f} + {stash['backward_ms']:.3f} ms, recompute "
            f"{recompute['forward_ms']:.3f} + {recompute['backward_ms']:.3f} ms: recompute adds "
            f"{added:+.3f} ms per step (priced {priced_added:+.3f}; GEMMs alone "
            f"{row['gemm_ms_est']:.3f})")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4, help="steps per mode and round")
    args = parser.parse_args(argv)
    torch.set_float32_matmul_precision("high")
    rows = []
    args.out.mkdir(parents=True, exist_ok=True)
    for size in SIZES:
        mode, layers, hidden, batch, steps, directions = size
        row = {"mode": mode, "layers": layers, "hidden": hidden, "batch": batch, "T": steps,
               "directions": directions}  # fmt: skip
        row |= _time(size, args.device, args.rounds, args.steps)
        row |= _estimate(size, args.device)
        rows.append(row)
        print(_line(row), flush=True)
        # written after every size: a run stopped by its time limit keeps what it measured
        (args.out / "op_memory_timing.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
