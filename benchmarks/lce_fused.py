"""What the Triton passes over the fused LM head's logits win, on a GPU.

    PYTHONPATH=src python benchmarks/lce_fused.py [--rows 700 4480] [--hidden 650]
        [--vocab 10000] [--repeats 50] [--graphed]

``linear_cross_entropy`` (bias included, every gradient asked for, the op's default
chunks and pad rule) at the medium word LM's head by default (rows = batch x BPTT: 700
at batch 20, 4,480 at batch 128), fp32 with TF32 allowed (as the LM trains) and bf16:
median ms of the forward alone and of forward+backward, and the peak MiB beyond the
inputs, with the passes over each chunk of logits run by torch (``op.TRITON_PASSES`` empty:
cast, logsumexp, gather; subtract, exp, scale, scatter, cast down) and by the Triton
kernels (every dtype named; by default the op runs them for half precision only). The
table comes last.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from mirrorgrad._cuda_graphs import capture
from mirrorgrad._timing import peak_bytes_of, time_calls
from mirrorgrad.ops.linear_cross_entropy import kernels, linear_cross_entropy, op

# Run as a script, the repository root is not on the path: its sibling comes from there.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.lm_head_args import head_parser, parse_on_gpu

MiB = 2**20


def graphed(fn):
    """``fn`` captured in a CUDA Graph: the call replays it (no host time per launch)."""
    graph, _ = capture(fn)
    return graph.replay


def measure(hidden, weight, bias, target, repeats: int, captured: bool) -> tuple[float, ...]:
    """(forward ms, forward+backward ms, peak MiB beyond what existed before), medians;
    ``captured``: each timed as one CUDA Graph's replay."""
    leaves = (hidden, weight, bias)

    def forward():
        with torch.no_grad():
            linear_cross_entropy(hidden, weight, bias, target)

    def step():
        torch.autograd.grad(linear_cross_entropy(hidden, weight, bias, target), leaves)

    peak = peak_bytes_of(step) / MiB
    if captured:
        forward, step = graphed(forward), graphed(step)
    fwd = time_calls(forward, repeats=repeats, warmup=3, device="cuda").median_ms
    both = time_calls(step, repeats=repeats, warmup=3, device="cuda").median_ms
    return fwd, both, peak


def main() -> None:
    parser = head_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument(
        "--graphed", action="store_true", help="time replays of a CUDA Graph, as train lm runs"
    )
    args = parse_on_gpu(parser, "repeats")
    g = torch.Generator(device="cuda").manual_seed(0)

    def leaf(*shape, dtype, scale=1.0):
        t = scale * torch.randn(*shape, device="cuda", generator=g)
        return t.to(dtype).requires_grad_()

    rows_out = []
    for dtype in (torch.float32, torch.bfloat16):
        for rows in args.rows:
            hidden, bias = leaf(rows, args.hidden, dtype=dtype), leaf(args.vocab, dtype=dtype)
            weight = leaf(args.vocab, args.hidden, dtype=dtype, scale=args.hidden**-0.5)
            target = torch.randint(0, args.vocab, (rows,), device="cuda", generator=g)
            results = {}
            default = op.TRITON_PASSES
            try:
                for triton in (False, True):
                    op.TRITON_PASSES = kernels.DTYPES if triton else ()
                    results[triton] = measure(hidden, weight, bias, target, args.repeats,
                                              args.graphed)  # fmt: skip
            finally:
                op.TRITON_PASSES = default
            (fwd0, ms0, mib0), (fwd1, ms1, mib1) = results[False], results[True]
            line = (f"| {str(dtype)[6:]} | {rows} | {fwd0:.3f} | {fwd1:.3f} | {ms0:.3f} | "
                    f"{ms1:.3f} | {ms0 / ms1:.2f}x | {mib0:.1f} | {mib1:.1f} |")  # fmt: skip
            print(line, flush=True)
            rows_out.append(line)
    print(f"\n{torch.cuda.get_device_name()}, hidden {args.hidden}, vocab {args.vocab}, "
          f"median of {args.repeats}{', CUDA-graphed' if args.graphed else ', eager'}; "
          "ms and MiB: torch's passes / Triton's")  # fmt: skip
    print("| dtype | rows | fwd ms torch | fwd ms triton | fwd+bwd ms torch | fwd+bwd ms triton "
          "| speed-up | peak MiB torch | peak MiB triton |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    print("\n".join(rows_out))


if __name__ == "__main__":
    main()
