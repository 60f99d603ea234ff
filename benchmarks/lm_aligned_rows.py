"""What storing the word LM's 650-wide rows 656 wide (train/model.py, ``aligned_rows``)
wins: the medium model's training step with the rows stored aligned and not.

    PYTHONPATH=src python benchmarks/lm_aligned_rows.py [--batch 20 128] [--steps 60]

The step is `mirrorgrad train lm`'s on one GPU without compiling: forward, backward,
clip and SGD captured whole in one CUDA Graph (``train.step.GraphedStep``), TF32 on,
dropout 0.5, random tokens. Prints the median ms of ``--steps`` steps per precision,
batch and layout.
"""

from __future__ import annotations

import argparse

import torch

from mirrorgrad._timing import time_calls
from mirrorgrad.nn import dispatch_as_captured
from mirrorgrad.train import step
from mirrorgrad.train.config import PRESETS
from mirrorgrad.train.model import LanguageModel

VOCAB, BPTT, LR, CLIP = 10_000, 35, 20.0, 0.25


def step_ms(batch: int, precision: str, aligned_rows: bool, steps: int) -> float:
    torch.manual_seed(0)
    model = LanguageModel(VOCAB, PRESETS["medium"], precision=precision,
                          aligned_rows=aligned_rows).cuda()  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    tokens = torch.randint(0, VOCAB, (BPTT + 1, batch), device="cuda")
    inputs, targets = tokens[:-1].contiguous(), tokens[1:].contiguous()
    state = [model.initial_state(batch, "cuda")]
    with dispatch_as_captured():  # impl="auto" chooses as the captured step runs
        graphed = step.GraphedStep(model, optimizer, clip=CLIP)

        def one_step() -> None:
            _, _, state[0] = graphed(inputs, targets, state[0])

        return time_calls(one_step, repeats=steps, warmup=5, device="cuda").median_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[20, 128])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    torch.set_float32_matmul_precision("high")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; medium LM (2x650, "
          f"vocab 10k, BPTT 35); whole-step graph, median ms of {args.steps} steps\n")  # fmt: skip
    print("| precision | batch | 650 wide | stored 656 wide | speed-up |")
    print("|---|---:|---:|---:|---:|")
    for precision in ("fp32", "bf16"):
        for batch in args.batch:
            plain, aligned = (step_ms(batch, precision, a, args.steps) for a in (False, True))
            print(f"| {precision} | {batch} | {plain:.3f} | {aligned:.3f} | "
                  f"{plain / aligned:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
