"""Perplexity and the running loss sums that a checkpoint carries."""

import math

import pytest
import torch

from mirrorgrad.train.distributed import World
from mirrorgrad.train.metrics import RunningLosses, perplexity


def test_perplexity_is_exp_of_the_loss_and_never_overflows():
    assert perplexity(0.0) == 1.0
    assert perplexity(math.log(42.0)) == pytest.approx(42.0, rel=1e-15)
    assert math.isfinite(perplexity(1e6))  # a diverged loss still prints
    assert math.isnan(perplexity(float("nan")))


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
