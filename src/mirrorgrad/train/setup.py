"""Everything before the first step of `mirrorgrad train lm`: folders, data, model, plan,
compile, resume.

Everything that can fail on bad input (folders, the checkpoint to resume, the data) is
checked here, before any training. `set_up` returns the run's parts (`Setup`) and where
its training starts (`Progress`: at the beginning, or where the checkpoint left it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from mirrorgrad.callbacks import Callback, TensorBoardLogger
from mirrorgrad.nn import dispatch_as_captured
from mirrorgrad.train import checkpoint, data, distributed, preflight, probes, progress, step
from mirrorgrad.train.config import TrainConfig
from mirrorgrad.train.corpus import default_corpus
from mirrorgrad.train.distributed import World
from mirrorgrad.train.model import LanguageModel, State
from mirrorgrad.train.progress import Progress, Saved

if TYPE_CHECKING:
    from mirrorgrad.mirror.plan import Plan


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Splits:
    """The corpus as the steps and the evaluation read it: this rank's columns. On a GPU
    the training split stays in pinned host memory (each window is copied to the device
    as its step starts, without a sync: 5.6 KB a step at batch 20, where the whole split
    on the device held 13 MiB of the medium LM's peak); the evaluation's are on the device."""

    vocab: data.Vocabulary
    train: Tensor
    valid: Tensor | None
    test: Tensor | None
    windows_per_epoch: int
    # Per window, the embedding rows all ranks' inputs touch (``allreduce-rows``), or None.
    embedding_rows: Tensor | None


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class CompiledStep:
    """How each training step runs: on one GPU the whole step as one CUDA Graph
    (``graphed``); otherwise ``model`` (compiled, perhaps wrapped) in `step.sgd_step`,
    with ``reduce_gradients`` averaging the gradients of data parallelism."""

    graphed: step.GraphedStep | None
    model: Callable[..., Any]
    reduce_gradients: Callable[..., None] | None
    description: str  # for the summary and the logs


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Setup:
    """The parts of a run that the steps, the evaluation and the summary use."""

    config: TrainConfig
    world: World
    device: torch.device
    data: Splits
    model: LanguageModel
    optimizer: torch.optim.SGD
    scheduler: torch.optim.lr_scheduler.ReduceLROnPlateau
    step: CompiledStep
    plan: Plan | None  # on rank 0 only
    step_peaks: tuple[int, int] | None  # measured bytes of one step: without, with mirroring
    callbacks: list[Callback]
    seconds: float  # data, plan, compile

    def initial_state(self) -> State:
        """The LSTM state a training epoch starts from (this rank's columns)."""
        return self.model.initial_state(self.data.train.shape[1], self.device)


def set_up(
    config: TrainConfig, world: World, device: torch.device, callbacks: Sequence[Callback]
) -> tuple[Setup, Progress]:
    """The run's parts and where its training starts. The setup's callbacks are
    ``callbacks`` and, on rank 0, the TensorBoard logger of ``--logdir``."""
    started = time.perf_counter()
    saved = _check_folders_and_resume(config, world)
    splits = _load_data(config, world, device, saved)

    model, optimizer, scheduler = _build_model(config, len(splits.vocab), device)

    def example_inputs() -> tuple[Tensor, Tensor, State]:
        x, y = data.window(splits.train, 0, config.bptt, device)
        return x, y, model.initial_state(splits.train.shape[1], device)

    plan = None
    if world.is_main:
        plan = probes.explain_plan(model, example_inputs, config.mirror, device)
    train_step, step_peaks = _compile_step(model, optimizer, config, world, device, example_inputs)
    # Dropout masks differ between ranks, as they would between batch columns.
    torch.manual_seed(config.seed + world.rank)

    start = Progress.start(model.initial_state(splits.train.shape[1], device), device)
    if saved is not None:
        start = progress.restore(
            saved, model=model, optimizer=optimizer, scheduler=scheduler, config=config,
            world=world, device=device,
        )  # fmt: skip
    callbacks = list(callbacks)
    if world.is_main and config.logdir is not None:
        callbacks.append(
            TensorBoardLogger(
                config.logdir,
                log_freq=config.log_freq,
                device=device,
                plan=plan,
                settings={"precision": config.precision, "step": train_step.description},
                # Drop what an earlier run logged after this checkpoint.
                purge_step=start.position.step + 1 if saved is not None else None,
            )
        )
    setup = Setup(
        config=config, world=world, device=device, data=splits, model=model,
        optimizer=optimizer, scheduler=scheduler, step=train_step, plan=plan,
        step_peaks=step_peaks, callbacks=callbacks, seconds=time.perf_counter() - started,
    )  # fmt: skip
    return setup, start


def _check_folders_and_resume(config: TrainConfig, world: World) -> Saved | None:
    """Folders written to, stale temporaries removed, the checkpoint to resume verified
    against this run's settings."""
    if config.logdir is not None:
        preflight.probe_writable(config.logdir, "--logdir")
    ckpt_dir = config.checkpoint_dir
    if ckpt_dir is not None:
        preflight.probe_writable(ckpt_dir, "--ckpt-dir")
        preflight.probe_replaceable(ckpt_dir / checkpoint.LAST, "--ckpt-dir")
        if world.is_main:
            checkpoint.remove_stale_temporaries(ckpt_dir)
    return progress.load_resumable(config, world)


def _data_path(config: TrainConfig, world: World) -> Path:
    if config.data is not None:
        return config.data
    if world.is_main:  # one download; the other ranks read the cached copy
        default_corpus()
    distributed.barrier(world)
    return default_corpus()


def _load_data(
    config: TrainConfig, world: World, device: torch.device, saved: Saved | None
) -> Splits:
    corpus = data.load_corpus(
        data.find_splits(_data_path(config, world)), char=config.char, vocab_size=config.vocab_size
    )
    vocab = corpus.vocab
    if saved is not None and saved.state["vocab"] != vocab.tokens:
        raise ValueError(
            f"vocabulary mismatch on resume: {saved.path} has {len(saved.state['vocab'])} "
            f"tokens, the data gives {len(vocab)} (or the same number in another "
            "order); resume with the same --data, --char and --vocab-size"
        )
    if config.batch_size % world.world_size:
        raise ValueError(
            f"--batch-size {config.batch_size} must be divisible by the number of "
            f"processes ({world.world_size}): it is the global batch"
        )
    shard = functools.partial(_shard, world=world, device=device)
    eval_batch = math.ceil(config.eval_batch_size / world.world_size) * world.world_size
    train_batches = data.batchify(corpus.train, config.batch_size)
    train = _host_shard(train_batches, world=world, device=device)
    embedding_rows = _embedding_rows(train_batches, config, world, device)
    valid, test = (
        None if ids is None else shard(data.batchify(ids, eval_batch))
        for ids in (corpus.valid, corpus.test)
    )
    windows_per_epoch = data.num_windows(train, config.bptt, drop_last=True)
    if windows_per_epoch == 0:
        raise ValueError(
            f"the training text is too short for --bptt {config.bptt} at --batch-size "
            f"{config.batch_size}; lower them or add text"
        )
    return Splits(
        vocab=vocab, train=train, valid=valid, test=test,
        windows_per_epoch=windows_per_epoch, embedding_rows=embedding_rows,
    )  # fmt: skip


def _shard(batches: Tensor, *, world: World, device: torch.device) -> Tensor:
    return data.shard_columns(batches, world.rank, world.world_size).to(device)


def _host_shard(batches: Tensor, *, world: World, device: torch.device) -> Tensor:
    """This rank's columns in host memory, pinned where the steps run on a GPU."""
    columns = data.shard_columns(batches, world.rank, world.world_size).contiguous()
    return columns.pin_memory() if device.type == "cuda" else columns


def _embedding_rows(
    train_batches: Tensor, config: TrainConfig, world: World, device: torch.device
) -> Tensor | None:
    """Per window, the embedding rows all ranks' inputs touch (``allreduce-rows``)."""
    mode = distributed.data_parallel_mode() if world.distributed else None
    if mode != "allreduce-rows" or config.tie_weights:  # tied: the decoder's too
        return None
    rows = distributed.window_rows(train_batches, config.bptt)
    return rows.pin_memory() if device.type == "cuda" else rows


def _build_model(
    config: TrainConfig, vocab_size: int, device: torch.device
) -> tuple[LanguageModel, torch.optim.SGD, torch.optim.lr_scheduler.ReduceLROnPlateau]:
    torch.manual_seed(config.seed)  # the same initial weights on every rank
    model = LanguageModel(
        vocab_size, config.preset, tie_weights=config.tie_weights, precision=config.precision
    )
    model.to(device)
    lr = config.preset.lr if config.lr is None else config.lr  # a resume restores its own
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    # The word_language_model schedule: lr / 4 whenever valid loss does not improve.
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
        optimizer, mode="min", factor=0.25, patience=0
    )
    return model, optimizer, scheduler


def _compile_step(
    model: LanguageModel,
    optimizer: torch.optim.SGD,
    config: TrainConfig,
    world: World,
    device: torch.device,
    example_inputs: probes.ExampleInputs,
) -> tuple[CompiledStep, tuple[int, int] | None]:
    """The step of this run, and on a GPU one step's measured peaks without and with
    mirroring."""
    # On one GPU the whole step is one CUDA Graph around the planned step compiled
    # without Inductor's own graphs (a graph cannot hold graphs). Under DDP the
    # forward and backward are graphs and the rest runs eagerly.
    plain, step_peaks = None, None
    whole_step_graph = device.type == "cuda" and config.step_graph and _graphable_world(world)
    if device.type == "cuda":
        plain = step.compile_for_training(model, config.mirror, device, cuda_graphs=False)
        # On every GPU, before any wrapper: the plain model's step is each rank's. Its
        # trace here is the one the step graph replays: impl="auto" chooses as captured.
        tracing = dispatch_as_captured() if whole_step_graph else contextlib.nullcontext()
        with tracing:
            step_peaks = probes.measure_step_peaks(
                model, plain, config.mirror, device, example_inputs
            )
    if plain is not None and whole_step_graph:
        graphed = step.GraphedStep(plain, optimizer, clip=config.clip)
        description = "one CUDA Graph (forward, backward, gradient clip, SGD)"
        compiled = CompiledStep(
            graphed=graphed, model=plain, reduce_gradients=None, description=description
        )
        return compiled, step_peaks
    step_model, reduce_gradients = step.compile_for_world(model, config.mirror, device, world)
    if device.type == "cuda":
        description = "compiled; forward and backward as CUDA Graphs, clip and SGD eager"
    else:
        description = "compiled (AOTAutograd graphs run eagerly on the CPU)"
    compiled = CompiledStep(
        graphed=None, model=step_model, reduce_gradients=reduce_gradients, description=description
    )
    return compiled, step_peaks


def _graphable_world(world: World) -> bool:
    """One GPU. NOTE: under torchrun the step with its all-reduce captured trained at
    the uncaptured path's speed on two H100s, then hung in the collectives after the
    last step (docs/training.md), so data parallelism keeps the forward and backward
    graphs with the all-reduce, clip and SGD eager."""
    return not world.distributed
