"""The largest batch whose training step fits under a memory cap, per workload and method.

    python benchmarks/max_batch.py --cap-gb 40 --workloads lstm-lm-medium \
        --methods eager mirror-balance --out DIR [--dtype bf16] [--max-probes 6]

A first probe at the workload's batch measures the step's peak (the bench's step: see
`mirrorgrad.bench.runner`); from it a guess (parameters and gradients fixed, the rest
linear in the batch), then a search: gallop from the guess, then bisect. Every probe is a
fresh process (this script with ``--probe``) whose CUDA allocator is capped at the cap
(``torch.cuda.set_per_process_memory_fraction``), so a step that does not fit fails as
training would; on the CPU the estimated peak stands in for a limit. Writes
``max_batch.json``; prints a table last.

Each probe is expensive (a fresh process, often a compile), so the search starts
from a guess extrapolated from one measured peak and stops after ``max_probes``;
then the answer is a bracket: ``largest_fit`` fits, ``smallest_fail`` does not.
Probes that fit report their peak: memory is close to linear in the batch, so once two
have, the line through them predicts the answer (a secant step), tried in turn with
bisection so that a poor prediction costs at most every other probe.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mirrorgrad._folders import FolderNotWritable, probe_writable
from mirrorgrad.bench.runner import DTYPES, RunOptions, default_device, measure
from mirrorgrad.bench.suites import METHODS, WORKLOADS, get_method, get_workload

MARKER = "@@max_batch "

# First gallop step as a fraction of the guess, doubling after each probe: memory is
# close to linear in the batch, so a guess from one measurement is near the answer.
_FIRST_STEP = 0.05


@dataclass(kw_only=True, slots=True)
class BatchSearch:
    largest_fit: int | None = None
    smallest_fail: int | None = None
    probes: list[tuple[int, bool]] = field(default_factory=list)
    # Measured peak bytes of the probes that fit and reported one.
    peaks: dict[int, int] = field(default_factory=dict)

    def record(self, batch: int, fits: bool, peak_bytes: int | None = None) -> None:
        self.probes.append((batch, fits))
        if fits and peak_bytes is not None:
            self.peaks[batch] = peak_bytes
        if fits:
            self.largest_fit = max(batch, self.largest_fit or 0)
        else:
            self.smallest_fail = min(batch, self.smallest_fail or batch)

    @property
    def exact(self) -> bool:
        """Is ``largest_fit`` the answer, not only a lower bound?"""
        if self.smallest_fail is None:
            return False
        return self.smallest_fail == (self.largest_fit or 0) + 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "largest_fit": self.largest_fit,
            "smallest_fail": self.smallest_fail,
            "exact": self.exact,
            "probes": [list(p) for p in self.probes],
        }


def guess_batch(*, batch: int, peak_bytes: int, fixed_bytes: int, cap_bytes: int) -> int:
    """Batch whose peak reaches ``cap_bytes`` if the peak is ``fixed + per_sample * batch``
    (``fixed``: parameters and gradients), from one measurement at ``batch``."""
    per_sample = max(1.0, (peak_bytes - fixed_bytes) / batch)
    return max(1, math.floor((cap_bytes - fixed_bytes) / per_sample))


def search_max_batch(
    fits: Callable[[int], bool | tuple[bool, int | None]],
    *,
    guess: int,
    max_probes: int,
    limit: int = 1 << 20,
    cap_bytes: int | None = None,
) -> BatchSearch:
    """Largest ``b`` in ``[1, limit]`` with ``fits(b)``, assuming ``fits`` is monotone.

    ``fits`` may return ``(fits, peak_bytes)``; with ``cap_bytes`` the peaks steer the
    search (secant steps)."""
    if max_probes < 1:
        raise ValueError(f"max_probes must be >= 1, got {max_probes}")
    result = BatchSearch()
    b = min(max(1, guess), limit)
    step = max(1, round(b * _FIRST_STEP))
    secant_last = False
    for _ in range(max_probes):
        answer = fits(b)
        ok, peak = answer if isinstance(answer, tuple) else (answer, None)
        result.record(b, bool(ok), peak)
        lo, hi = result.largest_fit or 0, result.smallest_fail
        if hi == lo + 1 or (hi is None and lo >= limit):
            break
        upper = limit if hi is None else hi - 1
        predicted = _secant(result, cap_bytes)
        if predicted is not None and not secant_last:
            # Into the open bracket: a line at or below lo says lo is the top (lo + 1
            # is the probe that proves it); one past the failing batch says hi - 1.
            b = min(max(predicted, lo + 1), upper)
            secant_last = hi is not None
        else:
            if hi is None:
                b = min(limit, lo + step)
            elif lo == 0:
                b = max(1, hi - step)
            else:
                b = (lo + hi) // 2
            secant_last = False
        step *= 2
    return result


def _secant(result: BatchSearch, cap_bytes: int | None) -> int | None:
    """The batch at which the line through the two largest measured peaks meets the cap."""
    if cap_bytes is None or len(result.peaks) < 2:
        return None
    (b0, p0), (b1, p1) = sorted(result.peaks.items())[-2:]
    slope = (p1 - p0) / (b1 - b0)
    if slope <= 0:
        return None
    return math.floor(b1 + (cap_bytes - p1) / slope)


# ---- one probe, in its own process -------------------------------------------------


def probe(workload: str, method: str, opts: RunOptions, cap_bytes: int) -> dict[str, Any]:
    """Does one step of ``method`` at ``opts.batch`` fit under ``cap_bytes``? On a GPU the
    allocator itself is capped; on the CPU the estimated peak is held against the cap."""
    if opts.device.startswith("cuda"):
        index = torch.device(opts.device).index
        index = torch.cuda.current_device() if index is None else index
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), index)
    result = measure(get_workload(workload), get_method(method), opts)
    if result.status != "ok":
        return {"batch": result.batch, "fits": False, "error": result.error}
    fits = result.peak_bytes <= cap_bytes
    return {"batch": result.batch, "fits": fits, "peak_bytes": result.peak_bytes,
            "param_bytes": result.param_bytes}  # fmt: skip


def _probe_main(argv: list[str]) -> int:
    """``--probe WORKLOAD METHOD BATCH CAP_BYTES`` and the options of `_parser`."""
    workload, method, batch, cap = argv[:4]
    args = _parser().parse_args(argv[4:])
    device = args.device or default_device(args.quick)
    if device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")  # as the bench's worker
    opts = RunOptions(dtype=args.dtype, steps=1, warmup=1, quick=args.quick,
                      backend=args.backend, device=device, batch=int(batch))  # fmt: skip
    print(MARKER + json.dumps(probe(workload, method, opts, int(cap))), flush=True)
    return 0


def _run_probe(args: argparse.Namespace, workload: str, method: str, batch: int) -> dict:
    cmd = [sys.executable, __file__, "--probe", workload, method, str(batch)]
    cmd += [str(int(args.cap_gb * 1e9)), "--dtype", args.dtype, "--backend", args.backend]
    cmd += [*(["--device", args.device] if args.device else []), *(["--quick"] * args.quick)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.probe_timeout)
    except subprocess.TimeoutExpired:
        return {"batch": batch, "fits": False, "error": "probe timed out"}
    for line in done.stdout.splitlines():
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER) :])
    tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
    return {"batch": batch, "fits": False, "error": f"probe exited {done.returncode}: {tail[0]}"}


# ---- the search per workload and method --------------------------------------------


def find(args: argparse.Namespace, workload: str, method: str) -> dict[str, Any]:
    """The first probe at the workload's batch, the guess from it, and the search."""
    cap = int(args.cap_gb * 1e9)
    w = get_workload(workload)
    first = _run_probe(args, workload, method, w.quick_batch if args.quick else w.batch)
    records = [first]

    def fits(batch: int) -> tuple[bool, int | None]:
        records.append(_run_probe(args, workload, method, batch))
        return bool(records[-1]["fits"]), records[-1].get("peak_bytes")

    if "peak_bytes" in first:
        guess = guess_batch(batch=first["batch"], peak_bytes=first["peak_bytes"],
                            fixed_bytes=2 * first["param_bytes"], cap_bytes=cap)  # fmt: skip
    else:  # the first probe failed: start below it
        guess = max(1, first["batch"] // 2)
    found = search_max_batch(fits, guess=guess, max_probes=args.max_probes, cap_bytes=cap)
    if first["fits"]:
        found.record(first["batch"], True, first["peak_bytes"])
    return {"workload": workload, "method": method, "guess": guess, **found.to_dict(),
            "probe_records": records}  # fmt: skip


def _table(rows: list[dict[str, Any]], cap_gb: float) -> str:
    lines = [f"Largest batch under {cap_gb:g} GB:", "", "| workload | method | largest batch |"
             " probes | errors |", "|---|---|---:|---:|---|"]  # fmt: skip
    for r in rows:
        best = r["largest_fit"]
        cell = "none" if best is None else f"{best}" if r["exact"] else f">={best}"
        errors = sorted({p["error"] for p in r["probe_records"] if p.get("error")})
        lines.append(f"| {r['workload']} | {r['method']} | {cell} | {len(r['probes'])} | "
                     f"{'; '.join(errors)} |")  # fmt: skip
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python benchmarks/max_batch.py", description=__doc__)
    p.add_argument("--cap-gb", type=float, help="the memory cap, GB (1e9 bytes)")
    p.add_argument("--workloads", nargs="+", default=[], metavar="NAME")
    p.add_argument("--methods", nargs="+", default=["eager"], metavar="NAME")
    p.add_argument("--max-probes", type=int, default=6, help="probes per search after the first")
    p.add_argument("--probe-timeout", type=float, default=600.0, help="seconds per probe")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--backend", choices=["inductor", "eager"], default="inductor")
    p.add_argument("--device", help="default: cuda if available (cpu with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny sizes on the CPU (for tests)")
    p.add_argument("--out", type=Path, default=Path("max-batch"), help="output folder")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--probe"]:
        return _probe_main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if args.cap_gb is None or not (math.isfinite(args.cap_gb) and args.cap_gb > 0):
        parser.error(f"--cap-gb must be a finite number > 0, got {args.cap_gb}")
    if args.max_probes < 1:
        parser.error(f"--max-probes must be >= 1, got {args.max_probes}")
    for name, known in [("workload", WORKLOADS), ("method", METHODS)]:
        unknown = [n for n in getattr(args, f"{name}s") if n not in known]
        if unknown:
            parser.error(f"unknown {name} {', '.join(unknown)}; choose from {', '.join(known)}")
    if not args.workloads:
        parser.error("name at least one workload (mirrorgrad bench --list names them)")
    try:
        probe_writable(args.out, "--out")
    except FolderNotWritable as e:
        parser.error(str(e))
    rows = []
    for workload in args.workloads:
        for method in args.methods:
            rows.append(find(args, workload, method))
            text = json.dumps({**vars(args), "out": str(args.out), "results": rows}, indent=1)
            (args.out / "max_batch.json").write_text(text)
    print(_table(rows, args.cap_gb))
    return 0


if __name__ == "__main__":
    sys.exit(main())
