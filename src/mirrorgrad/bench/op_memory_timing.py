"""What the RNN op's memory mode costs on this GPU: forward and backward time, stash vs recompute.

``python -m mirrorgrad.bench.op_memory_timing --out DIR``: per size (layers x hidden,
batch, BPTT 35) a ``mirrorgrad.nn.LSTM`` with ``memory="stash"`` and ``"recompute"``,
median of 20 calls after 3 warm-ups (CUDA events), and the planner's own estimates of
the same: the op's forward and backward calls as the cost model prices them (the op's
time formula, ops/rnn/cost.py's rule for the split Triton kernels: ``priced``) and the
GEMMs alone at this GPU's rates (``gemm_ms_est``, the roofline that priced it before),
so the cost model that balance mode's cap reads can be checked.
Writes ``op_memory_timing.json``; prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

SIZES = ((2, 650, 20), (2, 1500, 20), (2, 650, 128))
BPTT = 35


def _time(layers: int, hidden: int, batch: int, memory: str, device: str) -> dict[str, float]:
    import mirrorgrad.nn
    from mirrorgrad._timing import time_calls

    torch.manual_seed(0)
    rnn = mirrorgrad.nn.LSTM(hidden, hidden, layers, memory=memory).to(device)
    x = torch.randn(BPTT, batch, hidden, device=device)

    def forward() -> None:
        rnn(x)

    def step() -> None:
        y, (h, _) = rnn(x)
        torch.autograd.grad(y.sum() + h.sum(), list(rnn.parameters()))

    fwd = time_calls(forward, repeats=20, warmup=3, device=device).median_ms
    both = time_calls(step, repeats=20, warmup=3, device=device).median_ms
    return {"forward_ms": fwd, "backward_ms": both - fwd}


def _estimate(layers: int, hidden: int, batch: int, device: str) -> dict:
    """The cost model's price of the op's calls (ms per memory mode and phase), and of its
    forward GEMMs at this GPU's rates."""
    from mirrorgrad.graph.cost import rates_for
    from mirrorgrad.ops.rnn import cost
    from mirrorgrad.ops.rnn.op import _stack_flops

    shape = cost.Shape(mode="lstm", T=BPTT, B=batch, H=hidden, layers=layers, directions=1)
    priced = {
        memory: {f"{phase}_ms": cost.phase_ms("triton", memory, torch.float32, shape,
                                              backward=phase == "backward")
                 for phase in ("forward", "backward")}
        for memory in ("stash", "recompute")
    }  # fmt: skip

    rates = rates_for(torch.device(device))
    weights = [(4 * hidden, hidden), (4 * hidden, hidden)] * layers  # no biases needed
    flops = _stack_flops((BPTT, batch, hidden), weights, (layers, batch, hidden), "lstm",
                         layers, False, False, 0)  # fmt: skip
    return {"gemm_ms_est": flops / rates.matmul_flops_per_s * 1e3, "priced": priced}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    torch.set_float32_matmul_precision("high")
    rows = []
    for layers, hidden, batch in SIZES:
        row = {"layers": layers, "hidden": hidden, "batch": batch}
        for memory in ("stash", "recompute"):
            row[memory] = _time(layers, hidden, batch, memory, args.device)
        row |= _estimate(layers, hidden, batch, args.device)
        rows.append(row)
        added = row["recompute"]["backward_ms"] - row["stash"]["backward_ms"]
        priced = row["priced"]
        priced_added = priced["recompute"]["backward_ms"] - priced["stash"]["backward_ms"]
        print(f"{layers}x{hidden} B{batch}: forward {row['stash']['forward_ms']:.3f} ms "
              f"(priced {priced['stash']['forward_ms']:.3f}), backward stash "
              f"{row['stash']['backward_ms']:.3f} / recompute {row['recompute']['backward_ms']:.3f}"
              f" ms (priced {priced['stash']['backward_ms']:.3f} / "
              f"{priced['recompute']['backward_ms']:.3f}): recompute adds {added:.3f} ms "
              f"(priced {priced_added:.3f}; GEMMs alone {row['gemm_ms_est']:.3f})",
              flush=True)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "op_memory_timing.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
