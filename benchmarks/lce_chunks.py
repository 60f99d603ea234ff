"""What the fused LM head (`linear_cross_entropy`) costs at each chunk size, on a GPU.

    PYTHONPATH=src python benchmarks/lce_chunks.py [--rows 8192] [--vocab 50257]
        [--hidden 768] [--dtype fp32|bf16] [--chunks-mib 64 256 1024]

Forward+backward of the loss of ``hidden [rows, H] @ weight [V, H].T`` (GPT-2 small's
head at batch 8, length 1024 by default), median ms and peak beyond the inputs, for:
``F.linear`` + ``F.cross_entropy`` eager and under ``torch.compile`` (the logits
exist whole), and ``linear_cross_entropy`` at each ``--chunks-mib`` (rows per chunk:
as many as fit that many MiB of float32 logits; 64 is the op's default). On an H100 the
planner's fused head made GPT-2's step 1.30x slower at budget 0.5 while the cost model
priced +8-14%: at 64 MiB a GPT-2 chunk is 333 rows, so each of its 25 chunks runs three
small-M GEMMs. This shows whether larger chunks close that and what they cost in memory.
TF32 on, as the bench runs fp32.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from mirrorgrad._timing import peak_bytes_of, time_calls
from mirrorgrad.ops.linear_cross_entropy import linear_cross_entropy

MiB = 2**20
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def measure(loss_fn, hidden, weight, target) -> tuple[float, float]:
    """(median ms, peak MiB beyond what existed before) of forward+backward."""

    def step():
        hidden.grad = weight.grad = None
        loss_fn(hidden, weight, target).backward()

    peak = peak_bytes_of(step) / MiB
    timing = time_calls(step, repeats=10, warmup=2, device="cuda")
    return timing.median_ms, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    parser.add_argument("--chunks-mib", type=int, nargs="+", default=[64, 256, 1024])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    if min(args.rows, args.vocab, args.hidden, *args.chunks_mib) < 1:
        parser.error("--rows, --vocab, --hidden and --chunks-mib must be >= 1")
    torch.set_float32_matmul_precision("high")
    dtype = DTYPES[args.dtype]
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(args.rows, args.hidden, device="cuda", dtype=dtype, generator=g)
    weight = torch.randn(args.vocab, args.hidden, device="cuda", dtype=dtype, generator=g) / 30
    target = torch.randint(0, args.vocab, (args.rows,), device="cuda", generator=g)
    hidden.requires_grad_()
    weight.requires_grad_()

    def unfused(h, w, t):
        return F.cross_entropy(F.linear(h, w).float(), t)

    methods = {"linear + cross_entropy, eager": unfused,
               "linear + cross_entropy, torch.compile": torch.compile(unfused)}  # fmt: skip
    for mib in args.chunks_mib:
        rows = max(1, mib * MiB // (4 * args.vocab))
        methods[f"linear_cross_entropy, {mib} MiB chunks ({rows} rows)"] = (
            lambda h, w, t, rows=rows: linear_cross_entropy(h, w, None, t, chunk_size=rows)
        )
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, rows {args.rows}, vocab "
          f"{args.vocab}, hidden {args.hidden}")  # fmt: skip
    print("| method | fwd+bwd ms | peak MiB beyond inputs |\n|---|---:|---:|")
    for name, fn in methods.items():
        ms, peak = measure(fn, hidden, weight, target)
        print(f"| {name} | {ms:.2f} | {peak:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
