"""impl="auto"'s cost rule (ops/rnn/cost.py) against the measured tables it was fitted to."""

import json
import math
from pathlib import Path

import pytest
import torch

from mirrorgrad.ops.rnn import cost

RESULTS = Path(__file__).parents[2] / "docs" / "results" / "rnn-kernels-h200"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The table's columns: cuDNN, and the split Triton kernels in each memory mode.
COLUMNS = {("cudnn", "stash"): "cudnn", ("triton", "stash"): "auto",
           ("triton", "recompute"): "recompute"}  # fmt: skip


def _measured(dtype: str) -> list[tuple[cost.Shape, dict[tuple[str, str], float]]]:
    doc = json.loads((RESULTS / f"rnn_kernels_{dtype}.json").read_text())
    rows = []
    for row in doc["rows"]:
        c = row["config"]
        directions = 2 if c["bidirectional"] else 1
        shape = cost.Shape(mode=row["mode"], T=c["T"], B=c["batch"], H=c["hidden"],
                           layers=c["layers"], directions=directions)  # fmt: skip
        rows.append((shape, {key: row["ms"][column] for key, column in COLUMNS.items()}))
    return rows


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_constants_are_the_fit_of_the_committed_tables(dtype):
    rows = _measured(dtype)
    for impl, memory in COLUMNS:
        fitted = cost.fit((shape, ms[impl, memory]) for shape, ms in rows)
        key = (impl, cost.memory_class(impl, memory), cost.dtype_class(DTYPES[dtype]))
        assert fitted == pytest.approx(cost.COSTS[key], abs=2e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_predictions_are_within_a_fifth_of_the_measured_times(dtype):
    for impl, memory in COLUMNS:
        errors = [
            cost.predicted_ms(impl, memory, DTYPES[dtype], shape) / ms[impl, memory] - 1
            for shape, ms in _measured(dtype)
        ]
        rms = math.sqrt(sum(e * e for e in errors) / len(errors))
        assert rms < 0.2, (impl, memory, rms)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("memory", ["stash", "recompute"])
def test_the_rule_picks_within_ten_percent_of_the_fastest_measured(dtype, memory):
    """Between cuDNN and the split kernels, as the rule would rank them: what it picks is
    never more than 10% slower than the faster of the two on the committed tables."""
    for shape, ms in _measured(dtype):
        picked = cost.pick(["triton", "cudnn"], memory, DTYPES[dtype], shape)
        fastest = min(ms["triton", memory], ms["cudnn", "stash"])
        assert ms[picked, memory if picked == "triton" else "stash"] <= 1.1 * fastest, shape


def test_an_implementation_without_constants_is_never_preferred():
    shape = cost.Shape(mode="lstm", T=35, B=20, H=650, layers=2, directions=1)
    assert cost.predicted_ms("persistent", "recompute", torch.float32, shape) is None
    assert cost.pick(["persistent", "triton"], "recompute", torch.float32, shape) == "triton"
    assert cost.pick(["persistent"], "recompute", torch.float32, shape) == "persistent"


def test_constants_fitted_to_module_results_recover_the_times_they_came_from():
    """A results document of `mirrorgrad bench --suite rnn-kernels` whose mgnn-persistent
    times follow known constants: fit_results gives them back (the way a measured run's
    constants reach COSTS)."""
    truth = (5.0, 1.5, 20.0, 0.4)
    names = ["rnn-lstm-L2-I650-H650-B20-T35", "rnn-lstm-L4-I1024-H1024-B128-T50",
             "rnn-lstm-L1-I512-H512-B16-T100", "rnn-lstm-L2-I1024-H1024-B64-T50-bi",
             "rnn-lstm-L2-I1024-H1024-B1-T100", "rnn-gru-L1-I512-H512-B16-T100"]  # fmt: skip
    assert cost.shape_of(names[3]) == cost.Shape(mode="lstm", T=50, B=64, H=1024, layers=2,
                                                 directions=2)  # fmt: skip
    workloads = {}
    for name in names:
        ms = sum(c * f for c, f in zip(truth, cost.shape_of(name).features()))
        workloads[name] = {"methods": [
            {"method": "mgnn-persistent", "status": "ok", "median_ms": ms},
            {"method": "mgnn-triton-stash", "status": "failed", "median_ms": None},
        ]}  # fmt: skip
    doc = {"options": {"dtype": "bf16"}, "workloads": workloads}
    fitted = cost.fit_results([doc])
    # The module's LSTM recomputes, its GRU stashes: one GRU sample is too few to fit.
    assert list(fitted) == [("persistent", "recompute", "half")]
    assert fitted["persistent", "recompute", "half"] == pytest.approx(truth, abs=1e-3)


# Module-level runs of `mirrorgrad bench --suite rnn-kernels` (another GPU, other
# shapes): the rule, fitted on the H200 kernel tables, must still rank cuDNN and the
# split kernels as those runs measured them through the module.
MODULE_RESULTS = sorted((RESULTS.parent).glob("rnn-module-*/*.results.json"))


@pytest.mark.parametrize("path", MODULE_RESULTS, ids=lambda p: p.parent.name + "/" + p.stem)
def test_the_rule_ranks_the_module_level_runs_within_fifteen_percent(path):
    doc = json.loads(path.read_text())
    dtype = DTYPES[doc["options"]["dtype"]]
    checked = 0
    for name, workload in doc["workloads"].items():
        ms = {m["method"]: m["median_ms"] for m in workload["methods"] if m["status"] == "ok"}
        if "mgnn-triton" not in ms or "mgnn-cudnn" not in ms:
            continue
        shape = cost.shape_of(name)
        memory = "recompute" if shape.mode == "lstm" else "stash"  # the module's default
        picked = cost.pick(["triton", "cudnn"], memory, dtype, shape)
        assert ms[f"mgnn-{picked}"] <= 1.15 * min(ms["mgnn-triton"], ms["mgnn-cudnn"]), name
        checked += 1
    assert checked > 0
