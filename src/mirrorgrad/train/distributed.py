"""Data parallelism under ``torchrun``: process group, gradient averaging, small collectives.

A single process (no ``WORLD_SIZE`` in the environment) takes the same code paths:
every collective here is the identity when the world has one rank.

How the gradients meet (``MIRRORGRAD_DATA_PARALLEL``, an internal switch for the
benchmark ``benchmarks/ddp_scaling.py``; the default is the one measured fastest):

- ``allreduce`` (default): the plain model is compiled exactly as on one GPU (whole-step
  CUDA Graphs), and after the backward each gradient is averaged in place by
  ``torch.distributed.all_reduce``. No wrapper, no buckets: no second copy of the
  gradients, no graph split.
- ``allreduce-rows``: that, with the embedding's gradient sent as the rows that the
  window's tokens (of all ranks) touch: the others are zero on every rank.
- ``ddp``: ``DistributedDataParallel`` (overlapping buckets), compiled without CUDA Graphs.
- ``ddp-graphs``: the same with ``static_graph=True`` and Inductor's CUDA Graphs on.
- ``ddp-graphs-whole``: that, with Dynamo's DDP optimizer off (one graph, no split).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


DATA_PARALLEL_ENV = "MIRRORGRAD_DATA_PARALLEL"
DATA_PARALLEL_MODES = ("allreduce", "allreduce-rows", "ddp", "ddp-graphs", "ddp-graphs-whole")


def data_parallel_mode() -> str:
    """The gradient exchange ``$MIRRORGRAD_DATA_PARALLEL`` names (default allreduce)."""
    mode = os.environ.get(DATA_PARALLEL_ENV, "allreduce")
    if mode not in DATA_PARALLEL_MODES:
        raise ValueError(
            f"{DATA_PARALLEL_ENV}={mode!r}: choose one of {', '.join(DATA_PARALLEL_MODES)} "
            "(or unset it)"
        )
    return mode


class NoGPUError(RuntimeError):
    """CUDA was requested but torch sees no GPU."""


def resolve_device(requested: str, local_rank: int = 0) -> torch.device:
    """auto: the GPU if there is one; cuda without a GPU is an error naming the fix."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise NoGPUError(
            "--device cuda, but torch sees no CUDA GPU (torch.cuda.is_available() is False); "
            "use --device cpu or --device auto, or install a CUDA build of torch"
        )
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


def init(requested_device: str) -> tuple[World, torch.device]:
    """Joins the process group that torchrun describes (nccl on GPUs, gloo on CPUs)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return World(), resolve_device(requested_device)
    world = World(
        rank=int(os.environ["RANK"]),
        world_size=world_size,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )
    device = resolve_device(requested_device, world.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return world, device


def shutdown(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def mean(world: World, value: Tensor) -> Tensor:
    """The average of ``value`` over ranks."""
    if world.distributed:
        value = value.clone()
        dist.all_reduce(value)
        value /= world.world_size
    return value


def maximum(world: World, value: Tensor) -> Tensor:
    """The largest ``value`` over ranks."""
    if world.distributed:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value


def largest(world: World, value: int, device: torch.device) -> int:
    """The largest ``value`` of all ranks, on every rank (a stop signal: all ranks stop
    at the same step, with the same exit status)."""
    if not world.distributed:
        return value
    t = torch.tensor([value], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def broadcast_parameters(world: World, module: torch.nn.Module) -> None:
    """Every rank starts from rank 0's parameters and buffers (as DDP's constructor does)."""
    if world.distributed:
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)


def average_gradients(
    world: World,
    parameters: Iterable[torch.nn.Parameter],
    *,
    rows: tuple[torch.nn.Parameter, Tensor] | None = None,
) -> None:
    """Replaces each ``.grad`` by its mean over ranks, in place (no flat copy).

    ``rows`` (a parameter and row ids): only those rows of its gradient are sent, the
    others being zero on every rank (an embedding's rows that no rank's tokens touch).
    On NCCL one coalesced collective (the tensors run as one group, not one launch
    each); on gloo, which has no AVG and whose coalesced form copies, one sum per
    tensor, all queued before the first wait, then a division. A parameter without a
    gradient on this rank takes part with zeros (the collectives of all ranks must match).
    """
    if not world.distributed:
        return
    grads, sparse = [], None
    for p in parameters:
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if rows is not None and p is rows[0]:
            sparse = p.grad.index_select(0, rows[1])
            grads.append(sparse)
        else:
            grads.append(p.grad)
    if dist.get_backend() == dist.Backend.NCCL:
        dist.all_reduce_coalesced(grads, op=dist.ReduceOp.AVG)
    else:
        works = [dist.all_reduce(g, async_op=True) for g in grads]
        for work, g in zip(works, grads, strict=True):
            work.wait()
            g.div_(world.world_size)
    if rows is not None and sparse is not None:
        rows[0].grad.index_copy_(0, rows[1], sparse)


def window_rows(batches: Tensor, bptt: int) -> Tensor:
    """Per training window of ``batches`` (all ranks' columns), the token ids of its
    inputs, sorted and padded to one length by repeating the first: ``[windows, K]``."""
    count = (batches.shape[0] - 1) // bptt
    ids = [torch.unique(batches[w * bptt : (w + 1) * bptt]) for w in range(count)]
    out = torch.empty(count, max((len(i) for i in ids), default=1), dtype=torch.long)
    for w, i in enumerate(ids):
        out[w, : len(i)] = i
        out[w, len(i) :] = i[0]
    return out


def gather_columns(world: World, tensor: Tensor, dim: int) -> Tensor:
    """Concatenates every rank's shard along ``dim`` (the batch columns)."""
    if not world.distributed:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(world.world_size)]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts, dim=dim)


def gather_objects(world: World, obj: Any) -> list[Any]:
    if not world.distributed:
        return [obj]
    out: list[Any] = [None] * world.world_size
    dist.all_gather_object(out, obj)
    return out
