"""measure(): a failing method is a result, never an exception; the CPU peak estimate."""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from mirrorgrad.bench import report
from mirrorgrad.bench.methods import Method
from mirrorgrad.bench.runner import FATAL_EXIT, MARKER, RunOptions, measure
from mirrorgrad.bench.suites import WORKLOADS, get_method

OPTS = RunOptions(quick=True, steps=2, warmup=1, backend="eager")


def _raising(exc: BaseException) -> Method:
    def wrap(model, blocks, backend):
        def step_fn(*batch):
            raise exc

        return step_fn

    return Method(name="broken", description="raises", wrap=wrap, compiles=False)


@pytest.mark.slow
@pytest.mark.parametrize(
    "exc",
    [RuntimeError("compile failed\nlong traceback"), torch.OutOfMemoryError("CUDA out of memory")],
    ids=["compile-error", "oom"],
)
def test_failing_method_is_recorded(exc):
    result = measure(WORKLOADS["mlp"], _raising(exc), OPTS)
    assert result.status == "failed"
    assert result.error == f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    assert result.median_ms is None and result.peak_bytes is None
    # The next method in the same process still runs.
    assert measure(WORKLOADS["mlp"], get_method("eager"), OPTS).status == "ok"


@pytest.mark.slow
def test_failing_prepare_is_recorded():
    def wrap(model, blocks, backend):
        raise ValueError("bad options")

    method = Method(name="bad", description="", wrap=wrap, compiles=True)
    result = measure(WORKLOADS["mlp"], method, OPTS)
    assert (result.status, result.error) == ("failed", "ValueError: bad options")


def test_mgnn_method_skips_a_workload_without_rnns():
    result = measure(WORKLOADS["mlp"], get_method("eager+mgnn"), OPTS)
    assert result.status == "skipped"


@pytest.mark.slow
def test_mgnn_method_swaps_the_rnn_keeping_weights():
    import mirrorgrad.nn

    built = WORKLOADS["lstm-lm-medium"].build(quick=True)
    batch = built.make_batch()
    built.model.eval()  # no dropout: the swapped model must give the same loss
    expected = built.model(*batch)
    step_fn = get_method("eager+mgnn").prepare(built.model, blocks=built.blocks, backend="eager")
    assert isinstance(built.model.rnn, mirrorgrad.nn.LSTM)
    torch.testing.assert_close(step_fn(*batch), expected)
    assert measure(WORKLOADS["lstm-lm-medium"], get_method("eager+mgnn"), OPTS).status == "ok"


def test_time_limit_skips_methods_not_started():
    opts = dataclasses.replace(OPTS, deadline=0.0)
    result = measure(WORKLOADS["mlp"], get_method("eager"), opts)
    assert (result.status, result.error) == ("skipped", "time limit reached before this method")


@pytest.mark.slow
def test_eager_and_checkpoint_measured_alike():
    eager = measure(WORKLOADS["transformer"], get_method("eager"), OPTS)
    ckpt = measure(WORKLOADS["transformer"], get_method("checkpoint"), OPTS)
    for r in (eager, ckpt):
        assert r.status == "ok", r.error
        assert len(r.step_ms) == OPTS.steps
        assert r.p20_ms <= r.median_ms <= r.p80_ms
        assert r.peak_source == "cpu-estimate"
        assert r.compile_s is None
    # Same seed, same batch, same model: the same first loss.
    assert ckpt.first_loss == pytest.approx(eager.first_loss, rel=1e-6)
    # Checkpointed blocks save only their inputs: the estimated peak drops, but never
    # below parameters + gradients.
    assert 2 * eager.param_bytes < ckpt.peak_bytes < eager.peak_bytes


def test_ratios_and_markdown():
    methods = [
        {"method": "eager", "status": "ok", "peak_bytes": 400, "median_ms": 2.0},
        {
            "method": "compile",
            "status": "ok",
            "peak_bytes": 200,
            "median_ms": 1.0,
            "step_ms": [1.0, 0.8, 3.0],
        },
        {
            "method": "mirror-balance",
            "status": "ok",
            "peak_bytes": 100,
            "median_ms": 1.5,
            "step_ms": [1.5, 0.9, 1.6],
            "est_peak_bytes": 90,
            "est_graphs": 2,
            "balance_target": {"reason": "at most 0.8x torch.compile's peak: met"},
        },
        {"method": "checkpoint", "status": "failed", "error": "OutOfMemoryError: x"},
    ]
    report.add_ratios(methods)
    mirror = methods[2]
    assert mirror["peak_vs_compile"] == 0.5 and mirror["time_vs_compile"] == 1.5
    assert mirror["peak_vs_eager"] == 0.25 and mirror["time_vs_eager"] == 0.75
    assert mirror["est_vs_measured"] == 0.9
    assert mirror["fastest_vs_compile"] == pytest.approx(0.9 / 0.8)
    assert methods[0]["fastest_vs_compile"] is None  # eager recorded no steps here
    assert "peak_vs_compile" not in methods[3]
    for m in methods[:3]:
        m.update(batch=4, p20_ms=m["median_ms"], p80_ms=m["median_ms"], samples_per_s=1.0)
    doc = {"env": {}, "options": {"dtype": "fp32"}}
    table = report.workload_table("w", {"description": "d", "methods": methods}, doc)
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + len(methods)
    assert "| mirror-balance | 1.50 |" in table and "0.50x" in table
    assert "- `checkpoint` failed: OutOfMemoryError: x" in table
    assert "largest of 2 compiled graphs" in table
    assert "- `mirror-balance`, balance's target (estimated): at most 0.8x" in table


@pytest.mark.slow
def test_balance_records_its_target_and_other_modes_none():
    balance = measure(WORKLOADS["mlp"], get_method("mirror-balance"), OPTS)
    assert balance.status == "ok" and balance.est_peak_bytes
    target = balance.balance_target
    assert target["status"] in ("met", "costly", "missed", "unreachable"), target
    assert target["reached"] > 0 and target["reason"].startswith("at most 0.8x")
    budget = measure(WORKLOADS["mlp"], get_method("mirror-budget-0.5"), OPTS)
    assert budget.status == "ok" and budget.balance_target is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_peak():
    opts = dataclasses.replace(OPTS, device="cuda")
    result = measure(WORKLOADS["mlp"], get_method("eager"), opts)
    assert result.status == "ok" and result.peak_source == "cuda"
    assert result.peak_bytes >= 2 * result.param_bytes


@pytest.mark.slow
def test_cuda_error_reports_then_exits_the_worker():
    # A broken CUDA context poisons later methods: the worker reports and exits (3).
    code = """
from mirrorgrad.bench.methods import Method
from mirrorgrad.bench.runner import RunOptions, measure
from mirrorgrad.bench.suites import WORKLOADS

def wrap(model, blocks, backend):
    def step_fn(*batch):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    return step_fn

measure(WORKLOADS["mlp"], Method(name="x", description="", wrap=wrap, compiles=False),
        RunOptions(quick=True, steps=1, warmup=1))
print("not reached")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == FATAL_EXIT
    (line,) = [x for x in done.stdout.splitlines() if x.startswith(MARKER)]
    record = json.loads(line[len(MARKER) :])
    assert (record["method"], record["status"]) == ("x", "failed")
    assert "illegal memory access" in record["error"]


class MirrorgradFallbackWarning(UserWarning):
    """Stands in for the planner's warning: the runner matches it by class name."""


def _warning_eager(model, blocks, backend):
    import warnings

    warnings.warn(MirrorgradFallbackWarning("planner failed: cause\nmore"), stacklevel=1)
    return model


@pytest.mark.slow
def test_fallback_warning_is_recorded_with_its_cause():
    method = Method(name="warns", description="", wrap=_warning_eager, compiles=False)
    result = measure(WORKLOADS["mlp"], method, OPTS)
    assert result.status == "ok" and result.fallback == "planner failed: cause"


@pytest.mark.slow
def test_wrong_gradients_are_caught(tmp_path):
    from mirrorgrad.bench.gradients import GradCheck

    def doubled(model, blocks, backend):
        def step_fn(*batch):
            return 2 * model(*batch)

        return step_fn

    grads = GradCheck("eager", tmp_path / "g.pt", "fp32")
    assert measure(WORKLOADS["mlp"], get_method("eager"), OPTS, grads).status == "ok"
    same = measure(WORKLOADS["mlp"], get_method("checkpoint"), OPTS, grads)
    assert same.grads_ok and same.grad_error < 1e-6
    wrong = Method(name="doubled", description="", wrap=doubled, compiles=False)
    found = measure(WORKLOADS["mlp"], wrong, OPTS, grads)
    assert found.grads_ok is False and found.grad_error == pytest.approx(1.0, rel=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replays_the_eager_step():
    opts = dataclasses.replace(OPTS, device="cuda", quick=True)
    eager = measure(WORKLOADS["mlp"], get_method("eager"), opts)
    graphed = measure(WORKLOADS["mlp"], get_method("cuda-graph"), opts)
    assert graphed.status == "ok", graphed.error
    # Three warm-up steps run before the capture: the first replayed loss is a later step's.
    assert graphed.first_loss == pytest.approx(eager.first_loss, rel=0.05)


@pytest.mark.slow
def test_profile_writes_a_kernel_table(tmp_path):
    opts = dataclasses.replace(OPTS, profile_dir=tmp_path)
    assert measure(WORKLOADS["mlp"], get_method("eager"), opts).status == "ok"
    text = (tmp_path / "mlp.eager.txt").read_text()
    assert text.startswith("5 steps of mlp.eager") and "aten::" in text


def test_auto_picks_are_the_choices_timed_as_the_method_runs(monkeypatch):
    from mirrorgrad.bench import runner
    from mirrorgrad.ops.rnn import dispatch

    key = ("lstm", torch.device("cpu"), torch.float32, 3, 2, 4, 32, 8, 1, False, False,
           "stash", False, True, False, False)  # fmt: skip
    monkeypatch.setattr(dispatch, "_AUTO_CHOICE", {key: "triton", (*key, "captured"): "cudnn"})
    monkeypatch.setattr(dispatch, "AUTO_TIMES", {(*key, "captured"): {"cudnn": 1.0, "triton": 2.5}})
    assert runner._auto_picks(captured=True) == ["cudnn (cudnn 1.00, triton 2.50)"]
    assert runner._auto_picks(captured=False) == ["triton"]
