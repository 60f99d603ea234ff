"""benchmarks/rnn_memory_modes.py: its tables from hand-made rows, the CPU stash count, the
gradient gate, and the script end to end on the CPU (--quick, Triton's interpreter)."""

import json
import subprocess
import sys

import pytest
import torch
from benchmarks import rnn_memory_modes as rmm


def _row(mode, dtype, *, cudnn=None, stash=(100, 50, 2.0), recompute=(40, 60, 2.2), T=35):
    """A measured row: per module (stash bytes, backward extra bytes, median ms)."""

    def method(values):
        stash_bytes, extra, ms = values
        m = {"stash_bytes": stash_bytes, "backward_extra_bytes": extra, "grad_error": 1e-4}
        return m | ({"median_ms": ms} if ms is not None else {})

    methods = {"stash": method(stash), "recompute": method(recompute)}
    if cudnn is not None:
        methods = {"cudnn": method(cudnn)} | methods
    config = {"layers": 2, "input": 8, "hidden": 8, "batch": 2, "T": T, "bidirectional": False}
    return {"mode": mode, "dtype": dtype, "config": config, "methods": methods}


def test_mode_table_takes_geometric_means_per_mode_and_dtype():
    rows = [
        # recompute / cuDNN stash 0.25 and 1.0 -> 0.50; recompute / stash time 1.21, 1.0 -> 1.10
        _row("lstm", "fp32", cudnn=(400, 0, 1.0), recompute=(100, 0, 2.42)),
        _row("lstm", "fp32", cudnn=(100, 0, 1.0), recompute=(100, 0, 2.0)),
        _row("gru", "bf16", recompute=(10, 0, 3.0)),  # no cuDNN (CPU): no stash ratio
    ]
    lines = rmm.mode_table(rows).splitlines()
    assert lines[0] == (
        "| mode | dtype | recompute stash / cuDNN stash | recompute time / stash time |"
    )
    assert lines[2:] == ["| LSTM | fp32 | 0.50 | 1.10 |", "| GRU | bf16 | — | 1.50 |"]


def test_t_table_in_mib_with_dashes_for_what_was_not_measured():
    mib = 2**20
    rows = [
        _row("lstm", "fp32", cudnn=(21.7 * mib, 82 * mib, None),
             stash=(21.8 * mib, 29.6 * mib, None), recompute=(7 * mib, 38.5 * mib, None)),
        _row("lstm", "fp32", stash=(3 * mib, None, None), recompute=(mib, None, None), T=560),
    ]  # fmt: skip
    assert rmm.t_table(rows).splitlines()[2:] == [
        "| 35 | 21.7 / 82.0 | 21.8 / 29.6 | 7.0 / 38.5 |",
        "| 560 | — | 3.0 / — | 1.0 / — |",
    ]


def test_cpu_stash_counts_saved_storages_the_forward_allocated():
    x, w = torch.randn(4, 8), torch.randn(8, requires_grad=True)
    saved = rmm.SavedStorageBytes([x, w])
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        y = (x.exp() * w).sum()  # mul saves exp's output (new) and w (existing)
    assert saved.total == x.numel() * x.element_size()
    y.backward()


def test_wrong_gradients_past_the_tolerance_or_five_times_cudnns():
    row = _row("lstm", "fp32", cudnn=(1, 1, 1.0))
    row["methods"]["stash"]["grad_error"] = 2e-2  # past fp32's 1e-2
    assert rmm.wrong_gradients(row) == ["stash"]
    row["methods"]["cudnn"]["grad_error"] = 5e-3  # 5x cuDNN's: 2.5e-2
    assert rmm.wrong_gradients(row) == []


@pytest.mark.slow
def test_quick_run_on_the_cpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the CPU path (no cuDNN, no allocator); a GPU runs the full command")
    cmd = [sys.executable, rmm.__file__, "--quick", "--modes", "lstm",
           "--dtype", "fp32", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads((tmp_path / "rnn_memory_modes.json").read_text())
    [row] = doc["rows"]
    assert set(row["methods"]) == {"stash", "recompute"}  # no cuDNN on the CPU
    for m in row["methods"].values():
        assert m["grad_error"] < 1e-5 and m["median_ms"] > 0
    assert 0 < row["methods"]["recompute"]["stash_bytes"] < row["methods"]["stash"]["stash_bytes"]
    short, long = doc["t_rows"]
    assert (short["config"]["T"], long["config"]["T"]) == rmm.QUICK_T_STEPS
    for name in ("stash", "recompute"):  # the stash grows with T; no allocator, no extra
        assert long["methods"][name]["stash_bytes"] > 3 * short["methods"][name]["stash_bytes"]
        assert long["methods"][name]["backward_extra_bytes"] is None
    tables = done.stdout.split("\n\n", 1)[1]
    assert "| LSTM | fp32 | — |" in tables and "| 12 | — | " in tables
    again = subprocess.run([sys.executable, rmm.__file__, "--from-json",
                            str(tmp_path / "rnn_memory_modes.json")],
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    assert again.returncode == 0 and again.stdout.strip() == tables.strip()
