"""The planner's plans are pinned (plan_pins.py): code moved or made faster changes none."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import plan_pins
from joint_graphs import graph_param

PINNED = json.loads(plan_pins.PINS.read_text())


def _check(graphs: dict) -> None:
    found = plan_pins.digests(graphs)
    changed = {key: (PINNED[key], got) for key, got in found.items() if PINNED[key] != got}
    assert not changed, f"plans changed (pinned, now): {changed}"


def test_every_pinned_graph_is_checked():
    keys = {
        f"{g}/{o}" for g in {**plan_pins.GRAPHS, **plan_pins.SLOW_GRAPHS} for o in plan_pins.OPTIONS
    }
    assert keys == set(PINNED)


@pytest.mark.slow
@pytest.mark.parametrize("name", [graph_param(name) for name in plan_pins.GRAPHS])
def test_plans_are_the_pinned_ones(name):
    _check({name: plan_pins.GRAPHS[name]})


@pytest.mark.slow
@pytest.mark.xdist_group("resnet152-layout")  # with test_budget_search's: built once
def test_plans_of_the_10k_node_layout_are_the_pinned_ones():
    _check(plan_pins.SLOW_GRAPHS)
