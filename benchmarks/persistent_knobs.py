"""The persistent kernel's knobs at one LSTM stack's shape, captured as users capture it.

    PYTHONPATH=src python benchmarks/persistent_knobs.py [--layers 2] [--input 656]
        [--hidden 650] [--batch 128] [--steps 35] [--dtype fp32] [--repeats 20]

``mirrorgrad.nn.LSTM(impl="persistent")`` forward+backward captured in one CUDA Graph
under each ``PersistentTuning`` variant of ``VARIANTS`` (the layout each gives: programs,
batch groups, units and rows per tile, W resident or streamed), beside ``torch.nn.LSTM``
(cuDNN) and ``impl="triton"`` captured the same way; TF32 on in fp32 on both sides.
Median ms of ``--repeats`` replays. The defaults are the word LM's stack at batch 128
(its first layer's input stored 656 wide). The table comes last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from mirrorgrad._timing import time_calls
from mirrorgrad.bench.rnn_modules import Config
from mirrorgrad.ops.rnn import persistent_plan
from mirrorgrad.ops.rnn.tuning import PersistentTuning, tuned

# Run as a script, the repository root is not on the path: its sibling comes from there.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.persistent_rnn import _graphed, _module_step, _modules

VARIANTS: tuple[dict, ...] = (
    {},
    {"resident_bytes": 200 * 1024},
    {"resident_bytes": 200 * 1024, "bwd_resident_split": 4},
    {"block_n": 32},
    {"bwd_block_k": 128, "bwd_split_k": 4},
    {"bwd_block_k": 128, "bwd_split_k": 8},
    {"bwd_block_k": 512, "bwd_split_k": 16},
    {"bwd_num_warps": 16},
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _ms(step, repeats: int) -> float:
    try:
        return time_calls(_graphed(step), repeats=repeats, warmup=3, device="cuda").median_ms
    except Exception as e:  # a variant that does not compile or launch: its row says so
        print(f"  failed: {e!r:.300}", flush=True)
        return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--input", type=int, default=656)
    parser.add_argument("--hidden", type=int, default=650)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=35, help="sequence length T")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    cfg = Config(layers=args.layers, input=args.input, hidden=args.hidden, batch=args.batch,
                 T=args.steps)  # fmt: skip
    dtype = DTYPES[args.dtype]
    modules = _modules("lstm", cfg, dtype, impls=("persistent", "triton"))
    x = torch.randn(cfg.T, cfg.batch, cfg.input, device="cuda", dtype=dtype, requires_grad=True)
    gy = torch.randn(cfg.T, cfg.batch, cfg.hidden, device="cuda", dtype=dtype)
    rows = [(name, "", _ms(_module_step(modules[name], x, gy), args.repeats))
            for name in ("cudnn", "triton")]  # fmt: skip
    for variant in VARIANTS:
        knobs = PersistentTuning(**variant)
        p = persistent_plan.plan("lstm", cfg.batch, cfg.hidden, dtype, x.device, knobs)
        layout = (f"{p.programs} programs x {p.groups} groups, {p.bn} units, {p.bb} rows, "
                  f"{'resident' if p.resident else 'streamed'}" if p else "not run")  # fmt: skip
        with tuned(knobs):
            ms = _ms(_module_step(modules["persistent"], x, gy), args.repeats)
        rows.append((f"persistent {variant or 'defaults'}", layout, ms))
        print(f"{rows[-1][0]}: {ms:.3f} ms [{layout}]", flush=True)
    print(f"\n{torch.cuda.get_device_name()}, {cfg.name}, {args.dtype}, graphed fwd+bwd")
    print("| method | layout | ms | vs cuDNN |\n|---|---|---:|---:|")
    for name, layout, ms in rows:
        print(f"| {name} | {layout} | {ms:.3f} | {rows[0][2] / ms:.2f}x |")


if __name__ == "__main__":
    main()
