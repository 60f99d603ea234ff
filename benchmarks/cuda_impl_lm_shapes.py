"""The word LM's LSTM stack (``mirrorgrad train lm --model medium``: 2x650, input 650,
batch 20, BPTT 35, dropout 0.5 between the layers) forward and backward, each module
captured whole in one CUDA Graph: ``mirrorgrad.nn.LSTM(impl="cuda")`` (hidden 650 runs
zero-padded to 656) as one wavefront launch (``cuda-wavefront``; where it does not fit the
row says why and runs layer by layer) and layer by layer (``cuda``), ``impl="persistent"``
(Triton) and ``torch.nn.LSTM`` (cuDNN), in bf16 and fp32 (TF32 products for all, cuDNN's
default).

    PYTHONPATH=src python benchmarks/cuda_impl_lm_shapes.py [--dtypes bf16,fp32]
        [--batch 20] [--T 35] [--methods cuda-wavefront,cuda,persistent,cudnn]
        [--out results.json]

Past batch 32 ``impl="cuda"`` runs each layer in batch groups (the wavefront takes one
group: its row runs layer by layer and says so).

First each module's outputs and gradients (eval mode: no dropout) against
``torch.nn.LSTM`` in float64 on the CPU with the same rounded weights: the largest
``|ours - ref| / (1 + |ref|)`` over y, h_n, c_n, dx, dh0, dc0 and every weight gradient
(cuDNN's beside ours). Then, in train mode (dropout on), the replay of the captured
forward (autograd recording) and of the captured forward and backward (the gradients of
x and every weight from a given dy): milliseconds per call, the median of rounds of
back-to-back replays between CUDA events; and the forward's time a step: per tick of the
wavefront (forward / (L + T - 1)), per layer-step of the others (forward / (L x T)).
About a minute on an H100.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

import torch

import mirrorgrad.nn
from mirrorgrad._cuda_graphs import capture
from mirrorgrad.ops.rnn import cuda_persistent

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
METHODS = ("cuda-wavefront", "cuda", "persistent", "cudnn")
LAYERS, N_IN, HIDDEN, DROPOUT = 2, 650, 650, 0.5


def module(method: str, dtype: torch.dtype) -> torch.nn.Module:
    """The stack on the GPU in ``dtype``, every method with the same weights."""
    torch.manual_seed(0)
    cudnn = torch.nn.LSTM(N_IN, HIDDEN, LAYERS, dropout=DROPOUT)
    if method == "cudnn":
        return cudnn.to("cuda", dtype)
    impl = "cuda" if method == "cuda-wavefront" else method
    ours = mirrorgrad.nn.LSTM(N_IN, HIDDEN, LAYERS, dropout=DROPOUT, impl=impl)
    ours.load_state_dict(cudnn.state_dict())
    return ours.to("cuda", dtype)


def inputs(T: int, B: int, dtype: torch.dtype, device="cuda") -> list[torch.Tensor]:
    """x, h0, c0 (carried states: not zero) and dy, drawn on the CPU."""
    g = torch.Generator().manual_seed(1)
    shapes = [(T, B, N_IN), (LAYERS, B, HIDDEN), (LAYERS, B, HIDDEN), (T, B, HIDDEN)]
    return [(0.5 * torch.randn(*s, generator=g)).to(device, dtype) for s in shapes]


def outputs_and_gradients(m: torch.nn.Module, x, h0, c0, dy) -> list[torch.Tensor]:
    """y, h_n, c_n and the gradients of x, h0, c0 and every weight of the loss
    (dy * y).sum() + h_n.sum() + c_n.sum() (every output reaches it)."""
    leaves = [t.detach().requires_grad_() for t in (x, h0, c0)]
    y, (h_n, c_n) = m(leaves[0], (leaves[1], leaves[2]))
    loss = (y * dy).sum() + h_n.float().sum() + c_n.float().sum()
    return [y, h_n, c_n, *torch.autograd.grad(loss, [*leaves, *m.parameters()])]


def error_vs_float64(m: torch.nn.Module, tensors: list[torch.Tensor]) -> float:
    """The largest relative error of ``m``'s outputs and gradients (dropout off, training
    mode: cuDNN's backward refuses eval mode) against torch.nn.LSTM in float64 on the
    CPU with ``m``'s weights."""
    ref = torch.nn.LSTM(N_IN, HIDDEN, LAYERS).double()
    ref.load_state_dict({k: v.double().cpu() for k, v in m.state_dict().items()})
    dropout, m.dropout = m.dropout, 0.0
    try:
        ours = outputs_and_gradients(m, *tensors)
    finally:
        m.dropout = dropout
    want = outputs_and_gradients(ref, *(t.double().cpu() for t in tensors))
    return max(((a.double().cpu() - b).abs() / (1 + b.abs())).max().item()
               for a, b in zip(ours, want))  # fmt: skip


def ms_per_call(replay, *, calls: int = 20, rounds: int = 7) -> float:
    for _ in range(3):
        replay()
    samples = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return statistics.median(samples)


def measure(method: str, dtype: torch.dtype, T: int, B: int) -> dict:
    """The row of one method; ``cuda`` and ``cuda-wavefront`` set the wavefront's switch."""
    cuda_persistent.WAVEFRONT = method == "cuda-wavefront"
    try:
        return _measure(method, dtype, T, B)
    finally:
        cuda_persistent.WAVEFRONT = True


def _measure(method: str, dtype: torch.dtype, T: int, B: int) -> dict:
    m = module(method, dtype)
    x, h0, c0, dy = tensors = inputs(T, B, dtype)
    row = {"error_vs_float64": error_vs_float64(m, tensors)}
    steps = LAYERS * T
    if method == "cuda-wavefront":
        hx = h0.new_empty(LAYERS, B, HIDDEN)
        reason = cuda_persistent.wavefront_reason(x, list(m.parameters()), hx, None, "lstm",
                                                  LAYERS, False, 0, None)  # fmt: skip
        if reason is None:
            steps = LAYERS + T - 1  # ticks
        else:
            row["layer_by_layer"] = reason
    leaves = [t.detach().requires_grad_() for t in (x, h0, c0)]
    params = list(m.parameters())

    def forward():
        return m(leaves[0], (leaves[1], leaves[2]))[0]

    def forward_and_backward():
        torch.autograd.grad(forward(), [leaves[0], *params], dy)

    for name, call in (("forward_ms", forward), ("forward_backward_ms", forward_and_backward)):
        graph, _ = capture(call)
        row[name] = ms_per_call(graph.replay)
    row["forward_us_per_step"] = 1000 * row["forward_ms"] / steps
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--batch", type=int, default=20)
    parser.add_argument("--T", type=int, default=35)
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="comma-separated, of " + ", ".join(METHODS))  # fmt: skip
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    if unknown := set(methods) - set(METHODS):
        parser.error(f"unknown methods {sorted(unknown)}")
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 1
    torch.backends.cuda.matmul.allow_tf32 = True  # as cuDNN's fp32 RNN runs by default
    torch.backends.cudnn.allow_tf32 = True
    rows = []
    for dtype_name in args.dtypes.split(","):
        for method in methods:
            row = {"dtype": dtype_name, "method": method}
            try:
                row |= measure(method, DTYPES[dtype_name], args.T, args.batch)
            except Exception as e:  # one failing leaves the others' numbers
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{LAYERS}x{HIDDEN} LSTM, input {N_IN}, batch {args.batch}, T {args.T}, dropout "
          f"{DROPOUT}; {torch.cuda.get_device_name()}, torch {torch.__version__}; ms per "
          f"call of the captured graph (median)\n")  # fmt: skip
    print("| dtype | method | fwd | fwd+bwd | vs cuDNN (fwd+bwd) | fwd µs a step or tick "
          "| error vs float64 |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|")
    for row in rows:
        if "error" in row:
            print(f"| {row['dtype']} | {row['method']} | failed: {row['error']} | | | | |")
            continue
        cudnn = next((r for r in rows if r["dtype"] == row["dtype"] and r["method"] == "cudnn"),
                     {})  # fmt: skip
        ratio = cudnn.get("forward_backward_ms", float("nan")) / row["forward_backward_ms"]
        method = row["method"] + (" (layer by layer)" if "layer_by_layer" in row else "")
        print(f"| {row['dtype']} | {method} | {row['forward_ms']:.3f} | "
              f"{row['forward_backward_ms']:.3f} | {ratio:.2f}x | "
              f"{row['forward_us_per_step']:.2f} | {row['error_vs_float64']:.1e} |")  # fmt: skip
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()  # fmt: skip
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                "commit": commit, "batch": args.batch, "T": args.T}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
