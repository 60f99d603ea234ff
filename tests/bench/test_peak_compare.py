"""peak_compare: the estimate-only mode on the CPU, and the replay of an allocator
history (a hand-written snapshot, as torch.cuda.memory._snapshot returns it)."""

import json

import pytest
from benchmarks import peak_compare

P, W, G, A1, A2, A3 = 0, 1024, 1536, 2560, 4608, 8704


def _snapshot() -> dict:
    # Before the recording: a parameter P and a workspace W. Forward: A1 (saved), A2
    # (a temporary); backward: A3 (a temporary, the peak), then the gradient G.
    trace = [
        {"action": "alloc", "addr": A1, "size": 2048},
        {"action": "alloc", "addr": A2, "size": 4096},
        {"action": "free_completed", "addr": A2, "size": 4096},
        {"action": "alloc", "addr": A3, "size": 8192},
        {"action": "free_completed", "addr": A3, "size": 8192},
        {"action": "alloc", "addr": G, "size": 1024},
        {"action": "free_completed", "addr": A1, "size": 2048},
    ]
    blocks = [
        {"size": 1024, "state": "active_allocated"},
        {"size": 512, "state": "active_allocated"},
        {"size": 1024, "state": "active_allocated"},
        {"size": 16384, "state": "inactive"},
    ]
    return {"segments": [{"device": 0, "address": 0, "blocks": blocks}], "device_traces": [trace]}


def test_replay_finds_the_peak_and_what_is_alive_there():
    peak, at, blocks = peak_compare._replay(_snapshot(), 0)
    assert (peak, at) == (1024 + 512 + 2048 + 8192, 3)
    assert blocks == {P: (1024, -1), W: (512, -1), A1: (2048, 0), A3: (8192, 3)}


def test_classify_sorts_the_peak_into_rows():
    marks = {"forward": 3, "backward": 7}
    pointers = {"parameters": {P}, "gradients": {G}}
    measured = peak_compare._classify(_snapshot(), 0, marks, pointers)
    rows = {k: v for k, v in measured["by_row"].items() if v}
    assert rows == {
        "parameters": 1024,
        peak_compare.HELD: 512,
        "saved activations": 2048,
        "backward temporaries": 8192,
    }
    assert measured["phase"] == "backward" and measured["peak"] == sum(rows.values())
    held = [v for v in measured["by_source"] if v["row"] == peak_compare.HELD]
    assert held == [{"row": peak_compare.HELD, "source": "before the recording", "bytes": 512}]


def test_the_peak_is_the_steps_from_its_mark_on():
    """A3's peak before the step's mark (a warm-up's) does not count after it."""
    peak, at, _ = peak_compare._replay(_snapshot(), 0, start=3)
    assert (peak, at) == (1024 + 512 + 2048 + 8192, 3)
    peak, at, _ = peak_compare._replay(_snapshot(), 0, start=5)
    assert (peak, at) == (1024 + 512 + 2048 + 1024, 5)


def test_match_pairs_blocks_with_values_of_the_same_rounded_size():
    measured = [{"row": "backward temporaries", "bytes": 8192}, {"row": "inputs", "bytes": 2048}]
    estimated = [{"name": "mm", "row": "backward temporaries", "bytes": 8000}]
    estimated.append({"name": "tiny", "row": "inputs", "bytes": 100})
    missed, extra = peak_compare._match(measured, estimated)
    assert missed == [measured[1]] and [v["name"] for v in extra] == ["tiny"]


@pytest.mark.slow
def test_cpu_mode_reports_the_estimate(tmp_path, capsys):
    argv = ["--quick", "--workloads", "mlp", "--plans", "balance", "--out", str(tmp_path)]
    assert peak_compare.main(argv) == 0
    (result,) = json.loads((tmp_path / "peak_compare.json").read_text())
    est = result["estimated"]
    assert "measured" not in result and result["device"] == "cpu"
    assert sum(est["by_row"].values()) == est["peak"] > 0
    assert est["by_row"]["parameters"] > 0 and est["by_row"]["gradients"] > 0
    assert "mlp / balance on cpu" in capsys.readouterr().out


@pytest.mark.slow
def test_cpu_mode_plans_the_train_step_and_swapped_rnns(tmp_path, capsys):
    workloads = "word-lm-medium-b20,lstm-lm-medium+mgnn"
    argv = ["--quick", "--workloads", workloads, "--plans", "off", "--out", str(tmp_path)]
    assert peak_compare.main(argv) == 0
    results = json.loads((tmp_path / "peak_compare.json").read_text())
    for result in results:
        (choice,) = result["estimated"]["op_memory"]
        assert choice.startswith("rnn_forward (rnn): stash [off]")
        assert result["estimated"]["by_row"]["inputs"] > 0
    assert "word-lm-medium-b20 / off on cpu" in capsys.readouterr().out


@pytest.mark.slow
def test_op_memory_timing_writes_both_modes_and_the_estimate(tmp_path, monkeypatch):
    from benchmarks import op_memory_timing

    sizes = (("lstm", 1, 8, 2, 3, 1), ("gru", 1, 8, 2, 3, 2))
    monkeypatch.setattr(op_memory_timing, "SIZES", sizes)
    argv = ["--out", str(tmp_path), "--device", "cpu", "--rounds", "2", "--steps", "1"]
    assert op_memory_timing.main(argv) == 0
    rows = json.loads((tmp_path / "op_memory_timing.json").read_text())
    assert [(r["mode"], r["directions"]) for r in rows] == [("lstm", 1), ("gru", 2)]
    for row in rows:
        for memory in ("stash", "recompute"):
            times = row[memory]
            assert times["forward_ms"] > 0 and times["backward_ms"] > 0
            assert times["step_ms"] >= times["forward_ms"]
        assert row["gemm_ms_est"] > 0
        priced = row["priced"]
        assert priced["recompute"]["backward_ms"] >= priced["stash"]["backward_ms"] > 0
