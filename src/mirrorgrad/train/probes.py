"""What a run knows of its step's memory before training: the mirror plan's estimate and,
on a GPU, one step's measured peak with and without mirroring (both for the summary).

Neither may stop training: a failure is a warning and the summary says n/a.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

import mirrorgrad
from mirrorgrad.nn import dispatch_as_captured
from mirrorgrad.ops.rnn import cuda_graphs
from mirrorgrad.options import MirrorOptions
from mirrorgrad.train import step
from mirrorgrad.train.model import State

if TYPE_CHECKING:
    from mirrorgrad.mirror.plan import Plan

# One training window and a fresh state: what a probe runs the model on.
ExampleInputs = Callable[[], tuple[Tensor, Tensor, State]]


def explain_plan(
    model: nn.Module, example_inputs: ExampleInputs, mirror: MirrorOptions, device: torch.device
) -> Plan | None:
    """The mirror plan of one training step: estimated stash and peak, with and without.

    explain runs one forward, whose RNN loop graphs (no step's) are released after it.
    On a GPU every step this loop runs is captured (one whole-step CUDA Graph, or
    Inductor's graphs under DDP), so ``impl="auto"`` chooses here as captured too: the
    plan is of the implementation the step runs, and no other one runs. Uncaptured, the
    medium LM's plan ran the Triton persistent path while the step runs the CUDA kernel,
    and 15 MiB its input product allocated on the capture thread's stream stayed all run
    (H200; likely that thread's cuBLAS workspaces, not confirmed)."""
    # With --mirror off, "with mirroring" shows what balance mode would give.
    if mirror.mode == "off":
        mirror = dataclasses.replace(mirror, mode="balance")
    as_captured = dispatch_as_captured() if device.type == "cuda" else contextlib.nullcontext()
    with as_captured, cuda_graphs.recording() as recorded:
        try:
            return mirrorgrad.explain(
                model, *example_inputs(), backend=step.backend_for(device), **mirror.as_kwargs()
            )
        except Exception as e:  # an estimate for the log must never stop training
            warnings.warn(f"mirrorgrad.explain failed, no plan in the logs: {e}", stacklevel=2)
            return None
        finally:
            cuda_graphs.release(recorded)


def measure_step_peaks(
    model: nn.Module,
    measured: Callable[..., Any],
    mirror: MirrorOptions,
    device: torch.device,
    example_inputs: ExampleInputs,
) -> tuple[int, int] | None:
    """Measured peak bytes of one forward+backward without and with mirroring.

    Of this rank's GPU; ``measured`` is ``model``'s step as planned with ``mirror``,
    compiled without CUDA Graphs (their replays allocate nothing, so the peak would read
    ~0). Runs before training and leaves no gradients; the caller seeds the RNG afresh
    after it, so training is the same with or without it.
    """
    other = "balance" if mirror.mode == "off" else "off"
    other_model = step.compile_for_training(
        model, MirrorOptions(mode=other), device, cuda_graphs=False
    )
    pair = (measured, other_model) if mirror.mode == "off" else (other_model, measured)
    try:
        return tuple(_step_peak(model, m, example_inputs(), device) for m in pair)
    except Exception as e:  # a measurement for the summary must never stop training
        warnings.warn(f"could not measure the step peaks: {e}", stacklevel=2)
        return None
    finally:
        model.zero_grad(set_to_none=True)


def _step_peak(
    model: nn.Module,
    step_model: Callable[..., Any],
    inputs: tuple[Tensor, Tensor, State],
    device: torch.device,
) -> int:
    for _ in range(2):  # the first call compiles (and may autotune)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        loss, _ = step_model(*inputs)
        loss.backward()
        torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)
