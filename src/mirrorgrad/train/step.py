"""One training step of the language model: the compile that plans it, and the SGD step.

Public so that a benchmark can time exactly the step `mirrorgrad train lm` runs.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

import mirrorgrad
from mirrorgrad import _compat
from mirrorgrad._cuda_graphs import capture
from mirrorgrad.compiler import own_frame
from mirrorgrad.nn import dispatch_as_captured
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
    # A frame of its own: runs of `train` in one process would otherwise pile compiled
    # entries onto LanguageModel.forward until Dynamo's recompile limit ran the step
    # eagerly. A DDP module is compiled itself, as before: its graph splitting at the
    # buckets and its gradient hooks were tested that way.
    step = model if isinstance(model, nn.parallel.DistributedDataParallel) else own_frame(
        model, "train_step"
    )
    return mirrorgrad.compile(step, backend=backend_for(device), **mirror.as_kwargs(), **options)


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


def whole_step_graph_supported(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer`` cannot be replayed inside `GraphedStep` (None: it can).

    The graph runs plain SGD itself (one fused kernel that reads lr from the device),
    so only what that computes is accepted: no momentum, weight decay, nesterov or
    maximize."""
    if type(optimizer) is not torch.optim.SGD:
        return f"{type(optimizer).__name__} is not plain torch.optim.SGD"
    for group in optimizer.param_groups:
        extras = [k for k in ("momentum", "weight_decay", "dampening") if group[k]]
        extras += [k for k in ("nesterov", "maximize") if group[k]]
        if extras:
            return f"SGD with {', '.join(extras)}"
    return None


class GraphedStep:
    """`sgd_step` as one CUDA Graph: forward, backward, gradient clip and SGD update.

    ``reduce_gradients`` runs between the backward and the clip, inside the graph (data
    parallelism: NCCL collectives can be captured). The first call warms the step up
    uncaptured (it compiles; the weights and RNG are left as they were), then captures
    it; every call replays it. The inputs are copied into the graph's own buffers, the
    next state is written back into them inside the graph, and the learning rate is read
    from the optimizer before each replay (a scheduler may change it). Returns the loss,
    the gradient norm before clipping and the next state; they are the graph's buffers,
    overwritten by the next call.

    With ``capture=False`` the same step runs eagerly, call by call, with the same
    arithmetic (what the tests on a CPU check).
    """

    def __init__(
        self,
        step_model: Callable[..., Any],
        optimizer: torch.optim.Optimizer,
        *,
        clip: float,
        reduce_gradients: Callable[[], None] | None = None,
        capture: bool = True,
        warmup: int = 3,
    ) -> None:
        reason = whole_step_graph_supported(optimizer)
        if reason is not None:
            raise ValueError(f"GraphedStep runs plain SGD in the graph; {reason}")
        self.step_model, self.optimizer = step_model, optimizer
        self.clip, self.capture, self.warmup = clip, capture, warmup
        self.reduce_gradients = reduce_gradients
        self.graph: torch.cuda.CUDAGraph | None = None
        # Per param group: the lr on the device (read by the SGD kernel), and its value.
        device = optimizer.param_groups[0]["params"][0].device
        self._lrs = [torch.zeros((), device=device) for _ in optimizer.param_groups]
        self._lr_set: list[float | None] = [None] * len(optimizer.param_groups)

    def __call__(
        self, tokens: Tensor, targets: Tensor, state: State
    ) -> tuple[Tensor, Tensor, State]:
        self._read_lr()
        if not self.capture:
            self.optimizer.zero_grad(set_to_none=True)
            state = (state[0].detach(), state[1].detach())
            loss, norm, (h, c) = self._body(tokens, targets, state)
            return loss.detach(), norm, (h.detach(), c.detach())
        if self.graph is None:
            self._capture(tokens, targets, state)
        for buffer, value in zip(self._inputs, (tokens, targets, *state)):
            if value is not buffer:
                buffer.copy_(value)
        self.graph.replay()
        return self._loss, self._norm, (self._inputs[2], self._inputs[3])

    def release(self) -> None:
        """Drops the graph and the tensors it rewrites (its memory goes once nothing else
        holds them: the gradients it wrote are the optimizer's to drop); a later call
        captures again."""
        self.graph = None
        self._inputs = self._loss = self._norm = None

    def _body(self, tokens: Tensor, targets: Tensor, state: State) -> tuple[Tensor, Tensor, State]:
        loss, next_state = self.step_model(tokens, targets, state)
        loss.backward()
        if self.reduce_gradients is not None:  # data parallel: captured collectives
            self.reduce_gradients()
        groups = [
            [p for p in group["params"] if p.grad is not None]
            for group in self.optimizer.param_groups
        ]
        # clip_grad_norm_'s scale folded into SGD's lr (p -= lr * coef * g): one pass over
        # the gradients fewer than scaling them in place first (40 us of a 2 ms LM step).
        norm = nn.utils.get_total_norm([p.grad for g in groups for p in g])
        coef = (self.clip / (norm + 1e-6)).clamp(max=1.0)  # as clip_grad_norm_ computes it
        for params, lr in zip(groups, self._lrs):
            _compat.sgd_update_(params, [p.grad for p in params], lr * coef)
        return loss, norm, next_state

    def _read_lr(self) -> None:
        """The optimizer's lr into the graph's lr tensors, where it changed (a fill
        kernel, no sync)."""
        for i, group in enumerate(self.optimizer.param_groups):
            lr = float(group["lr"])
            if lr != self._lr_set[i]:
                self._lrs[i].fill_(lr)
                self._lr_set[i] = lr

    def _capture(self, tokens: Tensor, targets: Tensor, state: State) -> None:
        device = tokens.device
        self._inputs = [t.detach().clone() for t in (tokens, targets, *state)]
        tokens, targets, h, c = self._inputs

        # Warm-up: compiles, autotunes and fills caches; impl="auto" chooses here (the
        # first call), timing its candidates captured. It draws dropout masks, so the
        # RNG is restored after it, and it updates no weight.
        def warm_up() -> None:
            self.optimizer.zero_grad(set_to_none=True)
            self.step_model(tokens, targets, (h, c))[0].backward()
            if self.reduce_gradients is not None:  # NCCL warms up before a capture
                self.reduce_gradients()

        @contextlib.contextmanager
        def warm_up_context() -> Iterator[None]:
            with torch.random.fork_rng(devices=[device]), dispatch_as_captured():
                yield

        def body() -> tuple[Tensor, Tensor]:
            loss, norm, (h_next, c_next) = self._body(tokens, targets, (h, c))
            h.copy_(h_next)
            c.copy_(c_next)
            return loss.detach(), norm

        # Gradients made in the capture live in the graph's memory and are rewritten,
        # not accumulated, by each replay.
        self.graph, (self._loss, self._norm) = capture(
            body,
            warmup=self.warmup,
            warm_up=warm_up,
            warm_up_context=warm_up_context,
            before_capture=functools.partial(self.optimizer.zero_grad, set_to_none=True),
            device=device,
        )
