"""What ``impl="auto"`` picks for a step the caller captures, against each implementation
and cuDNN, each step captured whole in one CUDA Graph (forward + backward).

    python benchmarks/auto_pick_graphed.py [--mode lstm|gru] [--dtypes fp32,bf16]

One process; per configuration: graphed ``torch.nn`` (cuDNN), then ``mirrorgrad.nn`` with
``impl`` fixed to triton, persistent and cudnn, then ``impl="auto"`` warmed up inside
``dispatch_as_captured()``. Prints ms per step (and graphed cuDNN's ms over it), auto's
pick and the captured times it chose by. fp32 runs TF32 matmuls, as cuDNN does.
"""

import argparse
import copy

import torch

import mirrorgrad.nn as mnn
from mirrorgrad._cuda_graphs import capture
from mirrorgrad.ops.rnn.dispatch import auto_choices

CONFIGS = (  # layers, input, hidden, batch, steps, bidirectional
    (2, 650, 650, 20, 35, False),
    (2, 1024, 1024, 64, 35, False),
    (4, 1024, 1024, 128, 35, False),
    (2, 512, 512, 256, 35, False),
    (2, 1024, 1024, 64, 35, True),
    (1, 512, 512, 16, 100, False),
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
IMPLS = ("triton", "persistent", "cudnn", "auto")


def graphed_ms(step, reps: int = 20) -> float:
    """Mean ms of ``reps`` replays of ``step`` captured in one CUDA Graph."""
    graph, _ = capture(step)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def row(mode: str, dtype: torch.dtype, layers, input, hidden, batch, T, bi) -> str:
    D = 2 if bi else 1
    torch.manual_seed(0)
    kind = torch.nn.LSTM if mode == "lstm" else torch.nn.GRU
    reference = kind(input, hidden, layers, bidirectional=bi).cuda().to(dtype)
    x = torch.randn(T, batch, input, device="cuda", dtype=dtype, requires_grad=True)
    h0 = torch.randn(layers * D, batch, hidden, device="cuda", dtype=dtype)
    hx = (h0, torch.randn_like(h0)) if mode == "lstm" else h0
    grad_y = torch.randn(T, batch, D * hidden, device="cuda", dtype=dtype)

    def step_of(module):
        def step():
            y, _ = module(x, hx)
            (y * grad_y).sum().backward()

        return step

    ms = {"cudnn graphed": graphed_ms(step_of(reference))}
    for impl in IMPLS:
        module = mnn.convert(copy.deepcopy(reference), impl=impl)
        if impl == "auto":
            with mnn.dispatch_as_captured():
                ms[impl] = graphed_ms(step_of(module))
        else:
            ms[impl] = graphed_ms(step_of(module))
    this = dict(dtype=str(dtype), T=T, B=batch, input=input, layers=layers, bidirectional=bi)
    picks = {
        c["choice"]: c["times"]
        for c in auto_choices()
        if c["captured"] and all(c[k] == v for k, v in this.items())
    }
    base = ms["cudnn graphed"]
    name = f"L{layers}-I{input}-H{hidden}-B{batch}-T{T}{'-bi' if bi else ''}"
    cells = " | ".join(f"{ms[k]:.3f} ({base / ms[k]:.2f}x)" for k in IMPLS)
    times = "; ".join(
        f"{pick} of " + ", ".join(f"{n} {t:.3f}" for n, t in sorted(ts.items()))
        for pick, ts in picks.items()
    )
    return f"| {name} | {base:.3f} | {cells} | {times} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("lstm", "gru"), default="lstm")
    parser.add_argument("--dtypes", default="fp32,bf16")
    args = parser.parse_args()
    torch.set_float32_matmul_precision("high")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.mode}")
    for name in args.dtypes.split(","):
        print(f"\n{name}\n\n| config | cuDNN graphed ms | " + " | ".join(IMPLS)
              + " | auto's pick (captured ms it chose by) |")  # fmt: skip
        print("|---|---:|" + "---:|" * len(IMPLS) + "---|")
        for config in CONFIGS:
            print(row(args.mode, DTYPES[name], *config), flush=True)


if __name__ == "__main__":
    main()
