"""The running loss sums that a checkpoint carries."""

import torch

from mirrorgrad.train.distributed import World
from mirrorgrad.train.metrics import RunningLosses


def test_running_losses_survive_a_round_trip_through_their_state():
    device, world = torch.device("cpu"), World()
    losses = RunningLosses.zeros(device)
    for value in (4.0, 3.0):
        losses.add(torch.tensor(value))
    losses.end_epoch()
    losses.add(torch.tensor(2.5))
    restored = RunningLosses.from_state(losses.to_state(), device)
    assert restored.train_loss(world) == losses.train_loss(world) == 2.5  # the current epoch
    assert restored.last_epoch.mean(world) == 3.5
    restored.end_epoch()
    assert restored.train_loss(world) == 2.5  # the last complete epoch until a step
