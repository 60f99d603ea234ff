"""A conv-augmented encoder on the GPU: each mode's run, gradients against eager, peak.

    PYTHONPATH=src python tests/gpu_encoder_probe.py OUT_DIR [--layers 2] [--dropout 0.0]

(``--small`` runs a tiny encoder, on the CPU without CUDA and then without peaks: a
check of the script itself.)

For ``mirrorgrad.compile`` balance, budget 0.5, budget 0.3 and ``torch.compile``: the
status (ok / fallback with its cause / crash), the plans applied, the largest gradient
difference from eager (relative to the largest gradient entry; dropout off by
default so the runs are comparable), and the peak of a training step (the second one:
the first compiles) against eager's and torch.compile's. The target is
balance's peak <= min(eager, torch.compile). Writes OUT_DIR/encoder_probe.json and
prints a table last.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mirrorgrad
from mirrorgrad.mirror.partition import MirrorgradFallbackWarning
from test_compile_encoder import encoder

SHAPES = {"issue": (144, 4, 1000, 16), "small": (16, 4, 12, 2)}  # E, H, T, B
MODES = {
    "eager": None,
    "torch.compile": lambda m: torch.compile(m),
    "balance": lambda m: mirrorgrad.compile(m, mode="balance"),
    "budget 0.5": lambda m: mirrorgrad.compile(m, mode="budget", budget=0.5),
    "budget 0.3": lambda m: mirrorgrad.compile(m, mode="budget", budget=0.3),
}


def _step(model, step_fn, inputs) -> None:
    model.zero_grad(set_to_none=True)
    step_fn(*inputs).square().mean().backward()


def _peak_of_step(model, step_fn, inputs) -> int | None:
    if not torch.cuda.is_available():
        _step(model, step_fn, inputs)
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    _step(model, step_fn, inputs)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def _grad_error(model, reference) -> float:
    """Largest difference over the largest gradient entry, both over all parameters (one
    scale: the depthwise conv's bias, followed by BatchNorm, has a gradient of ~0)."""
    pairs = list(zip(model.parameters(), reference.parameters()))
    scale = max(q.grad.abs().max().item() for _, q in pairs) or 1.0
    return max((p.grad - q.grad).abs().max().item() for p, q in pairs) / scale


def run(name: str, reference, inputs, eager_model) -> dict:
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    model = copy.deepcopy(reference)
    make = MODES[name]
    step_fn = model if make is None else make(model)
    row: dict = {"mode": name, "status": "ok", "plans": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            torch.manual_seed(0)
            _step(model, step_fn, inputs)  # compiles
            first_grads = [p.grad.cpu() for p in model.parameters()]
            row["peak"] = _peak_of_step(model, step_fn, inputs)
        except Exception as exc:  # a crash is a result here, not an error of the probe
            first_line = (str(exc).strip().splitlines() or ["no message"])[0]
            row.update(status=f"crash: {type(exc).__name__}: {first_line[:150]}", peak=None)
            return row
    fallback = MirrorgradFallbackWarning
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, fallback)]
    if fallbacks:
        row["status"] = "fallback: " + "; ".join(f[:200] for f in fallbacks)
    plans = getattr(step_fn, "_mirrorgrad_plans", None)
    row["plans"] = None if plans is None else len(plans)
    if eager_model is not None:
        for p, g in zip(model.parameters(), first_grads):
            p.grad = g.to(p.device)
        row["grad_error"] = _grad_error(model, eager_model)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--small", action="store_true")
    args = parser.parse_args()
    if not (torch.cuda.is_available() or args.small):
        sys.exit("needs CUDA (or --small, to check the script on the CPU)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    E, H, T, B = SHAPES["small" if args.small else "issue"]
    torch.manual_seed(0)
    reference = encoder(E, H, args.layers, p=args.dropout).to(device)
    a = torch.randn(B, T, E, device=device)
    mask = torch.zeros(B, T, dtype=torch.bool, device=device)
    mask[0, T // 2 :] = True
    inputs = (a, mask)

    eager_model = copy.deepcopy(reference)
    torch.manual_seed(0)
    _step(eager_model, eager_model, inputs)
    rows = []
    for name in MODES:
        rows.append(run(name, reference, inputs, eager_model if name != "eager" else None))
        print(json.dumps(rows[-1]), flush=True)

    peaks = {r["mode"]: r["peak"] for r in rows}
    for r in rows:
        for base in ("eager", "torch.compile"):
            ok = r["peak"] and peaks[base]
            r[f"peak_vs_{base}"] = round(r["peak"] / peaks[base], 3) if ok else None
    floor = [p for p in (peaks["eager"], peaks["torch.compile"]) if p]
    balance = peaks.get("balance")
    item4 = balance <= min(floor) if balance and floor else None  # None: not measured
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": {"E": E, "H": H, "T": T, "B": B, "layers": args.layers, "dropout": args.dropout},
        "rows": rows,
        "balance_peak_le_min_eager_compile": item4,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "encoder_probe.json").write_text(json.dumps(result, indent=2))

    print(f"\n{result['device']}, torch {result['torch']}, encoder L={args.layers}")
    print(f"{'mode':<14} {'status':<10} {'plans':>5} {'grad err':>9} {'peak MiB':>9} "
          f"{'/eager':>7} {'/compile':>8}")  # fmt: skip
    for r in rows:
        status = r["status"].split(":")[0]
        err = f"{r['grad_error']:.1e}" if "grad_error" in r else "-"
        peak = f"{r['peak'] / 2**20:.0f}" if r["peak"] else "-"
        plans = "-" if r["plans"] is None else r["plans"]
        vs_eager, vs_compile = r["peak_vs_eager"] or "-", r["peak_vs_torch.compile"] or "-"
        print(
            f"{r['mode']:<14} {status:<10} {plans:>5} {err:>9} {peak:>9} "
            f"{vs_eager:>7} {vs_compile:>8}"
        )
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['mode']}: {r['status']}")
    print(f"balance peak <= min(eager, torch.compile): {item4}")


if __name__ == "__main__":
    main()
