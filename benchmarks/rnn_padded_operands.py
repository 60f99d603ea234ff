"""What the RNN layers' padded operands (mirrorgrad/ops/rnn/padded_operands.py) win on
the word LM's LSTM stack: forward and backward of the stack with the products padded
where the rule says so, forced padded, and never padded.

    PYTHONPATH=src python benchmarks/rnn_padded_operands.py [--batch 20 128] [--bptt 35]
        [--hidden 650] [--layers 2] [--impl persistent cuda]

Median ms of 20 calls (TF32 allowed) per impl, batch and dtype; "rule" says whether the
rule pads x and W_ih at that size. An impl that cannot run a shape is skipped.
"""

from __future__ import annotations

import argparse
import contextlib
from unittest import mock

import torch

import mirrorgrad.nn
from mirrorgrad._timing import time_calls
from mirrorgrad.ops import aligned_mm
from mirrorgrad.ops.rnn import padded_operands


@contextlib.contextmanager
def padding(mode: str):
    """Padding as the library decides ("rule"), or the rule overridden ("forced", "off")."""
    if mode == "rule":
        yield
        return
    with mock.patch.object(aligned_mm, "pays_to_pad", lambda *args: mode == "forced"):
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[20, 128])
    parser.add_argument("--bptt", type=int, default=35)
    parser.add_argument("--hidden", type=int, default=650)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--impl", nargs="+", default=["persistent", "cuda"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = True
    H, T = args.hidden, args.bptt
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; LSTM {args.layers}x{H}, "
          f"T {T}; fwd+bwd ms (median of 20)\n")  # fmt: skip
    print("| impl | batch | dtype | rule pads | rule | forced | off |")
    print("|---|---:|---|---|---:|---:|---:|")
    for impl in args.impl:
        for B in args.batch:
            for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                torch.manual_seed(0)
                model = mirrorgrad.nn.LSTM(H, H, args.layers, impl=impl).cuda().to(dtype)
                x = torch.randn(T, B, H, device="cuda", dtype=dtype, requires_grad=True)

                def step(model=model, x=x):
                    y, _ = model(x)
                    y.sum().backward()

                pads = padded_operands.padded_width(H, T * B, 4 * H, dtype, "cuda") > H
                times = []
                try:
                    for mode in ("rule", "forced", "off"):
                        with padding(mode):
                            times.append(time_calls(step, repeats=20, warmup=3,
                                                    device="cuda").median_ms)  # fmt: skip
                except (ValueError, RuntimeError) as error:
                    print(f"| {impl} | {B} | {name} | - | skipped: {str(error)[:60]} | | |")
                    continue
                print(f"| {impl} | {B} | {name} | {'yes' if pads else 'no'} | "
                      + " | ".join(f"{t:.3f}" for t in times) + " |")  # fmt: skip


if __name__ == "__main__":
    main()
