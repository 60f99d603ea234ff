"""Whether a GEMM whose rows are 650 wide (the word LM's hidden size) leaves the fast
tensor-core kernels, and what `mirrorgrad.ops.aligned_mm.mm` (padding on the fly) wins.

    PYTHONPATH=src python benchmarks/gemm_alignment.py [--rows 700 4480] [--hidden 650]
        [--vocab 10000]

The medium LM's products (rows = batch x BPTT: 700 at batch 20, 4,480 at batch 128): the
head's ``h @ W^T``, ``g @ W``, ``g^T @ h`` (W [vocab, hidden]) and an LSTM layer's input
product ``x @ W_ih^T`` and its gradients ``dG @ W_ih``, ``dG^T @ x`` (W_ih [4 hidden,
hidden]), fp32 with TF32 allowed and bf16. Columns: ``a @ b`` at the hidden size,
``aligned_mm.mm`` (its pads and the copy of the result's real block included), and the
product at the hidden size rounded up to 8 (operands stored padded: no copies); median ms
of 20 calls, and the GEMM kernel cuBLAS ran without and with the pads.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from mirrorgrad._timing import time_calls
from mirrorgrad.ops.aligned_mm import mm

# Run as a script, the repository root is not on the path: its sibling comes from there.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.lm_head_args import head_parser, parse_on_gpu


def operands(rows: int, hidden: int, vocab: int, dtype: torch.dtype) -> dict:
    """name -> (a, b) with the layouts the ops multiply them in."""

    def r(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype)

    h, w, g = r(rows, hidden), r(vocab, hidden), r(rows, vocab)
    x, w_ih, dg = r(rows, hidden), r(4 * hidden, hidden), r(rows, 4 * hidden)
    return {
        "head h @ W^T": (h, w.T),
        "head g @ W": (g, w),
        "head g^T @ h": (g.T, h),
        "lstm x @ W_ih^T": (x, w_ih.T),
        "lstm dG @ W_ih": (dg, w_ih),
        "lstm dG^T @ x": (dg.T, x),
    }


def gemm_kernel(fn) -> str:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gemms = [n for n in names if "gemm" in n.lower() or "Kernel2" in n]
    name = (gemms or names or ["?"])[0]
    return name.removeprefix("void cutlass::Kernel2<").removeprefix("void ")[:48]


def main() -> None:
    args = parse_on_gpu(head_parser(__doc__))
    padded = -(-args.hidden // 8) * 8

    def ms(fn) -> float:
        return time_calls(fn, repeats=20, warmup=3, device="cuda").median_ms

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, vocab {args.vocab}; "
          f"ms (median of 20)\n")  # fmt: skip
    print(f"| rows | dtype | product | a @ b at {args.hidden} | aligned_mm | at {padded} | "
          "kernel of a @ b | kernel of aligned_mm |")  # fmt: skip
    print("|---:|---|---|---:|---:|---:|---|---|")
    for rows in args.rows:
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            at = operands(rows, args.hidden, args.vocab, dtype)
            pad = operands(rows, padded, args.vocab, dtype)
            for what, (a, b) in at.items():
                pa, pb = pad[what]
                plain = lambda a=a, b=b: a @ b  # noqa: E731
                aligned = lambda a=a, b=b: mm(a, b).contiguous()  # noqa: E731
                err = (aligned().float() - plain().float()).abs().max().item()
                assert err <= 1e-2 * plain().float().abs().max().item(), (what, err)
                print(f"| {rows} | {name} | {what} | {ms(plain):.3f} | {ms(aligned):.3f} | "
                      f"{ms(lambda pa=pa, pb=pb: pa @ pb):.3f} | {gemm_kernel(plain)} | "
                      f"{gemm_kernel(aligned)} |")  # fmt: skip


if __name__ == "__main__":
    main()
