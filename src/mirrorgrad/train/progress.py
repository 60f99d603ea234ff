"""Where a run stands, and the checkpoint that carries it over a restart.

`Progress` is what the steps advance: the position in the data, the carried LSTM state
and the running loss sums. A checkpoint holds it with the weights, the optimizer, the
lr schedule and every RNG (`checkpoint_state`); resuming checks a checkpoint against
this run's settings (`check_resumable`) and restores all of it (`restore`), so the
resumed loss curve and summary equal the uninterrupted ones.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch

from mirrorgrad.train import checkpoint, data, distributed
from mirrorgrad.train.checkpoint import CheckpointError
from mirrorgrad.train.config import TrainConfig
from mirrorgrad.train.distributed import World
from mirrorgrad.train.metrics import RunningLosses
from mirrorgrad.train.model import State

# Settings that fix the model's shape or the data order: a resume must use the same.
_RESUME_SETTINGS = ("model", "tie_weights", "batch_size", "bptt", "char", "dropout")
_CHECKPOINT_KEYS = frozenset(
    {"model", "optimizer", "scheduler", "position", "state", "rng", "losses", "vocab"}
    | {"world_size", "config"}
)


@dataclasses.dataclass(kw_only=True, slots=True)
class Position:
    """Where training stands: ``window`` is the next BPTT window of ``epoch``."""

    step: int = 0
    epoch: int = 0
    window: int = 0


@dataclasses.dataclass(kw_only=True, slots=True)
class Progress:
    """What the steps advance, and a checkpoint saves besides weights, optimizer and RNG."""

    position: Position
    state: State  # the LSTM state carried into the next window (this rank's columns)
    losses: RunningLosses
    saved_step: int | None = None  # of the last checkpoint saved or resumed from

    @classmethod
    def start(cls, state: State, device: torch.device) -> Progress:
        return cls(position=Position(), state=state, losses=RunningLosses.zeros(device))


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Saved:
    """A loaded checkpoint and the file it came from (error messages name it)."""

    path: Path
    state: dict[str, Any]


def first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def resume_settings(config: TrainConfig) -> dict[str, Any]:
    """Effective values, not flags: --dropout 0.1 equals the tiny model's default."""
    values = {key: getattr(config, key) for key in _RESUME_SETTINGS}
    values["dropout"] = config.preset.dropout
    return values


def load_resumable(config: TrainConfig, world: World) -> Saved | None:
    """The checkpoint ``--resume`` names, verified against this run's settings."""
    if config.resume is None:
        return None
    path = checkpoint.resolve(config.resume)
    saved = Saved(path=path, state=checkpoint.load(path))
    _check_resumable(saved, config, world)
    return saved


def _check_resumable(saved: Saved, config: TrainConfig, world: World) -> None:
    path, state = saved.path, saved.state
    missing = _CHECKPOINT_KEYS - state.keys()
    if not missing and not isinstance(state["config"], dict):
        missing = {"config"}
    if missing:
        names = ", ".join(sorted(missing))
        raise CheckpointError(f"{path}: not a checkpoint of `mirrorgrad train lm` (no {names})")
    ours = resume_settings(config)
    for key in _RESUME_SETTINGS:
        value = state["config"].get(key)
        if value != ours[key]:
            flag = f"--{key.replace('_', '-')}"
            raise ValueError(
                f"{flag} is {ours[key]!r} but {path} was trained with {value!r}; "
                f"resume with the same {flag}, or start a new run in another --ckpt-dir"
            )
    if state["world_size"] != world.world_size:
        raise ValueError(
            f"{path} was written by {state['world_size']} processes, this run has "
            f"{world.world_size}; resume with the same --nproc_per_node"
        )


def checkpoint_state(
    progress: Progress,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    vocab: data.Vocabulary,
    config: TrainConfig,
    world: World,
) -> dict[str, Any]:
    """What a checkpoint saves. Collective under DDP: every rank contributes its state,
    loss sums and RNG."""
    h, c = (distributed.gather_columns(world, t, dim=1) for t in progress.state)
    per_rank = distributed.gather_objects(
        world, {"rng": checkpoint.rng_state(), "losses": progress.losses.to_state()}
    )
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "position": dataclasses.asdict(progress.position),
        "state": [h.cpu(), c.cpu()],
        "rng": [r["rng"] for r in per_rank],
        "losses": [r["losses"] for r in per_rank],
        "vocab": vocab.tokens,
        "world_size": world.world_size,
        "config": {**resume_settings(config), "mirror": config.mirror.to_cli()},
    }


def restore(
    saved: Saved,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    config: TrainConfig,
    world: World,
    device: torch.device,
) -> Progress:
    """Loads the weights, optimizer, schedule and RNGs of ``saved``; returns where its
    training stood. An explicit ``--lr`` replaces the lr the schedule had reached."""
    state = saved.state
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(
            f"{saved.path}: its weights do not fit this model ({first_line(e)})"
        ) from None
    try:
        progress = _restore_progress(state, scheduler, world, device)
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as e:
        # Only a file written by something else (its checksum holds) gets here.
        raise CheckpointError(
            f"{saved.path}: its training state does not fit this run ({first_line(e)})"
        ) from None
    _override_lr(optimizer, config.lr, saved.path, world)
    return progress


def _restore_progress(
    state: dict[str, Any], scheduler: Any, world: World, device: torch.device
) -> Progress:
    scheduler.load_state_dict(state["scheduler"])
    position = Position(**state["position"])
    h, c = (data.shard_columns(t, world.rank, world.world_size).to(device) for t in state["state"])
    losses = RunningLosses.from_state(state["losses"][world.rank], device)
    checkpoint.set_rng_state(state["rng"][world.rank])
    return Progress(
        position=position,
        state=(h.contiguous(), c.contiguous()),
        losses=losses,
        saved_step=position.step,
    )


def _override_lr(
    optimizer: torch.optim.Optimizer, lr: float | None, path: Path, world: World
) -> None:
    groups = optimizer.param_groups
    saved = groups[0]["lr"]
    if lr is None or lr == saved:
        return
    for group in groups:
        group["lr"] = lr
    if world.is_main:
        print(
            f"--lr {lr:g} replaces the lr of {path} ({saved:g}); the schedule goes on from {lr:g}",
            file=sys.stderr,
        )
