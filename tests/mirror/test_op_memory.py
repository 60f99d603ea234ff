"""The RNN op's memory mode chosen by the planner (mirror/op_memory.py), through
``mirrorgrad.compile`` (eager codegen, the reference impl on the CPU)."""

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import mirrorgrad
import mirrorgrad.nn as mnn
from mirrorgrad.ops.rnn.cell_modes import GATES

sys.path.insert(0, str(Path(__file__).parent))
from joint_graphs import joint_of

T, B, N_IN, H, VOCAB = 6, 3, 4, 8, 600
FORWARD = torch.ops.mirrorgrad.rnn_forward.default
BACKWARD = torch.ops.mirrorgrad.rnn_backward.default


class _Lm(nn.Module):
    """An LSTM under a large decoder: the backward's peak is at the decoder, where the
    LSTM's stash is alive, so recomputing the op lowers the peak."""

    def __init__(self, memory: str = "auto", layers: int = 2) -> None:
        super().__init__()
        self.rnn = mnn.LSTM(N_IN, H, num_layers=layers, impl="reference", memory=memory)
        self.out = nn.Linear(H, VOCAB)

    def forward(self, x):
        return self.out(self.rnn(x)[0]).square().mean()


def _run(model, x, backend="eager", **options):
    """Loss, parameter gradients and the one plan of ``model`` under ``mirrorgrad.compile``."""
    torch._dynamo.reset()
    compiled = mirrorgrad.compile(model, backend=backend, fullgraph=True, **options)
    loss = compiled(x)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    (plan,) = compiled._mirrorgrad_plans
    return loss, grads, plan


def _check_against_eager(model, x, tolerance=1e-12, **options):
    loss, grads, plan = _run(model, x, **options)
    ref_loss = model(x)
    ref = torch.autograd.grad(ref_loss, list(model.parameters()))
    torch.testing.assert_close(loss, ref_loss, rtol=tolerance, atol=tolerance)
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=tolerance, atol=tolerance)
    return plan


def _model(memory="auto"):
    torch.manual_seed(0)
    return _Lm(memory).double(), torch.randn(T, B, N_IN, dtype=torch.float64)


def _gates_stashed(plan) -> bool:
    """Whether the plan stashes the reference LSTM's [T, B, 4H] pre-activations."""
    return [T, B, GATES["lstm"] * H] in [row["shape"] for row in plan.to_dict()["stashed"]]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("options", "choice"),
    [
        ({"mode": "balance", "max_overhead": 1.0}, "recompute"),  # room in the cap
        ({"mode": "balance", "max_overhead": 0.0}, "stash"),  # no room
        ({"mode": "budget", "budget": 0.5}, "recompute"),  # the budget needs it
        ({"mode": "budget", "budget": 1.0}, "stash"),  # met without it: no time spent
        ({"mode": "off"}, "stash"),
    ],
)
def test_the_plan_chooses_the_ops_memory_and_gradients_stay_eager(options, choice):
    model, x = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mirrorgrad.MirrorgradBudgetWarning)
        plan = _check_against_eager(model, x, **options)
    (decided,) = plan.op_memory
    assert (decided.choice, decided.reason, decided.module) == (choice, options["mode"], "rnn")
    # The partition saw the rewritten op: the gates are stashed exactly with "stash".
    assert _gates_stashed(plan) == (choice == "stash")
    recomputes = choice == "recompute"
    assert (plan.peak_after < plan.peak_before) == recomputes
    assert (plan.added_time_s > 0) == recomputes
    gates = T * B * GATES["lstm"] * H * 8
    assert decided.stash_bytes - decided.recompute_bytes == 2 * gates  # two layers
    assert decided.bytes_saved == (2 * gates if recomputes else 0)
    assert plan.to_dict()["op_memory"][0]["choice"] == choice
    assert f"rnn_forward (rnn): {choice} [{options['mode']}]" in str(plan)


def test_mark_mirror_false_pins_stash():
    model, x = _model()
    mirrorgrad.mark(model.rnn, mirror=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mirrorgrad.MirrorgradBudgetWarning)
        plan = _check_against_eager(model, x, mode="budget", budget=0.5)
    (decided,) = plan.op_memory
    assert (decided.choice, decided.reason) == ("stash", "pinned")
    assert _gates_stashed(plan)


@pytest.mark.slow
@pytest.mark.parametrize("memory", ["stash", "recompute"])
def test_an_explicit_memory_is_respected(memory):
    model, x = _model(memory)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mirrorgrad.MirrorgradBudgetWarning)
        plan = _check_against_eager(model, x, mode="budget", budget=0.5)
    (decided,) = plan.op_memory
    assert (decided.choice, decided.reason) == (memory, "explicit")
    assert _gates_stashed(plan) == (memory == "stash")


def _unreachable(model, x) -> int:
    """A budget in bytes no plan meets (a fraction asks for a peak some plan reaches)."""
    _, _, off = _run(model, x, mode="off")
    return int(0.05 * off.peak_before)


@pytest.mark.slow
def test_an_unmet_budget_warns_once_for_the_plan_kept():
    """Each candidate op choice gets its own value plan: one warning, the final one's."""
    model, x = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, plan = _run(model, x, mode="budget", budget=_unreachable(model, x))
    budget = [w for w in caught if issubclass(w.category, mirrorgrad.MirrorgradBudgetWarning)]
    assert len(budget) == 1 and plan.budget_met is False
    assert plan.op_memory[0].choice == "recompute"
    message = str(budget[0].message)
    assert f"lowest estimated peak found is {mirrorgrad._units.format_bytes(plan.peak_after)}" in (
        message
    )
    fixed = plan.floor.bytes_by_kind["parameters"] + plan.floor.bytes_by_kind["gradients"]
    assert f"parameters and gradients {mirrorgrad._units.format_bytes(fixed)}" in message


@pytest.mark.slow
def test_balance_takes_the_peak_lowering_op_within_the_cap_and_charges_its_time():
    model, x = _model()
    _, _, off = _run(model, x, mode="off")
    _, _, plan = _run(model, x, mode="balance", max_overhead=1.0)
    (decided,) = plan.op_memory
    assert plan.peak_before == off.peak_before == off.peak_after
    assert plan.added_time_s >= decided.added_seconds > 0
    assert plan.added_time_s <= plan.step_time_s  # within the cap


@pytest.mark.slow
def test_summary_line_names_peaks_op_choices_and_an_unmet_budget():
    model, x = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mirrorgrad.MirrorgradBudgetWarning)
        _, _, unmet = _run(model, x, mode="budget", budget=_unreachable(model, x))
    line = unmet.summary_line()
    assert "\n" not in line and line.startswith("mirror budget: estimated peak ")
    assert "rnn recompute" in line and "NOT met" in line and "parameters" in line
    _, _, met = _run(model, x, mode="budget", budget=1.0)
    assert met.summary_line().endswith("met") and "rnn stash" in met.summary_line()


@pytest.mark.slow
def test_symbolic_sizes_are_decided_by_their_example_values():
    """Dynamic shapes (the last, shorter BPTT window): sizes and FLOPs are SymInts."""
    model, x = _model()
    plan = _check_against_eager(model, x, mode="balance", max_overhead=1.0, dynamic=True)
    (decided,) = plan.op_memory
    assert isinstance(decided.stash_bytes, int) and isinstance(decided.recompute_seconds, float)
    assert decided.choice == "recompute" and "rnn_forward (rnn)" in str(plan)


@pytest.mark.slow
def test_budget_mode_stays_monotone_with_the_op_choice():
    """A lower budget never gets a higher peak, the op's mode being one more choice."""
    peaks = []
    for budget in (1.0, 0.97, 0.5, 0.1):
        model, x = _model()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", mirrorgrad.MirrorgradBudgetWarning)
            _, _, plan = _run(model, x, mode="budget", budget=budget)
        peaks.append(plan.peak_after)
    assert peaks == sorted(peaks, reverse=True) and peaks[-1] < peaks[0]


@pytest.mark.slow
@pytest.mark.parametrize(("options", "choice"), [({"mode": "off"}, "stash"),
                                                 ({"mode": "budget", "budget": 0.5}, "recompute")])
def test_inductor_runs_the_rewritten_op(options, choice):
    """Inductor rebuilds a custom op's call from the fake arguments recorded at tracing
    (``eager_input_vals``): the rewrite must update them, or the backward gets the old
    number of saved tensors (a crash once seen on an H100: an IndexError in the backward)."""
    model, x = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mirrorgrad.MirrorgradBudgetWarning)
        plan = _check_against_eager(model, x, tolerance=1e-9, backend="inductor", **options)
    assert plan.op_memory[0].choice == choice


def _medium_lstm_joint(impl: str):
    """The joint graph of the medium LM's LSTM (2x650, B20, BPTT 35, fp32) under a small
    decoder, traced with the reference and then set to ``impl`` with memory="auto" (the
    fake kernels give each impl's saved layout; nothing of ``impl`` runs)."""
    class Lm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = mnn.LSTM(650, 650, 2, impl="reference", memory="stash")
            self.out = nn.Linear(650, 2000)

        def forward(self, x):
            return self.out(self.rnn(x)[0]).square().mean()

    torch.manual_seed(0)
    joint = joint_of(Lm(), torch.randn(35, 20, 650))
    for node in joint.gm.graph.nodes:
        for op, memory_at, impl_at in ((FORWARD, 12, 14), (BACKWARD, 17, 19)):
            if node.target is op:
                args = list(node.args)
                args[memory_at], args[impl_at] = "auto", impl
                node.args = tuple(args)
    return joint


def test_the_ops_time_formula_lets_balance_recompute_what_the_measured_cost_allows(monkeypatch):
    """Priced by FLOPs the recurrence costs a third more to recompute (one more forward's
    GEMMs on two forward's worth); measured on the H100 (op_memory_timing.json, phases
    inside one step) recompute adds ~8% of the op's forward+backward, and the fitted rule
    (the op's time formula) says as much. Under a 15% cap balance now recomputes, as the
    measurement allows; by the roofline it kept stash."""
    from mirrorgrad import formulas
    from mirrorgrad.mirror import PlanOptions, op_memory

    # benchmarks/op_memory_timing.py's phases of the compiled op, measured on an H100
    timing = Path(__file__).with_name("op_memory_timing_h100.json")
    medium = ("lstm", 2, 650, 20)
    rows = json.loads(timing.read_text())
    (row,) = [r for r in rows if (r["mode"], r["layers"], r["hidden"], r["batch"]) == medium]
    op_ms = row["stash"]["step_ms"]
    measured_share = (row["recompute"]["step_ms"] - op_ms) / op_ms
    cap = 0.15
    assert measured_share < cap  # the op alone; the decoder's time only lowers the share

    options = PlanOptions(mode="balance", max_overhead=cap)
    joint = _medium_lstm_joint("triton")
    _, timed = op_memory.plan_joint(joint.gm, joint.num_fwd_outputs, options)
    (decided,) = timed.op_memory
    assert decided.choice == "recompute" and timed.peak_after < timed.peak_before
    assert decided.recompute_seconds / timed.step_time_s < cap
    assert decided.seconds > 1e-3  # the op's priced fwd+bwd: milliseconds, as measured
    assert "op priced" in str(timed)

    monkeypatch.setattr(formulas, "_TIME", {})  # the roofline alone, as before
    joint = _medium_lstm_joint("triton")
    _, roofline = op_memory.plan_joint(joint.gm, joint.num_fwd_outputs, options)
    (decided,) = roofline.op_memory
    assert decided.choice == "stash"
    assert decided.recompute_seconds / roofline.step_time_s > cap
