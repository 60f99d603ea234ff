"""One training step of the language model: the compile that plans it, and the SGD step.

Public so that a benchmark can time exactly the step `mirrorgrad train lm` runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

import mirrorgrad
from mirrorgrad.options import MirrorOptions
from mirrorgrad.train.model import State


def backend_for(device: torch.device) -> str:
    """Inductor on a GPU; on the CPU AOTAutograd's graphs run eagerly (no codegen wait)."""
    return "inductor" if device.type == "cuda" else "eager"


def compile_for_training(
    model: nn.Module,
    mirror: MirrorOptions,
    device: torch.device,
    *,
    cuda_graphs: bool | None = None,
) -> Callable[..., Any]:
    """``model`` compiled by ``mirrorgrad.compile`` with the options of ``--mirror``.

    ``cuda_graphs`` (default: on a GPU, without DDP) replays the whole forward and the
    whole backward as CUDA Graphs (Inductor's ``triton.cudagraphs``). NOTE: the medium LM
    step is host-bound without them: 6.7 ms compiled, 4.2 ms with them on an H100
    (docs/BENCHMARKS.md). DDP's hooks run between the graphs, untested there: off.
    """
    if cuda_graphs is None:
        ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        cuda_graphs = device.type == "cuda" and not ddp
    options = {"options": {"triton.cudagraphs": True}} if cuda_graphs else {}
    return mirrorgrad.compile(
        model, backend=backend_for(device), **mirror.as_kwargs(), **options
    )


def sgd_step(
    step_model: Callable[..., Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tokens: Tensor,
    targets: Tensor,
    state: State,
    *,
    clip: float,
) -> tuple[Tensor, Tensor, State]:
    """Forward, backward, gradient-norm clip and optimizer step on one BPTT window.

    ``step_model`` is ``model`` compiled (and perhaps DDP-wrapped). The state is
    carried in but not its gradient (truncated BPTT). Returns the loss, the gradient
    norm before clipping and the next state, all detached and on the device (no sync).
    """
    # A new step for CUDA Graph trees (a no-op without them): the last step's outputs
    # may be overwritten from here on, so what the caller keeps is cloned below.
    torch.compiler.cudagraph_mark_step_begin()
    state = (state[0].detach(), state[1].detach())
    loss, (h, c) = step_model(tokens, targets, state)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    return loss.detach().clone(), grad_norm, (h.detach().clone(), c.detach().clone())
