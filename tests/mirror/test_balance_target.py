"""Balance's target (0.8x torch.compile's peak within the time cap): met, or why not."""

import functools
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import mirrorgrad
from mirrorgrad import _compat
from mirrorgrad.bench.frontier import compare
from mirrorgrad.compiler import MirrorBackend
from mirrorgrad.mirror import PlanOptions, min_cut, plan
from mirrorgrad.mirror.balance_target import (
    COMPILE_REFERENCE,
    TARGET_PEAK,
    BalanceTarget,
    Recomputed,
)

sys.path.insert(0, str(Path(__file__).parent))
from joint_graphs import LayerNormGeluLinear, joint_of


def _balance(joint, **options):
    options.setdefault("diagnose_balance", True)
    return plan(joint, PlanOptions(mode="balance", **options), warn=False)


@functools.cache
def _layernorm_gelu():
    """Activations of 2 MiB against weights of 64 KiB: recomputing cheap ops pays."""
    torch.manual_seed(0)
    blocks = nn.Sequential(*(LayerNormGeluLinear(128, 128) for _ in range(4)))
    return joint_of(blocks, torch.randn(4096, 128), decompose=True)


@functools.cache
def _wide_linears():
    """Weights of 4 MiB against activations of 16 KiB: no plan lowers the peak."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))
    return joint_of(model, torch.randn(4, 1024), decompose=True)


def _goal(t: BalanceTarget) -> int:
    return int(TARGET_PEAK * t.reference_peak)


def test_a_plan_that_reaches_the_target_says_met():
    p = _balance(_layernorm_gelu(), max_overhead=0.1)
    t = p.balance_target
    assert t.status == "met" and p.peak_after <= _goal(t)
    assert t.reason().endswith(f"met ({p.peak_after / t.reference_peak:.3f}x at +{t.overhead:.1%})")
    assert t.other_peak is None and not t.recomputes and t.held is None


def test_a_target_over_the_cap_names_the_plan_that_reaches_it_and_its_cost():
    p = _balance(_layernorm_gelu(), max_overhead=0.001)
    t = p.balance_target
    assert t.status == "costly" and p.peak_after > _goal(t)
    assert t.other_peak <= _goal(t) and t.other_overhead > 0.001
    assert f"costs +{t.other_overhead:.1%}" in t.reason()
    # what it recomputes beyond balance's plan: the GELU's arithmetic, most bytes first
    ops = [r.op for r in t.recomputes]
    assert {"mul", "erf"} <= set(ops)
    sizes = [r.nbytes for r in t.recomputes]
    assert sizes == sorted(sizes, reverse=True)
    erf = next(r for r in t.recomputes if r.op == "erf")
    assert erf.shape == "[4096, 128]" and erf.nbytes == erf.count * 4096 * 128 * 4
    assert f"recomputing {t.recomputes[0]}" in t.reason()
    # the budget it names gets such a plan
    asked = plan(_layernorm_gelu(), PlanOptions(mode="budget", budget=_goal(t)), warn=False)
    assert asked.budget_met and asked.peak_after <= _goal(t)
    assert asked.added_time_s <= t.other_overhead * asked.step_time_s * (1 + 1e-9)
    assert f"budget={_goal(t)}" in t.reason()


def test_a_target_no_plan_reaches_names_what_is_alive_at_the_lowest_peak():
    p = _balance(_wide_linears())
    t = p.balance_target
    assert t.status == "unreachable"
    by_kind = t.held.bytes_by_kind
    assert by_kind["parameters"] + by_kind["gradients"] >= 0.9 * t.held.peak
    assert "no plan reaches it" in t.reason() and "parameters 8.01 MiB" in t.reason()
    # budget mode's full search finds no plan at the target either
    asked = plan(_wide_linears(), PlanOptions(mode="budget", budget=_goal(t)), warn=False)
    assert asked.budget_met is False


def test_a_target_no_plan_reaches_names_the_lowest_peak_found():
    torch.manual_seed(0)
    blocks = nn.Sequential(*(LayerNormGeluLinear(512, 512) for _ in range(3)))
    joint = joint_of(blocks, torch.randn(512, 512), decompose=True)
    t = _balance(joint).balance_target
    assert t.status == "unreachable" and _goal(t) < t.other_peak < t.peak
    lowest = f"the lowest peak is {t.other_peak / t.reference_peak:.3f}x at +{t.other_overhead:.1%}"
    assert lowest in t.reason() and "alive at that peak: parameters" in t.reason()
    asked = plan(joint, PlanOptions(mode="budget", budget=_goal(t)), warn=False)
    assert asked.budget_met is False and asked.peak_after >= t.other_peak


def test_the_reference_is_torch_compiles_peak_where_the_caller_knows_it():
    joint = _layernorm_gelu()
    default = _balance(joint)
    below = _balance(joint, reference_peak=int(default.peak_after / 0.7))
    above = _balance(joint, reference_peak=default.peak_after)
    for p in (below, above):
        assert p.balance_target.reference == COMPILE_REFERENCE
        # the same plan: a missed target lets heavy ops in, and they lower no peak here
        assert p.saved == default.saved and p.mirrored == default.mirrored
    assert below.balance_target.status == "met"
    assert above.balance_target.status != "met"
    assert above.balance_target.reached == 1.0


def test_by_default_the_reference_is_min_cuts_partition_as_the_frontier_simulates_it():
    joint = _layernorm_gelu()
    p = _balance(joint, max_overhead=0.001)
    t = p.balance_target
    assert t.reference == COMPILE_REFERENCE
    # the frontier bench's torch.compile row: the same partition, the same model
    compile_row = compare(joint, fractions=())[0]
    assert compile_row["plan"] == "compile (min-cut)"
    assert t.reference_peak == round(compile_row["peak_mib"] * 2**20)
    # min-cut recomputes the blocks' pointwise ops: below the unmirrored peak
    assert t.reference_peak < p.peak_before
    assert t.reached == pytest.approx(p.peak_after / t.reference_peak)


def test_where_min_cut_fails_the_reference_is_the_stand_in_and_says_why(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("cannot partition this graph\nsecond line")

    monkeypatch.setattr(_compat, "min_cut_rematerialization_partition", refuse)
    p = _balance(_layernorm_gelu(), max_overhead=0.001)
    t = p.balance_target
    assert t.reference == (
        "torch.compile's peak (as a plan recomputing cheap ops: its partition failed, "
        "RuntimeError: cannot partition this graph)"
    )
    assert t.reason().startswith(f"at most 0.8x {t.reference} within +0.1%: ")
    # the stand-in recomputes cheap ops within a 1% cap: at most the unmirrored peak
    assert 0 < t.reference_peak <= p.peak_before


def test_compiles_plans_run_no_min_cut(monkeypatch):
    runs = []
    real = min_cut.min_cut_partition
    monkeypatch.setattr(min_cut, "min_cut_partition", lambda *a: runs.append(1) or real(*a))
    _balance(_layernorm_gelu(), diagnose_balance=False)
    assert runs == []
    _balance(_layernorm_gelu())
    assert runs == [1]


def test_only_balance_has_a_target_and_only_where_asked():
    assert plan(_layernorm_gelu(), PlanOptions(mode="off")).balance_target is None
    budget = PlanOptions(mode="budget", budget=0.5, diagnose_balance=True)
    assert plan(_layernorm_gelu(), budget, warn=False).balance_target is None
    # compile's plans skip the diagnosis (its planning time); explain's have it
    assert _balance(_layernorm_gelu(), diagnose_balance=False).balance_target is None
    assert MirrorBackend().plan_options().diagnose_balance is False


def _target(status, **fields) -> BalanceTarget:
    base = dict(target=0.8, reference="torch.compile's peak", reference_peak=1000 * 2**20,
                peak=900 * 2**20, overhead=0.025, max_overhead=0.03)  # fmt: skip
    return BalanceTarget(status=status, **(base | fields))


def test_the_wording_of_each_verdict():
    mm = Recomputed(op="mm", nbytes=312 * 2**20, count=12, shape="[8, 1024, 3072]")
    add = Recomputed(op="add", nbytes=2**20, count=1, shape="[256, 1024]")
    assert _target("met", peak=700 * 2**20).verdict() == "≤ 0.8x at ≤ 1.03x: met"
    costly = _target("costly", other_peak=780 * 2**20, other_overhead=0.054, recomputes=(mm, add))
    assert costly.verdict() == "≤ 0.8x at ≤ 1.03x: not within +3%: a plan at 0.780x at +5.4%"
    assert costly.reason() == (
        "at most 0.8x torch.compile's peak within +3.0%: not within the cap (0.900x at "
        "+2.5%): a 0.780x plan costs +5.4%, recomputing mm 312 MiB (12 values like "
        "[8, 1024, 3072]), add 1.00 MiB (one value, [256, 1024]) more "
        "(mode='budget', budget='800MiB')"
    )
    missed = _target("missed", other_peak=750 * 2**20, other_overhead=0.029, recomputes=(mm,))
    assert missed.verdict().endswith(": missed: budget mode's search finds 0.750x at +2.9%")
    assert missed.reason().endswith(
        "not found by balance (0.900x at +2.5%): budget mode's search finds a 0.750x plan at "
        "+2.9%, recomputing mm 312 MiB (12 values like [8, 1024, 3072]) more (mode='budget', "
        "budget='800MiB')"
    )


def test_print_summary_and_dict_carry_the_target():
    p = _balance(_layernorm_gelu(), max_overhead=0.001)
    reason = p.balance_target.reason()
    assert f"\nbalance target: {reason}" in str(p)
    assert p.summary_line().endswith(f"; target {reason}")
    d = json.loads(json.dumps(p.to_dict()))["balance_target"]
    assert d["status"] == "costly" and d["reason"] == reason
    assert d["reached"] == pytest.approx(p.peak_after / d["reference_peak"])


def test_explain_prints_the_target():
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    p = mirrorgrad.explain(model, torch.randn(2, 256), mode="balance", backend="eager")
    assert p.balance_target.status == "unreachable"
    assert "balance target: at most 0.8x" in str(p) and "parameters" in str(p)
