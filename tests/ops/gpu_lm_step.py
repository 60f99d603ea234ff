"""GPU script: the LM training step (train/model.py) against PyTorch's word_language_model.

Variants: PyTorch's model (nn.LSTM, cuDNN) eager; mirrorgrad's LanguageModel eager, under
torch.compile and under mirrorgrad.compile(mode="balance"), the compiled ones with and
without whole-step CUDA graphs (Inductor's ``triton.cudagraphs``). Every (preset, batch,
variant) runs in a fresh subprocess with empty Inductor and Triton caches, so "cold" (the
first step, compile included) is cold; a failing variant is reported and the rest go on.

    python tests/ops/gpu_lm_step.py OUT_DIR [--preset medium large] [--batch 20 128]
                                            [--variants NAME ...] [--budget-s 420]

Per step as the train loop runs it: forward, zero_grad, backward, clip_grad_norm_, SGD;
the LSTM state carried across steps (detached, cloned: a CUDA Graph overwrites its
outputs at the next replay), ``torch.compiler.cudagraph_mark_step_begin()`` first.
Writes OUT_DIR/lm_step.json, compile_times_<run>.txt (torch._dynamo's timers of the
cold compile) and prof_<run>.txt (a profile of 5 warm steps); prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMPILED = ("mg-torch.compile", "mg-torch.compile+cg", "mg-balance", "mg-balance+cg")
VARIANTS = ("pytorch-eager", "mg-eager", *COMPILED)
VOCAB = 10_000
STEPS = 40
WARM = 5
DEVICE = "cuda"


def _word_lm(preset):
    """PyTorch's word_language_model (examples/word_language_model, LSTM, untied)."""
    import torch.nn.functional as F
    from torch import nn

    class WordLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Embedding(VOCAB, preset.embedding)
            self.drop = nn.Dropout(preset.dropout)
            self.rnn = nn.LSTM(preset.embedding, preset.hidden, preset.layers,
                               dropout=preset.dropout)  # fmt: skip
            self.decoder = nn.Linear(preset.hidden, VOCAB)

        def forward(self, tokens, targets, state):
            out, state = self.rnn(self.drop(self.encoder(tokens)), state)
            logits = self.decoder(self.drop(out))
            return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1)), state

    return WordLM()


def _build(variant: str, preset):
    """(model whose parameters train, the callable a step runs)."""
    import torch

    import mirrorgrad
    from mirrorgrad.train.model import LanguageModel

    torch.manual_seed(0)
    if variant == "pytorch-eager":
        model = _word_lm(preset).to(DEVICE)
        return model, model
    model = LanguageModel(VOCAB, preset).to(DEVICE)
    cudagraphs = {"options": {"triton.cudagraphs": True}} if variant.endswith("+cg") else {}
    if variant == "mg-eager":
        return model, model
    if variant.startswith("mg-torch.compile"):
        return model, torch.compile(model, **cudagraphs)
    return model, mirrorgrad.compile(model, mode="balance", **cudagraphs)


def _stepper(model, step_model, preset, batch: int):
    """One training step as train/loop.py runs it; returns the loss (a fresh tensor)."""
    import torch
    from torch import nn

    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    tokens = torch.randint(0, VOCAB, (preset.bptt, batch), device=DEVICE)
    targets = torch.randint(0, VOCAB, (preset.bptt, batch), device=DEVICE)
    zeros = torch.zeros(preset.layers, batch, preset.hidden, device=DEVICE)
    carried = [(zeros, zeros.clone())]

    def step():
        torch.compiler.cudagraph_mark_step_begin()
        loss, (h, c) = step_model(tokens, targets, carried[0])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        opt.step()
        carried[0] = (h.detach().clone(), c.detach().clone())
        return loss.detach().clone()

    return step


def _time_steps(step, n: int) -> list[float]:
    import torch

    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def _profile(step, path: Path) -> float:
    """Profile 5 steps into ``path``; returns the GPU time per step (ms)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    path.write_text(
        events.table(sort_by="cuda_time_total", row_limit=30)
        + "\n\nCPU\n"
        + events.table(sort_by="cpu_time_total", row_limit=30)
    )
    device_us = sum(getattr(e, "self_device_time_total", 0) for e in events)
    return device_us / 5 / 1e3


def _child(variant: str, preset_name: str, batch: int, out: Path) -> dict:
    """Runs in the subprocess: build, cold step, warm-up, timed steps, profile."""
    import torch
    import torch._dynamo.utils as dynamo_utils

    from mirrorgrad.train.config import PRESETS

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    preset = PRESETS[preset_name]
    tag = f"{preset_name}-B{batch}-{variant}"
    model, step_model = _build(variant, preset)
    step = _stepper(model, step_model, preset, batch)
    torch.cuda.synchronize()
    base, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    start = time.perf_counter()
    first_loss = float(step())
    cold = time.perf_counter() - start
    if variant in COMPILED:
        (out / f"compile_times_{tag}.txt").write_text(str(dynamo_utils.compile_times()))
    for _ in range(WARM):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = _time_steps(step, STEPS)
    last_loss = float(step())
    torch.cuda.synchronize()
    result = dict(
        run=tag, variant=variant, preset=preset_name, batch=batch, cold_s=round(cold, 2),
        ms=round(statistics.median(times), 3), min_ms=round(min(times), 3),
        tok_s=round(preset.bptt * batch / statistics.median(times) * 1e3),
        peak_mib=round((torch.cuda.max_memory_allocated() - base) / 2**20, 1),
        retained_mib=round((torch.cuda.memory_allocated() - base) / 2**20, 1),
        reserved_mib=round((torch.cuda.memory_reserved() - base_reserved) / 2**20, 1),
        cg_skips=int(dynamo_utils.counters["inductor"]["cudagraph_skips"]),
        first_loss=round(first_loss, 4), last_loss=round(last_loss, 4),
    )  # fmt: skip
    result["gpu_ms"] = round(_profile(step, out / f"prof_{tag}.txt"), 3)
    return result


def _run_one(variant: str, preset: str, batch: int, out: Path, timeout: float) -> dict:
    """The variant in a subprocess with fresh, empty compile caches."""
    tag = f"{preset}-B{batch}-{variant}"
    caches = Path(tempfile.mkdtemp(prefix=f"lm-step-{variant}-"))
    env = dict(os.environ, TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0",
               TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
               TRITON_CACHE_DIR=str(caches / "triton"), TORCH_LOGS="perf_hints")  # fmt: skip
    command = [sys.executable, __file__, str(out), "--child", variant, "--preset", preset,
               "--batch", str(batch)]  # fmt: skip
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(run=tag, variant=variant, error=f"timed out after {timeout:.0f} s")
    (out / f"log_{tag}.txt").write_text(done.stdout + "\n--- stderr\n" + done.stderr)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
            skips = [ln.strip() for ln in done.stderr.splitlines() if "skipping cudagraphs" in ln]
            result["cg_skip_reasons"] = sorted(set(skips))[:3]
            return result
    tail = done.stderr.strip().splitlines()[-3:]
    return dict(run=tag, variant=variant, error=f"exit {done.returncode}: {' | '.join(tail)}")


COLUMNS = ("run", "cold_s", "ms", "min_ms", "gpu_ms", "tok_s", "peak_mib", "retained_mib",
           "reserved_mib", "cg_skips", "first_loss", "last_loss")  # fmt: skip


def _table(results: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in results:
        if "error" in r:
            error = r["error"][:200].replace("|", "/")
            lines.append(f"| {r['run']} | FAILED: {error} |")
        else:
            lines.append("| " + " | ".join(str(r.get(c, "")) for c in COLUMNS) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for lm_step.json, timers, profiles")
    parser.add_argument("--preset", nargs="+", default=["medium"])
    parser.add_argument("--batch", nargs="+", type=int, default=[20])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip runs after this")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child:
        result = _child(args.child, args.preset[0], args.batch[0], args.out)
        print("RESULT " + json.dumps(result), flush=True)
        return
    start, results = time.perf_counter(), []
    for preset in args.preset:
        for batch in args.batch:
            for variant in args.variants:
                left = args.budget_s - (time.perf_counter() - start)
                if left < 20:
                    results.append(dict(run=f"{preset}-B{batch}-{variant}", error="no time left"))
                    continue
                results.append(_run_one(variant, preset, batch, args.out, timeout=left))
                print(json.dumps(results[-1]), flush=True)
                (args.out / "lm_step.json").write_text(json.dumps(results, indent=1))
    print(_table(results))


if __name__ == "__main__":
    main()
