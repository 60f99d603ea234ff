"""One training step of the language model: the compile that plans it, and the SGD step.

Public so that a benchmark can time exactly the step `mirrorgrad train lm` runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

import mirrorgrad
from mirrorgrad import _compat
from mirrorgrad.options import MirrorOptions
from mirrorgrad.train import distributed
from mirrorgrad.train.distributed import World
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

    ``cuda_graphs`` (default: on a GPU) replays the whole forward and the whole backward
    as CUDA Graphs (Inductor's ``triton.cudagraphs``). NOTE: the medium LM step is
    host-bound without them: 6.7 ms compiled, 4.2 ms with them on an H100
    (docs/BENCHMARKS.md). Data parallelism keeps them: the gradients are averaged after
    the backward (``reduce_gradients`` of ``sgd_step``), outside the graphs.
    """
    if cuda_graphs is None:
        cuda_graphs = device.type == "cuda"
    options = {"options": {"triton.cudagraphs": True}} if cuda_graphs else {}
    return mirrorgrad.compile(model, backend=backend_for(device), **mirror.as_kwargs(), **options)


def compile_for_world(
    model: nn.Module, mirror: MirrorOptions, device: torch.device, world: World
) -> tuple[Callable[..., Any], Callable[[], None] | None]:
    """The compiled step for this process and, under ``torchrun``, what averages the
    gradients over the processes after its backward (``reduce_gradients`` of ``sgd_step``).

    The default (``allreduce``) compiles the plain model as on one GPU, CUDA Graphs
    included, and averages the gradients in place after the backward. DDP's wrapper
    turned the graphs off (its hooks run inside the backward), split the graph at its
    buckets (a slower first compile) and kept buckets beside the backward's outputs;
    the DDP modes stay for the benchmark that compares them
    (``distributed.data_parallel_mode``, docs/BENCHMARKS.md).
    """
    mode = distributed.data_parallel_mode() if world.distributed else "allreduce"
    if mode in ("allreduce", "allreduce-rows"):
        distributed.broadcast_parameters(world, model)
        average = functools.partial(distributed.average_gradients, world, list(model.parameters()))
        return compile_for_training(model, mirror, device), average if world.distributed else None
    ddp = nn.parallel.DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,  # the gradients are views of the buckets
        static_graph=mode != "ddp",
    )
    graphs = mode != "ddp" and device.type == "cuda"
    compiled = compile_for_training(ddp, mirror, device, cuda_graphs=graphs)
    if mode != "ddp-graphs-whole":
        return compiled, None

    def whole_graph(*args: Any) -> Any:  # Dynamo reads the setting as it compiles
        with _compat.ddp_graph_split(False):
            return compiled(*args)

    return whole_graph, None


def sgd_step(
    step_model: Callable[..., Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tokens: Tensor,
    targets: Tensor,
    state: State,
    *,
    clip: float,
    reduce_gradients: Callable[[], None] | None = None,
) -> tuple[Tensor, Tensor, State]:
    """Forward, backward, gradient-norm clip and optimizer step on one BPTT window.

    ``step_model`` is ``model`` compiled (and perhaps DDP-wrapped). ``reduce_gradients``
    runs between the backward and the clip (data parallelism: the average over ranks,
    so the clip sees the gradient of the whole batch). The state is carried in but not
    its gradient (truncated BPTT). Returns the loss, the gradient norm before clipping
    and the next state, all detached and on the device (no sync).
    """
    # A new step for CUDA Graph trees (a no-op without them): the last step's outputs
    # may be overwritten from here on, so what the caller keeps is cloned below.
    torch.compiler.cudagraph_mark_step_begin()
    # Before the forward: the last step's gradients would otherwise stay alive through
    # it (75 MiB on the medium LM, measured in its peak on an H100; docs/BENCHMARKS.md).
    optimizer.zero_grad(set_to_none=True)
    state = (state[0].detach(), state[1].detach())
    loss, (h, c) = step_model(tokens, targets, state)
    loss.backward()
    if reduce_gradients is not None:
        reduce_gradients()
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    return loss.detach().clone(), grad_norm, (h.detach().clone(), c.detach().clone())
