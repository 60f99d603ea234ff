"""Validation and test losses: the mean cross-entropy per token over a split, all ranks together."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from mirrorgrad.ops.rnn import dispatch
from mirrorgrad.train import data, distributed
from mirrorgrad.train.distributed import World

if TYPE_CHECKING:
    from mirrorgrad.train.setup import Setup


@torch.no_grad()
def evaluate(
    model: nn.Module, batches: Tensor, *, bptt: int, world: World, device: torch.device
) -> float:
    """Mean cross-entropy per token over ``batches`` (this rank's columns of a split);
    the model is left in training mode. The RNN's ``impl="auto"`` takes the cost rule's
    pick at the evaluation's shapes, untimed (`dispatch.choose_by_rule`): timing cuDNN
    there raised the run's peak above its steps'."""
    model.eval()
    state = model.initial_state(batches.shape[1], device)
    total = torch.zeros((), dtype=torch.float64, device=device)
    with dispatch.choose_by_rule():
        for x, y in data.windows(batches, bptt):
            loss, state = model(x, y, state)
            total += loss.double() * y.numel()
    model.train()
    tokens = (batches.shape[0] - 1) * batches.shape[1]
    return float(distributed.mean(world, total)) / tokens


def final_losses(
    setup: Setup, step: int, last_validation: tuple[int, float] | None
) -> tuple[float | None, float | None]:
    """Validation (unless the last epoch's end ran it at ``step``) and test losses; a new
    validation goes to the callbacks."""
    cfg = setup.config

    def loss_of(batches: Tensor) -> float:
        return evaluate(setup.model, batches, bptt=cfg.bptt, world=setup.world, device=setup.device)

    valid_loss = None
    if last_validation is not None and last_validation[0] == step:
        valid_loss = last_validation[1]
    if valid_loss is None and setup.data.valid is not None:
        valid_loss = loss_of(setup.data.valid)
        for cb in setup.callbacks:
            cb.on_validation(step, {"loss": valid_loss})
    test_loss = None if setup.data.test is None else loss_of(setup.data.test)
    return valid_loss, test_loss
