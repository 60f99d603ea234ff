"""Where `mirrorgrad train lm`'s peak comes from, on a GPU: the memory held after the
first steps, grouped by the code that allocated it, and the final evaluation's own peak.

    PYTHONPATH=src python benchmarks/train_lm_memory.py --data corpus [--batch 20]
        [--precision fp32] [--steps 50] [--top 14]

Runs `train lm --model medium` (one CUDA Graph per step on one GPU) with the allocator's
history on. After step 2 it prints the step's peak, what is allocated, the bytes the RNN
op's loop cache holds, the blocks alive at the peak so far and the live blocks, by the
line that allocated them (peak_compare's innermost frame outside torch); then the peak of
the remaining steps and of the final evaluation, with the blocks it allocated that were
alive at its peak. The same model graphed uncompiled (`python -m mirrorgrad.bench.lm_step
--rows ours-graphed`) is the comparison: what this holds beyond it is the compiled run's own.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

from mirrorgrad import _compat
from mirrorgrad.bench.lm_step import run_train_lm
from mirrorgrad.ops.rnn import cuda_graphs
from mirrorgrad.train import evaluation, loop

# Run as a script, the repository root is not on the path: its sibling comes from there.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.peak_compare import _replay, _source

MiB = 2**20


def _stream_name(stream: int) -> str:
    """The stream's role: cuBLAS keeps a workspace per (thread's handle, stream)."""
    from mirrorgrad._cuda_graphs import side_stream

    names = {torch.cuda.default_stream().cuda_stream: "default",
             side_stream().cuda_stream: "side"}  # fmt: skip
    return names.get(stream, hex(stream))


def live_blocks(top: int) -> list[tuple[float, int, str, str, str]]:
    """(MiB, blocks, pool, stream, where) of the live blocks, summed by pool, stream and
    allocating line."""
    sizes: Counter[tuple[str, str, str]] = Counter()
    counts: Counter[tuple[str, str, str]] = Counter()
    for segment in _compat.memory_snapshot()["segments"]:
        pool = str(segment.get("segment_pool_id"))
        stream = _stream_name(segment.get("stream", 0))
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                key = (pool, stream, _source(block))
                sizes[key] += block["size"]
                counts[key] += 1
    return [(size / MiB, counts[key], *key) for key, size in sizes.most_common(top)]


def chain_of(pattern: str, limit: int = 14) -> list[str]:
    """The frames outside torch (innermost first) that allocated the first live block whose
    allocating line contains ``pattern``: who holds memory that no step should."""
    for segment in _compat.memory_snapshot()["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated" and pattern in _source(block):
                frames = [f for f in block.get("frames") or []
                          if "/torch/" not in f["filename"] or "mirrorgrad" in f["filename"]]
                return [f"{Path(f['filename']).name}:{f['line']} {f['name']}"
                        for f in frames[:limit]]  # fmt: skip
    return []


def blocks_at_peak(start: int, top: int) -> list[tuple[float, int, str]]:
    """(MiB, blocks, where) of the blocks alive at the recording's peak from trace
    position ``start`` on that were allocated after it, by allocating line."""
    snapshot = _compat.memory_snapshot()
    trace = snapshot["device_traces"][0]
    _, _, blocks = _replay(snapshot, 0, start)
    sizes: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for size, at in blocks.values():
        if at >= start:
            where = _source(trace[at])
            sizes[where] += size
            counts[where] += 1
    return [(size / MiB, counts[where], where) for where, size in sizes.most_common(top)]


def print_auto_choices() -> None:
    """impl="auto"'s choice and the ms each candidate measured, per shape key: the final
    evaluation times its candidates afresh at the eval batch (cuDNN's among them)."""
    from mirrorgrad.ops.rnn import dispatch

    for key, choice in dispatch._AUTO_CHOICE.items():
        fields = dict(zip(dispatch._KEY_FIELDS, key))
        # What follows the fields: "captured" (timed inside a CUDA Graph), "compiled"
        # (timed on tensors of its own while torch.compile traced).
        how = " ".join(key[len(dispatch._KEY_FIELDS):]) or "uncaptured"
        times = ", ".join(f"{k} {v:.3f}" for k, v in dispatch.AUTO_TIMES.get(key, {}).items())
        print(f"  {fields['dtype']} T {fields['T']} B {fields['B']} grads {fields['grads']} "
              f"{how}: {choice} ({times} ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="corpus folder")
    parser.add_argument("--batch", type=int, default=20)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--top", type=int, default=14, help="groups of live blocks shown")
    parser.add_argument("--chain", default="input_gemm",
                        help="after step 2, the call chain of a live block allocated by a "
                             "line containing this")  # fmt: skip
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    if not args.data.is_dir():
        parser.error(f"--data {args.data}: no such folder")
    if args.steps < 3:
        parser.error("--steps must be >= 3")

    step, final_losses, calls = loop.StepLoop._step, evaluation.final_losses, [0]

    def traced_step(self, x, y):
        out = step(self, x, y)
        calls[0] += 1
        if calls[0] == 2:
            torch.cuda.synchronize()
            print(f"after step 2: peak {torch.cuda.max_memory_allocated() / MiB:.0f} MiB, "
                  f"allocated {torch.cuda.memory_allocated() / MiB:.0f} MiB, RNN loop cache "
                  f"{cuda_graphs.held_bytes() / MiB:.0f} MiB; live blocks:")  # fmt: skip
            for size, blocks, pool, stream, where in live_blocks(args.top):
                print(f"  {size:8.1f} MiB in {blocks:3d}  pool {pool}  stream {stream:8s}  {where}")
            print("at the peak so far (setup and steps 1-2), alive then:")
            for size, blocks, where in blocks_at_peak(0, args.top):
                print(f"  {size:8.1f} MiB in {blocks:3d}  {where}")
            if args.chain:
                print(f"call chain of a live block from {args.chain!r}:")
                for frame in chain_of(args.chain):
                    print(f"    {frame}")
            torch.cuda.reset_peak_memory_stats()
        return out

    def traced_final_losses(*a, **k):
        torch.cuda.synchronize()
        print(f"steps 3-{args.steps}: peak {torch.cuda.max_memory_allocated() / MiB:.0f} MiB")
        torch.cuda.reset_peak_memory_stats()
        _compat.record_memory_history(False)  # a fresh history: the evaluation's alone
        _compat.record_memory_history(True, max_entries=1_000_000)
        start = len(_compat.memory_snapshot()["device_traces"][0])
        losses = final_losses(*a, **k)
        torch.cuda.synchronize()
        print("at the evaluation's peak, allocated during it:")
        for size, blocks, where in blocks_at_peak(start, args.top):
            print(f"  {size:8.1f} MiB in {blocks:3d}  {where}")
        print(f"final evaluation: peak {torch.cuda.max_memory_allocated() / MiB:.0f} MiB, "
              f"allocated after it {torch.cuda.memory_allocated() / MiB:.0f} MiB, RNN loop "
              f"cache {cuda_graphs.held_bytes() / MiB:.0f} MiB; live blocks:")  # fmt: skip
        for size, blocks, pool, stream, where in live_blocks(args.top):
            print(f"  {size:8.1f} MiB in {blocks:3d}  pool {pool}  stream {stream:8s}  {where}")
        print("impl='auto' choices:")
        print_auto_choices()
        return losses

    loop.StepLoop._step, loop.evaluation.final_losses = traced_step, traced_final_losses
    _compat.record_memory_history(True, max_entries=100_000)
    summary = run_train_lm(args.batch, args.precision, args.steps, args.data)
    _compat.record_memory_history(False)
    print(f"whole run: peak {(summary.peak_measured_bytes or 0) / MiB:.0f} MiB, "
          f"{summary.tokens_per_s / 1e3:.1f}k tokens/s")


if __name__ == "__main__":
    main()
