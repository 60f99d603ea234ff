"""What padding the fused LM head's hidden size to 16 bytes wins, on a GPU.

    PYTHONPATH=src python benchmarks/lce_padding.py [--rows 700 4480] [--hidden 650]
        [--vocab 10000]

Forward+backward of ``linear_cross_entropy`` (bias included, every gradient asked for) at
the medium word LM's head by default (rows = batch x BPTT: 700 at batch 20, 4,480 at
batch 128), fp32 with TF32 allowed and bf16: median ms and peak MiB beyond the inputs
with the op's pads forced off and forced on, and which of the two the op's rule
(``aligned_mm.pays_to_pad`` over the whole call) picks each way.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from mirrorgrad._timing import peak_bytes_of, time_calls
from mirrorgrad.ops import aligned_mm
from mirrorgrad.ops.linear_cross_entropy import linear_cross_entropy, op

# Run as a script, the repository root is not on the path: its sibling comes from there.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.lm_head_args import head_parser, parse_on_gpu

MiB = 2**20


def measure(hidden, weight, bias, target) -> tuple[float, float]:
    """(median ms, peak MiB beyond what existed before) of forward+backward."""

    def step():
        loss = linear_cross_entropy(hidden, weight, bias, target)
        torch.autograd.grad(loss, (hidden, weight, bias))

    peak = peak_bytes_of(step) / MiB
    return time_calls(step, repeats=20, warmup=2, device="cuda").median_ms, peak


def main() -> None:
    args = parse_on_gpu(head_parser(__doc__))
    rule = aligned_mm.pays_to_pad
    print(f"{torch.cuda.get_device_name()}, hidden {args.hidden}, vocab {args.vocab}")
    print("| dtype | rows | rule pads fwd / bwd | unpadded ms | padded ms | unpadded MiB "
          "| padded MiB |\n|---|---:|---|---:|---:|---:|---:|")  # fmt: skip
    g = torch.Generator(device="cuda").manual_seed(0)

    def leaf(*shape, dtype, scale=1.0):
        t = scale * torch.randn(*shape, device="cuda", generator=g)
        return t.to(dtype).requires_grad_()

    for dtype in (torch.float32, torch.bfloat16):
        for rows in args.rows:
            hidden, bias = leaf(rows, args.hidden, dtype=dtype), leaf(args.vocab, dtype=dtype)
            weight = leaf(args.vocab, args.hidden, dtype=dtype, scale=args.hidden**-0.5)
            target = torch.randint(0, args.vocab, (rows,), device="cuda", generator=g)
            picks = op.forward_pads(hidden, weight), op.backward_pads(hidden, weight, True, True)
            results = []
            try:
                for pad in (False, True):
                    aligned_mm.pays_to_pad = lambda *_, pad=pad: pad
                    results += measure(hidden, weight, bias, target)
            finally:
                aligned_mm.pays_to_pad = rule
            ms0, mib0, ms1, mib1 = results
            print(f"| {str(dtype)[6:]} | {rows} | {picks[0]} / {picks[1]} | {ms0:.3f} | "
                  f"{ms1:.3f} | {mib0:.1f} | {mib1:.1f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
