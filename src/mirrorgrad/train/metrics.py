"""Training metrics: the running loss sums a run carries across a resume."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from mirrorgrad.train import distributed
from mirrorgrad.train.distributed import World


@dataclasses.dataclass(kw_only=True, slots=True)
class LossSum:
    """The sum of per-step losses, kept on the device so that a step costs no sync."""

    total: Tensor
    steps: int = 0

    @classmethod
    def zeros(cls, device: torch.device) -> LossSum:
        return cls(total=torch.zeros((), device=device))

    def add(self, loss: Tensor) -> None:
        self.total += loss
        self.steps += 1

    def mean(self, world: World) -> float | None:
        """The mean step loss over every rank (a collective under DDP)."""
        if not self.steps:
            return None
        return float(distributed.mean(world, self.total)) / self.steps

    def to_state(self) -> dict[str, Any]:
        return {"total": self.total.detach().cpu(), "steps": self.steps}

    @classmethod
    def from_state(cls, state: dict[str, Any], device: torch.device) -> LossSum:
        return cls(total=state["total"].to(device), steps=state["steps"])


@dataclasses.dataclass(kw_only=True, slots=True)
class RunningLosses:
    """Loss sums of the current epoch, the last complete one and the current log window.

    The summary's train perplexity is the current epoch's (the last complete epoch's
    when a new one has not started); a checkpoint carries these sums, so a resumed
    run reports what the uninterrupted run would have.
    """

    epoch: LossSum
    window: LossSum
    last_epoch: LossSum | None = None

    @classmethod
    def zeros(cls, device: torch.device) -> RunningLosses:
        return cls(epoch=LossSum.zeros(device), window=LossSum.zeros(device))

    def add(self, loss: Tensor) -> None:
        self.epoch.add(loss)
        self.window.add(loss)

    def end_epoch(self) -> None:
        self.last_epoch = self.epoch
        self.epoch = LossSum.zeros(self.epoch.total.device)

    def train_loss(self, world: World) -> float | None:
        if self.epoch.steps == 0 and self.last_epoch is not None:
            return self.last_epoch.mean(world)
        return self.epoch.mean(world)

    def to_state(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch.to_state(),
            "window": self.window.to_state(),
            "last_epoch": None if self.last_epoch is None else self.last_epoch.to_state(),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], device: torch.device) -> RunningLosses:
        last = state["last_epoch"]
        return cls(
            epoch=LossSum.from_state(state["epoch"], device),
            window=LossSum.from_state(state["window"], device),
            last_epoch=None if last is None else LossSum.from_state(last, device),
        )
