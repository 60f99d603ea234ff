"""The fused LM head's declared temporaries against the CUDA allocator's, per call.

    PYTHONPATH=src python benchmarks/lce_formulas.py [--rows 700 4480] [--hidden 650]
        [--vocab 10000]

For each dtype (fp32 with TF32, bf16), row count and pass kind (the Triton kernels,
torch's passes), one forward and one backward (every gradient asked for) of
``linear_cross_entropy``'s ops, each called once to warm up and then measured: the
bytes the op's memory formula declares beside the allocator's peak beyond the inputs and
the outputs. At the word LM's head, 700 rows are one chunk of logits and 4,480 rows three.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from mirrorgrad import formulas
from mirrorgrad._timing import peak_bytes_of
from mirrorgrad.ops.linear_cross_entropy import kernels, op

# Run as a script, the repository root is not on the path: its sibling comes from there.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.lm_head_args import head_parser, parse_on_gpu

MiB = 2**20


def seen_and_declared(fn, args, formula) -> tuple[float, float]:
    """(MiB the call held beyond its inputs and outputs at its peak, MiB declared)."""
    held = []  # the last call's outputs: alive when the next call starts, as in a step

    def call():
        held[:] = [fn(*args)]

    peak = peak_bytes_of(call)
    outputs = sum(o.nbytes for o in held[0])
    return (peak - outputs) / MiB, formulas.memory_formula(formula)(*args) / MiB


def main() -> None:
    args = parse_on_gpu(head_parser(__doc__))
    v, h = args.vocab, args.hidden
    chunk = op.CHUNK_BYTES // (4 * v)
    forward, backward = op.linear_cross_entropy_forward, op.linear_cross_entropy_backward
    ops = torch.ops.mirrorgrad
    lines = []
    default = op.TRITON_PASSES
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for rows in args.rows:
                g = torch.Generator(device="cuda").manual_seed(0)
                hidden = torch.randn(rows, h, device="cuda", generator=g).to(dtype)
                weight = (torch.randn(v, h, device="cuda", generator=g) / h**0.5).to(dtype)
                bias = torch.zeros(v, device="cuda", dtype=dtype)
                target = torch.randint(0, v, (rows,), device="cuda", generator=g)
                for passes, name in ((kernels.DTYPES, "triton"), ((), "torch")):
                    op.TRITON_PASSES = passes
                    fw = (hidden, weight, bias, target, chunk)
                    lse, _ = forward._init_fn(*fw)
                    grads = torch.randn_like(lse), torch.randn_like(lse)
                    bw = (*grads, hidden, weight, bias, target, lse, chunk, True, True, True)
                    for call, fn, a, formula in (
                        ("forward", forward._init_fn, fw, ops.linear_cross_entropy_forward),
                        ("backward", backward._init_fn, bw, ops.linear_cross_entropy_backward),
                    ):
                        seen, declared = seen_and_declared(fn, a, formula)
                        line = (f"| {str(dtype)[6:]} | {rows} | {name} | {call} | "
                                f"{declared:.1f} | {seen:.1f} |")  # fmt: skip
                        print(line, flush=True)
                        lines.append(line)
    finally:
        op.TRITON_PASSES = default
    print(f"\n{torch.cuda.get_device_name()}, hidden {h}, vocab {v}, {chunk} rows a chunk")
    print("| dtype | rows | passes | call | declared MiB | seen MiB |")
    print("|---|---:|---|---|---:|---:|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
