"""Gradient check of the bench: a method's first-step gradients against a reference method's.

The reference method (``torch.compile`` in the zoo sweep, cuDNN in the RNN suite) runs
first and leaves its gradients in a file, so a worker started after a crash still
finds them. Models are built from the same seed on the same batch with dropout off, so
the gradients of the first step must agree to float rounding.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

# Relative error (norm of the difference over the norm of the reference, all parameters
# together) above which gradients are called wrong. Generous for fp32: GPU GEMMs run in
# TF32 for every method; a wrong plan or kernel gives errors of order one.
TOLERANCE = {"fp32": 1e-2, "bf16": 5e-2}


def first_step_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, in float64 on the CPU (missing ones left out)."""
    return {
        name: p.grad.detach().double().cpu()
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def compare(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict:
    """``{"grad_error": relative error of all gradients together, "grad_worst": the
    parameter with the largest relative error, "grad_worst_error": its error}``."""
    if set(grads) != set(reference):
        missing = sorted(set(reference) ^ set(grads))[:3]
        raise ValueError(f"gradients of other parameters than the reference's: {missing}")
    diff = sum(float((grads[n] - reference[n]).square().sum()) for n in reference)
    norm = sum(float(reference[n].square().sum()) for n in reference)
    worst_name, worst = None, 0.0
    for name, ref in reference.items():
        err = float((grads[name] - ref).norm() / ref.norm().clamp_min(1e-30))
        if worst_name is None or err > worst:
            worst_name, worst = name, err
    return {
        "grad_error": (diff / max(norm, 1e-300)) ** 0.5,
        "grad_worst": worst_name,
        "grad_worst_error": worst,
    }


class GradCheck:
    """Saves the reference method's gradients to ``path``; compares the others' with them."""

    def __init__(self, reference: str, path: Path, dtype: str) -> None:
        self.reference, self.path, self.tolerance = reference, Path(path), TOLERANCE[dtype]
        self._loaded: dict[str, torch.Tensor] | None = None

    def check(self, method: str, model: nn.Module) -> dict:
        grads = first_step_gradients(model)
        if method == self.reference:
            torch.save(grads, self.path)
            self._loaded = grads
            return {}
        if self._loaded is None:
            if not self.path.exists():
                return {"grad_note": f"no gradients of {self.reference} to compare with"}
            self._loaded = torch.load(self.path, weights_only=True)
        found = compare(grads, self._loaded)
        return found | {"grads_ok": found["grad_error"] <= self.tolerance}
