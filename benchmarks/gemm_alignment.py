"""Whether a GEMM whose rows are 650 wide (the word LM's hidden size) leaves the tensor cores.

    PYTHONPATH=src python benchmarks/gemm_alignment.py [--rows 700 4480] [--hidden 650]
        [--vocab 10000]

The LM head's products at the medium LM's sizes (rows = batch x BPTT: 700 at batch 20,
4,480 at batch 128): logits ``h @ W^T``, ``grad_logits @ W`` and ``grad_logits^T @ h``,
fp32 with TF32 allowed and bf16, at hidden 650 and zero-padded to the next multiple of 8
(656). Prints the median ms of each and the kernel cuBLAS ran (torch.profiler): a name
with ``simt`` is a CUDA-core kernel. On an H200 the bf16 LM step's fp32 weight gradient
of the head ran ``cutlass_80_simt_sgemm_128x256_8x4_nt_align1`` (250 us).
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from mirrorgrad._timing import time_calls


def products(rows: int, hidden: int, vocab: int, dtype: torch.dtype) -> dict:
    h = torch.randn(rows, hidden, device="cuda", dtype=dtype)
    w = torch.randn(vocab, hidden, device="cuda", dtype=dtype)
    g = torch.randn(rows, vocab, device="cuda", dtype=dtype)
    return {
        "logits h @ W^T": lambda: h @ w.T,
        "grad_hidden g @ W": lambda: g @ w,
        "grad_weight g^T @ h": lambda: g.T @ h,
    }


def kernel_of(fn) -> str:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return names[0][:70] if names else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[700, 4480])
    parser.add_argument("--hidden", type=int, default=650)
    parser.add_argument("--vocab", type=int, default=10000)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = True
    padded = -(-args.hidden // 8) * 8
    print(f"{torch.cuda.get_device_name()}, vocab {args.vocab}; ms (median of 20)\n")
    print("| rows | dtype | product | hidden | ms | padded | ms | kernel at hidden |")
    print("|---:|---|---|---:|---:|---:|---:|---|")
    for rows in args.rows:
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            at = products(rows, args.hidden, args.vocab, dtype)
            pad = products(rows, padded, args.vocab, dtype)
            for what, fn in at.items():
                ms = time_calls(fn, repeats=20, warmup=3, device="cuda").median_ms
                ms_pad = time_calls(pad[what], repeats=20, warmup=3, device="cuda").median_ms
                print(f"| {rows} | {name} | {what} | {args.hidden} | {ms:.3f} | {padded} | "
                      f"{ms_pad:.3f} | {kernel_of(fn)} |")  # fmt: skip


if __name__ == "__main__":
    main()
