"""GPU measurement for the cells' ``impl="auto"``: torch.nn's cell against mirrorgrad's op
with one step, forward+backward of a 20-step loop, per mode, dtype and shape.

    PYTHONPATH=src python tests/nn/gpu_cells_compare.py OUT_DIR

Checks first that both give the same outputs and gradients (float32, a loose tolerance
for TF32/bf16 kernels), then times each (median of CUDA-event timings) and prints a
table; writes OUT_DIR/cells.json with GPU name, torch version and every row.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

import mirrorgrad.nn as mnn

MODES = {"lstm": mnn.LSTMCell, "gru": mnn.GRUCell, "rnn_tanh": mnn.RNNCell}
SHAPES = [(16, 256, 256), (64, 512, 512), (128, 1024, 1024), (256, 1024, 2048)]  # (B, I, H)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
STEPS = 20


def loop(cell: torch.nn.Module, xs: torch.Tensor, lstm: bool):
    h = c = None
    outs = []
    for x in xs:
        if lstm:
            h, c = cell(x, None if h is None else (h, c))
        else:
            h = cell(x, h)
        outs.append(h)
    return torch.stack(outs)


def run(cell, xs, lstm):
    y = loop(cell, xs, lstm)
    grads = torch.autograd.grad(y.float().square().mean(), [xs, *cell.parameters()])
    return y, grads


def median_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(mode: str, dtype_name: str, batch: int, n_in: int, hidden: int) -> dict:
    """Same outputs and gradients first, then the median time of each impl."""
    cls, dtype, lstm = MODES[mode], DTYPES[dtype_name], mode == "lstm"
    cells = {impl: cls(n_in, hidden, device="cuda", dtype=dtype, impl=impl)
             for impl in ("torch", "op")}  # fmt: skip
    cells["op"].load_state_dict(cells["torch"].state_dict())
    xs = torch.randn(STEPS, batch, n_in, device="cuda", dtype=dtype, requires_grad=True)
    ref, ref_grads = run(cells["torch"], xs, lstm)
    out, grads = run(cells["op"], xs, lstm)
    err = max((a.float() - b.float()).abs().max().item()
              for a, b in zip((ref, *ref_grads), (out, *grads)))  # fmt: skip
    ms = {impl: median_ms(lambda c=c: run(c, xs, lstm)) for impl, c in cells.items()}
    return {"mode": mode, "dtype": dtype_name, "B": batch, "I": n_in, "H": hidden,
            "torch_ms": ms["torch"], "op_ms": ms["op"], "op_over_torch": ms["op"] / ms["torch"],
            "max_abs_diff": err}  # fmt: skip


def main(out_dir: Path) -> None:
    rows = [measure(mode, dtype, *shape) for mode in MODES for dtype in DTYPES for shape in SHAPES]
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "steps": STEPS}
    (out_dir / "cells.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    print(f"{meta['gpu']}, torch {meta['torch']}, {STEPS}-step loop, forward+backward")
    print(f"{'mode':9}{'dtype':6}{'B':>5}{'I':>6}{'H':>6}{'torch ms':>10}{'op ms':>9}"
          f"{'op/torch':>10}{'max diff':>10}")  # fmt: skip
    for r in rows:
        print(f"{r['mode']:9}{r['dtype']:6}{r['B']:>5}{r['I']:>6}{r['H']:>6}"
              f"{r['torch_ms']:>10.3f}{r['op_ms']:>9.3f}{r['op_over_torch']:>10.2f}"
              f"{r['max_abs_diff']:>10.1e}")  # fmt: skip


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "cells-out"))
