"""The budget search against PyTorch's min-cut partitioner with ``activation_memory_budget``.

For each zoo graph (and the bench suite's transformer, ResNet-50 layout and a GPT-2 of
transformers, small) and fraction, min-cut's saved set is judged by our liveness model
and cost model (as Inductor runs the step); asked for min-cut's peak in bytes, our
plan must reach it at no more estimated time.
"""

import functools
import sys
import warnings
from pathlib import Path

import pytest
import torch

from mirrorgrad.bench import models
from mirrorgrad.bench.frontier import capture_joint, min_cut_partition
from mirrorgrad.bench.suites import get_workload
from mirrorgrad.graph import liveness
from mirrorgrad.graph.cost import StepCost, rates_for
from mirrorgrad.graph.joint import JointGraph
from mirrorgrad.graph.repeats import repeated_classes
from mirrorgrad.mirror import PlanOptions, plan
from mirrorgrad.mirror.policy import MirrorPolicy
from mirrorgrad.mirror.storage_balance import UnitGraph

sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(0, str(Path(__file__).parent))
from joint_graphs import (
    Bottleneck,
    LayerNormGeluLinear,
    graph_param,
    joint_of,
    joint_of_compiled,
    suite_resnet50ish,
    suite_transformer,
)

import zoo


def _zoo_joint(name: str) -> JointGraph:
    model, inputs = zoo.build(name, torch.float32)
    return joint_of(zoo.WithLoss(model), *inputs, decompose=True)


GRAPHS = {
    **{name: (lambda name=name: _zoo_joint(name)) for name in zoo.ZOO},
    "layernorm-gelu-linear": lambda: joint_of(
        torch.nn.Sequential(*(LayerNormGeluLinear(512, 512) for _ in range(3))),
        torch.randn(512, 512),
        decompose=True,
    ),
    "bottlenecks": lambda: joint_of(
        torch.nn.Sequential(*(Bottleneck(16, 4) for _ in range(6))),
        torch.randn(8, 16, 16, 16),
        decompose=True,
    ),
}


def _gpt2() -> JointGraph:
    """transformers' GPT-2 at 2 x 64, length 64, dropout 0.1 but in the attention: the
    CPU's SDPA draws that mask as a separate ``rand`` (the GPU's kernel draws it
    inside), which min-cut recomputes (``rand`` is not in its random ops)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=64, use_cache=False,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    gpt2 = transformers.GPT2LMHeadModel(config)
    gpt2.loss_type = "ForCausalLM"
    tokens = torch.randint(0, 512, (2, 64))
    return joint_of_compiled(models.CausalLM(gpt2), tokens, decompose=True)


GRAPHS |= {"transformer": suite_transformer, "resnet50-ish": suite_resnet50ish, "gpt2": _gpt2}
# Graphs where min-cut's plan reaches a peak ours does not (none since min-cut's
# backward is judged with Inductor's late addmms: on the toy lstm_lm its plan had
# recomputed the LSTMCell matmuls to 0.984x of the peak where our lowest was 0.990x).
LOSSES: set[str] = set()


def min_cut_plan(joint: JointGraph, fraction: float) -> tuple[int, float]:
    """(peak, added seconds) of min-cut's partition at ``fraction``, by our models, its
    backward as stock Inductor runs it (``late_addmm``: our plans split those)."""
    saved, mirrored = min_cut_partition(joint, fraction)
    cost = StepCost(joint, rates_for(joint.device), fusion=True)
    peak = liveness.simulate(joint, saved, mirrored, fusion=True, late_addmm=True).peak
    return peak, sum(cost.recomputed(n).seconds for n in mirrored)


@functools.cache
def _joint(name: str) -> JointGraph:
    return GRAPHS[name]()


def test_min_cut_saves_forward_values():
    # Min-cut saves permutes the joint graph puts in its backward (a transposed weight
    # or activation, a gradient matmul's operand): judged as saved there, the forward
    # value they view would be left unsaved and its chain counted as recomputed.
    joint = _joint("gpt2")
    saved, _ = min_cut_partition(joint, 1.0)
    assert saved
    assert all(v.op == "placeholder" or v in joint.forward_set for v in saved)


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.5, 0.3])
@pytest.mark.parametrize("name", [graph_param(name) for name in GRAPHS])
def test_budget_plan_dominates_min_cut(name, fraction):
    joint = _joint(name)
    their_peak, their_seconds = min_cut_plan(joint, fraction)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a min-cut peak we cannot reach is declared
        ours = plan(joint, PlanOptions(mode="budget", budget=their_peak))
    if name in LOSSES:
        assert ours.peak_after > their_peak  # if this fails, the loss is gone: drop it
        return
    assert ours.peak_after <= their_peak
    assert ours.added_time_s <= their_seconds * (1 + 1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.5, 0.3])
@pytest.mark.parametrize(
    "name", [graph_param(name) for name in ("transformer", "resnet50-ish", "bottlenecks")]
)
def test_the_same_fraction_is_no_higher_and_no_slower_than_min_cuts(name, fraction):
    # The target: budget=F against activation_memory_budget=F. (Not on every
    # zoo graph: on layernorm-gelu-linear min-cut's 0.5 reaches 0.75x at +9.6%, where
    # PyTorch's rule on our candidates asks for 0.81x, reached at +0.3%.)
    joint = _joint(name)
    their_peak, their_seconds = min_cut_plan(joint, fraction)
    ours = plan(joint, PlanOptions(mode="budget", budget=fraction))
    assert ours.peak_after <= their_peak
    assert ours.added_time_s <= their_seconds


@pytest.mark.slow
@pytest.mark.xdist_group("full-size-transformer")  # one worker builds it (cached)
@pytest.mark.parametrize("fraction", [0.5, 0.3])
def test_full_size_transformer_dominates_min_cut(fraction):
    # The suite's 12x768 transformer, length 1024, as Inductor hands it over (traced,
    # never run). Min-cut's 0.3 recomputes the attention; before attention could be
    # recomputed (and before the in-place loss model) our lowest peak was above
    # min-cut's there (0.62x against 0.589x of its default, bench/frontier.py).
    joint = _full_size_transformer()
    their_peak, their_seconds = min_cut_plan(joint, fraction)
    ours = plan(joint, PlanOptions(mode="budget", budget=their_peak))
    assert ours.peak_after <= their_peak
    assert ours.added_time_s <= their_seconds


@functools.cache
def _full_size_transformer() -> JointGraph:
    built = get_workload("transformer").build(device="cpu", quick=False)
    return capture_joint(built.model, *built.make_batch())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "options"),
    [
        graph_param("resnet50-ish", PlanOptions(mode="balance")),
        graph_param("resnet50-ish", PlanOptions(mode="budget", budget=0.3)),
        graph_param("seq2seq_attention", PlanOptions(mode="budget", budget=0.3)),
    ],
)
def test_the_plan_is_alike_in_every_copy_of_a_repeated_block(name, options):
    # On these graphs the per-unit search decides some copies of a repeated op one way
    # and others the other way (one more kernel variant for Inductor to compile each);
    # a plan alike in every copy keeps the same promise here.
    joint = _joint(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = plan(joint, options)
    graph = UnitGraph(joint, MirrorPolicy())
    mirrored = set(p.mirrored)
    classes = repeated_classes(joint, graph.units)
    assert classes
    assert all(len(mirrored & set(c)) in (0, len(c)) for c in classes)
    if options.mode == "balance":
        assert p.added_time_s <= options.max_overhead * p.step_time_s
    else:
        assert p.budget_met is not False
