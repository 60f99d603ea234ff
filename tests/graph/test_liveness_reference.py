"""The vectorised simulation against the loop it replaced (liveness_reference.py), on
random plans of the zoo graphs: the same timeline, peak, schedules and live values."""

import random
import sys
from pathlib import Path

import pytest
import torch

from mirrorgrad.graph import liveness
from mirrorgrad.mirror.candidates import partition_for
from mirrorgrad.mirror.policy import MirrorPolicy
from mirrorgrad.mirror.storage_balance import UnitGraph

sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(0, str(Path(__file__).parents[1] / "mirror"))
sys.path.insert(0, str(Path(__file__).parent))
from joint_graphs import joint_of
from liveness_reference import simulate_reference

import zoo


def _same(new: liveness.Liveness, old: liveness.Liveness) -> None:
    assert (new.peak, new.peak_index, new.peak_phase, new.peak_node, new.turn_bytes) == (
        old.peak,
        old.peak_index,
        old.peak_phase,
        old.peak_node,
        old.turn_bytes,
    )
    assert new.event_nodes == old.event_nodes and new.forward_events == old.forward_events
    assert new.event_bytes == old.event_bytes
    assert new.live_values == old.live_values
    assert new.live_storages == old.live_storages


@pytest.mark.slow
@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_simulation_equals_the_reference_on_random_plans(name):
    model, inputs = zoo.build(name, torch.float32)
    joint = joint_of(zoo.WithLoss(model), *inputs, decompose=True)
    graph, index = UnitGraph(joint, MirrorPolicy()), liveness.GraphIndex(joint)
    units = [u for u in graph.units if graph.mirrorable[u] or u in graph.last_resort]
    rng = random.Random(0)
    for _ in range(8):
        p = partition_for(joint, graph, set(rng.sample(units, rng.randint(0, len(units)))))
        available = p.saved + p.saved_sym
        for fusion in (False, True):
            new = liveness.simulate(joint, available, p.mirrored, fusion=fusion, index=index)
            old = simulate_reference(joint, available, p.mirrored, fusion=fusion, index=index)
            _same(new, old)
            for at in (new.peak_index, rng.randrange(len(new.event_bytes))):
                _same(
                    liveness.simulate(
                        joint, available, p.mirrored, fusion=fusion, index=index, live_at=at
                    ),
                    simulate_reference(
                        joint, available, p.mirrored, fusion=fusion, index=index, live_at=at
                    ),
                )
