"""The LM-step table: the word LM's training step as a user would run each option, side by side.

    python -m mirrorgrad.bench.lm_step --out DIR [--data CORPUS] [--batch 20 128]
                                       [--precision fp32 bf16] [--steps 60]

The medium model (2x650, dropout 0.5, vocabulary 10k, BPTT 35, SGD lr 20, clip 0.25),
per batch size and precision, each row in a process of its own (cuBLAS workspaces,
compiled code and caches are each row's own, as in a user's run):

- ``pytorch-example``: PyTorch's word_language_model step (``nn.LSTM``, cuDNN), eager;
  bf16 under autocast as AMP runs it.
- ``cudnn-graphed``: the train package's model with ``torch.nn.LSTM`` (cuDNN) in place
  of ours, one ``nn.LSTM`` per layer (``CudnnStack``: nn.LSTM's own inter-layer dropout
  cannot be captured), the whole step (forward, backward, clip, SGD) in one CUDA Graph
  (``train.step.GraphedStep``).
- ``ours-graphed``: the same model with ``mirrorgrad.nn.LSTM``, the same whole-step graph.
- ``train-lm``: ``mirrorgrad train lm --model medium`` itself on ``--data`` (its loop,
  compile and plan included): tokens/s of the steps after the first, the peak of the run
  and that of its steps (its final evaluation excluded).

Step rows: median step time of ``--steps`` steps after a warm-up, from random tokens.
A row's peak is its process's largest ``max_memory_allocated`` (weights, gradients,
the graph's memory, cuBLAS's workspaces). ``train-lm`` makes cuBLAS's workspaces 4 MiB
where ``CUBLAS_WORKSPACE_CONFIG`` is unset; ``--small-cublas-workspace`` gives every row
the same. The table is printed last; ``lm_step.json`` keeps it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from mirrorgrad._cuda_graphs import SMALL_CUBLAS_WORKSPACE, small_cublas_workspaces
from mirrorgrad._timing import time_calls
from mirrorgrad.bench.word_lm import BPTT, CLIP, LR, VOCAB, ExampleLM, example_step
from mirrorgrad.train.config import PRECISIONS

ROWS = ("pytorch-example", "cudnn-graphed", "ours-graphed", "train-lm")


@dataclasses.dataclass(kw_only=True)
class Result:
    row: str
    batch: int
    precision: str
    tokens_per_s: float
    peak_bytes: int
    step_ms: float
    # The steps' own peak: a step row's process runs nothing else; train-lm's excludes
    # its final evaluation (its setup too: peaks are reset when the steps start).
    steps_peak_bytes: int = 0


def _example_step(batch: int, precision: str, device: torch.device) -> Callable[[], Tensor]:
    from mirrorgrad.train.config import PRESETS

    model = ExampleLM(VOCAB, PRESETS["medium"]).to(device)
    return example_step(model, *_tokens(batch, device), autocast_dtype=PRECISIONS[precision])


class CudnnStack(nn.Module):
    """``nn.LSTM(num_layers=L, dropout=p)`` as L one-layer ``nn.LSTM``s with ``nn.Dropout``
    between them: the same maths, and capturable. nn.LSTM's own inter-layer dropout
    waits on the host for its cuDNN dropout state, which a CUDA Graph capture refuses
    ("operation not permitted when stream is capturing"), so a user who captures the
    step writes it this way."""

    def __init__(self, input_size: int, hidden: int, layers: int, dropout: float) -> None:
        super().__init__()
        sizes = [input_size] + [hidden] * (layers - 1)
        self.layers = nn.ModuleList(nn.LSTM(size, hidden) for size in sizes)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, state: tuple[Tensor, Tensor]):
        h0, c0 = state
        hs, cs = [], []
        for i, lstm in enumerate(self.layers):
            x, (h, c) = lstm(self.drop(x) if i else x, (h0[i : i + 1], c0[i : i + 1]))
            hs.append(h)
            cs.append(c)
        return x, (torch.cat(hs), torch.cat(cs))


def _graphed_step(
    batch: int, precision: str, device: torch.device, *, cudnn: bool
) -> Callable[[], Tensor]:
    from mirrorgrad.train import step
    from mirrorgrad.train.config import PRESETS
    from mirrorgrad.train.model import LanguageModel

    preset = PRESETS["medium"]
    torch.manual_seed(0)
    model = LanguageModel(VOCAB, preset, precision=precision)
    if cudnn:
        model.rnn = CudnnStack(model.rnn.input_size, preset.hidden, preset.layers, preset.dropout)
        with torch.no_grad():  # zeros against the embedding's pad columns, as in ours
            model.rnn.layers[0].weight_ih_l0[:, preset.embedding :].zero_()
    model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    graphed = step.GraphedStep(model, optimizer, clip=CLIP)
    tokens, targets = _tokens(batch, device)
    state = [model.initial_state(batch, device)]

    def one_step() -> Tensor:
        loss, _, state[0] = graphed(tokens, targets, state[0])
        return loss

    return one_step


def _tokens(batch: int, device: torch.device) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BPTT + 1, batch), generator=g).to(device)
    return tokens[:-1].contiguous(), tokens[1:].contiguous()


def _time_step_row(row: str, batch: int, precision: str, steps: int, device) -> Result:
    if row == "pytorch-example":
        step = _example_step(batch, precision, device)
    else:
        step = _graphed_step(batch, precision, device, cudnn=row == "cudnn-graphed")
    timing = time_calls(step, repeats=steps, warmup=5, device=device)
    peak = torch.cuda.max_memory_allocated(device)  # the row's process: nothing before it
    del step
    return Result(
        row=row, batch=batch, precision=precision, step_ms=timing.median_ms,
        tokens_per_s=batch * BPTT / timing.median_ms * 1e3, peak_bytes=peak,
        steps_peak_bytes=peak,
    )  # fmt: skip


def run_train_lm(batch: int, precision: str, steps: int, data: Path | None):
    """`mirrorgrad train lm --model medium --device cuda` itself for ``steps`` steps (one
    epoch at most, no checkpoints, logs in a temporary folder); its Summary."""
    from mirrorgrad.train.config import TrainConfig
    from mirrorgrad.train.loop import train

    with tempfile.TemporaryDirectory() as logdir:
        config = TrainConfig.from_preset(
            "medium", data=data, device="cuda", batch_size=batch, epochs=1, max_steps=steps,
            precision=precision, logdir=Path(logdir), log_freq=steps, ckpt_every=10**9,
        )  # fmt: skip
        return train(config)


def _train_lm_row(batch: int, precision: str, steps: int, data: Path | None, device) -> Result:
    """`mirrorgrad train lm --model medium` itself, for ``steps`` steps."""
    summary = run_train_lm(batch, precision, steps, data)
    return Result(
        row="train-lm", batch=batch, precision=precision, tokens_per_s=summary.tokens_per_s,
        peak_bytes=summary.peak_measured_bytes or 0,
        steps_peak_bytes=summary.peak_loop_bytes or 0,
        step_ms=batch * BPTT / summary.tokens_per_s * 1e3,
    )  # fmt: skip


def _measure_in_child(row: str, batch: int, precision: str, steps: int, args) -> Result:
    """One row in a fresh Python process: its peak starts from nothing, as a user's run."""
    command = [sys.executable, "-m", "mirrorgrad.bench.lm_step", "--out", str(args.out),
               "--one-row", row, "--batch", str(batch), "--precision", precision,
               "--steps", str(steps)]  # fmt: skip
    if args.data is not None:
        command += ["--data", str(args.data)]
    env = dict(os.environ)
    if args.small_cublas_workspace:
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", SMALL_CUBLAS_WORKSPACE)
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the {row} row (batch {batch}, {precision}) failed: exit "
                           f"{done.returncode}; its error is printed above")  # fmt: skip
    return Result(**json.loads(lines[-1]))


def _measure(row: str, batch: int, precision: str, steps: int, data, device) -> Result:
    if row == "train-lm":
        # Its tokens/s are a wall clock over the run, not a median: long enough (about
        # 3 s) that a hiccup of the host does not decide them.
        steps = max(steps, math.ceil(20000 / batch))
        return _train_lm_row(batch, precision, steps, data, device)
    return _time_step_row(row, batch, precision, steps, device)


def table(results: list[Result]) -> str:
    """Markdown: per (batch, precision) every row's tokens/s and peak, with ratios to
    the graphed cuDNN step."""
    lines = [
        "| batch | precision | step | tokens/s | vs cudnn-graphed | peak MiB | peak vs it "
        "| steps' peak MiB | vs it |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (batch, precision), group in _groups(results).items():
        base = next((r for r in group if r.row == "cudnn-graphed"), None)
        for r in group:
            speed = "" if base is None else f"{r.tokens_per_s / base.tokens_per_s:.2f}x"
            memory = "" if base is None else f"{r.peak_bytes / base.peak_bytes:.2f}x"
            steps = "" if base is None else f"{r.steps_peak_bytes / base.steps_peak_bytes:.2f}x"
            lines.append(
                f"| {batch} | {precision} | {r.row} | {r.tokens_per_s / 1e3:.1f}k | {speed} "
                f"| {r.peak_bytes / 2**20:.0f} | {memory} | {r.steps_peak_bytes / 2**20:.0f} "
                f"| {steps} |"
            )
    return "\n".join(lines)


def _groups(results: list[Result]) -> dict[tuple[int, str], list[Result]]:
    groups: dict[tuple[int, str], list[Result]] = {}
    for r in results:
        groups.setdefault((r.batch, r.precision), []).append(r)
    return groups


def _progress(r: Result) -> None:
    print(
        f"{r.row} b{r.batch} {r.precision}: {r.tokens_per_s / 1e3:.1f}k tokens/s, "
        f"peak {r.peak_bytes / 2**20:.0f} MiB",
        file=sys.stderr,
        flush=True,
    )


def _save(path: Path, results: list[Result]) -> None:
    """After every row: a run cut short keeps what it measured."""
    record = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "results": [dataclasses.asdict(r) for r in results],
    }
    path.write_text(json.dumps(record, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mirrorgrad.bench.lm_step",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for lm_step.json")
    parser.add_argument("--data", type=Path, help="corpus of the train-lm row (default: train's)")
    parser.add_argument("--batch", type=int, nargs="+", default=[20, 128])
    precisions = list(PRECISIONS)
    parser.add_argument("--precision", nargs="+", choices=precisions, default=precisions)
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    parser.add_argument("--steps", type=int, default=60, help="timed steps per row (>= 10)")
    parser.add_argument("--small-cublas-workspace", action="store_true",
                        help="every row with 4 MiB cuBLAS workspaces, as train-lm's")
    parser.add_argument("--one-row", choices=ROWS, help=argparse.SUPPRESS)  # a child's row
    args = parser.parse_args(argv)
    if args.steps < 10 or any(b < 1 for b in args.batch):
        parser.error("--steps must be >= 10 and every --batch >= 1")
    if not torch.cuda.is_available():
        parser.error("the LM-step table needs a CUDA device (CUDA Graphs)")
    if args.data is not None and not args.data.exists():
        parser.error(f"--data {args.data}: no such file or folder")
    if args.one_row == "train-lm":  # as `mirrorgrad train lm` runs: before CUDA starts
        small_cublas_workspaces()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    torch.set_float32_matmul_precision("high")  # TF32, as `mirrorgrad train lm` runs
    if args.one_row is not None:
        result = _measure(args.one_row, args.batch[0], args.precision[0], args.steps,
                          args.data, device)  # fmt: skip
        print(json.dumps(dataclasses.asdict(result)))
        return 0
    results = []
    for batch in args.batch:
        for precision in args.precision:
            for row in args.rows:
                result = _measure_in_child(row, batch, precision, args.steps, args)
                results.append(result)
                _progress(result)
                _save(args.out / "lm_step.json", results)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
