"""GPU measurement (run as a script): how often the RNN op's loop calls find a captured
entry (cuda_graphs.py replays an entry only where this call's fresh outputs and inputs lie at
the addresses it was captured with), by the shape of the training loop.

    TRITON_INTERPRET=0 PYTHONPATH=src python tests/ops/gpu_replay_rate.py OUT_DIR

2-layer LSTM 650, T35, batch 20, fp32, stash, 12 steps of SGD per loop shape:
- "step function": the bench runner's shape (all of a step's tensors die at its return);
- "loop variables": ``out``/``loss`` are loop variables, alive into the next step's
  forward (a plain ``for`` loop);
- "kept outputs": every 3rd step's output is appended to a list that is never cleared
  (the allocator's free space changes every step).
Prints per loop shape the loop calls that missed (captured or ran uncaptured) in each
step, and the median step ms of the last 6; writes OUT_DIR/replay_rate.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

import mirrorgrad.nn as mnn
from mirrorgrad.ops.rnn import cuda_graphs


def _misses() -> int:
    counts = cuda_graphs.counts()
    return counts["captures"] + counts["uncaptured"]


def run(shape: str, steps: int = 12) -> dict:
    torch.manual_seed(0)
    model = mnn.LSTM(650, 650, 2, impl="triton", memory="stash").cuda()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [torch.randn(35, 20, 650, device="cuda") for _ in range(4)]
    cuda_graphs.clear_graphs()
    kept, per_step, times, before = [], [], [], 0

    def step(x):
        model(x)[0].square().mean().backward()
        sgd.step()
        sgd.zero_grad(set_to_none=True)

    out = loss = None
    for i in range(steps):
        x = batches[i % len(batches)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        if shape == "step function":
            step(x)
        else:
            out = model(x)[0]
            loss = out.square().mean()
            loss.backward()
            sgd.step()
            sgd.zero_grad(set_to_none=True)
            if shape == "kept outputs" and i % 3 == 0:
                kept.append(out)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
        per_step.append(_misses() - before)
        before = _misses()
    del out, loss, kept
    result = {"shape": shape, "misses_per_step": per_step, "counts": cuda_graphs.counts(),
              "ms_last6": sorted(times[-6:])[3]}  # fmt: skip
    cuda_graphs.clear_graphs()
    return result


def main(out_dir: str) -> None:
    rows = [run(shape) for shape in ("step function", "loop variables", "kept outputs")]
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "replay_rate.json").write_text(json.dumps(rows, indent=2))
    print(f"\n{'loop shape':16} {'ms':>6}  misses per step (4 loop calls each)")
    for r in rows:
        print(f"{r['shape']:16} {r['ms_last6']:6.2f}  {r['misses_per_step']}  {r['counts']}")


if __name__ == "__main__":
    if len(sys.argv) != 2 or not torch.cuda.is_available():
        sys.exit("usage (needs CUDA): python tests/ops/gpu_replay_rate.py OUT_DIR")
    main(sys.argv[1])
