"""Plans pinned by digest: the planner's chosen stash and recompute sets and its
estimates on a few graphs, so a change meant to make planning faster (or to move
code) can be checked to change no plan.

``python tests/mirror/plan_pins.py`` rewrites ``plan_pins.json`` from the current
planner: run it only when a plan is meant to change, and say why in the commit.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(0, str(Path(__file__).parent))
from joint_graphs import (
    Bottleneck,
    joint_of,
    resnet152_layout,
    suite_resnet50ish,
    suite_transformer,
)

import zoo
from mirrorgrad.graph.joint import JointGraph
from mirrorgrad.mirror import PlanOptions, plan

PINS = Path(__file__).with_name("plan_pins.json")

OPTIONS = {
    "off": PlanOptions(mode="off"),
    "balance": PlanOptions(mode="balance"),
    "balance-0.05": PlanOptions(mode="balance", max_overhead=0.05),
    "budget-0.5": PlanOptions(mode="budget", budget=0.5),
    "budget-0.3": PlanOptions(mode="budget", budget=0.3),
}


def _zoo(name: str) -> JointGraph:
    torch.manual_seed(0)
    model, inputs = zoo.build(name, torch.float32)
    return joint_of(zoo.WithLoss(model), *inputs, decompose=True)


def _bottlenecks() -> JointGraph:
    torch.manual_seed(0)
    return joint_of(
        torch.nn.Sequential(*(Bottleneck(16, 4) for _ in range(6))),
        torch.randn(8, 16, 16, 16),
        decompose=True,
    )


GRAPHS = {
    "transformer": suite_transformer,
    "resnet50-ish": suite_resnet50ish,
    "bottlenecks": _bottlenecks,
    "lstm_lm": lambda: _zoo("lstm_lm"),
    "seq2seq_attention": lambda: _zoo("seq2seq_attention"),
    "encoder_block": lambda: _zoo("encoder_block"),
}
SLOW_GRAPHS = {"resnet152-layout": resnet152_layout}


def digest(joint: JointGraph, options: PlanOptions) -> dict:
    """What pins a plan: its sets by node name, hashed, and its estimates."""
    p = plan(joint, options, warn=False)
    sets = {
        "saved": [n.name for n in p.saved],
        "saved_sym": [n.name for n in p.saved_sym],
        "mirrored": [n.name for n in p.mirrored],
    }
    text = json.dumps(sets, sort_keys=True).encode()
    return {
        "sets": hashlib.sha256(text).hexdigest()[:16],
        "mirrored": len(p.mirrored),
        "peak_after": p.peak_after,
        "stash_bytes_after": p.stash_bytes_after,
        "budget_bytes": p.budget_bytes,
        "added_time_ns": round(p.added_time_s * 1e9, 3),
    }


def digests(graphs: dict) -> dict:
    found = {}
    for name, build in graphs.items():
        joint = build()
        for key, options in OPTIONS.items():
            found[f"{name}/{key}"] = digest(joint, options)
    return found


if __name__ == "__main__":
    pins = digests({**GRAPHS, **SLOW_GRAPHS})
    PINS.write_text(json.dumps(pins, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(pins)} plans to {PINS}")
