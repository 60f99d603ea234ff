"""benchmarks/max_batch.py: the search against a fake memory limit (a pure function), and
the script end to end on the CPU (the estimated peak held against the cap)."""

import json
import subprocess
import sys

import pytest
import torch
from benchmarks import max_batch
from benchmarks.max_batch import guess_batch, search_max_batch


def _fake_limit(largest: int, calls: list[int]):
    def fits(batch: int) -> bool:
        calls.append(batch)
        return batch <= largest

    return fits


@pytest.mark.parametrize("largest", [1, 7, 37, 100, 1000])
@pytest.mark.parametrize("guess", [1, 30, 40, 5000])
def test_finds_the_exact_largest_batch(largest, guess):
    calls: list[int] = []
    found = search_max_batch(_fake_limit(largest, calls), guess=guess, max_probes=64)
    assert found.largest_fit == largest
    assert found.smallest_fail == largest + 1
    assert found.exact
    assert [b for b, _ in found.probes] == calls
    assert len(set(calls)) == len(calls), "a batch was probed twice"


def test_good_guess_needs_few_probes():
    found = search_max_batch(_fake_limit(37, []), guess=37, max_probes=64)
    assert found.exact and found.largest_fit == 37
    assert len(found.probes) <= 4


def test_probe_budget_gives_a_bracket():
    found = search_max_batch(_fake_limit(1000, []), guess=10, max_probes=3)
    assert len(found.probes) == 3
    assert not found.exact
    assert found.largest_fit is not None and found.largest_fit < 1000
    assert found.smallest_fail is None


def test_nothing_fits():
    found = search_max_batch(lambda b: False, guess=50, max_probes=64)
    assert found.largest_fit is None
    assert found.smallest_fail == 1
    assert found.exact


def test_limit_caps_the_search():
    found = search_max_batch(lambda b: True, guess=5, max_probes=64, limit=64)
    assert found.largest_fit == 64
    assert not found.exact


def test_bad_probe_count():
    with pytest.raises(ValueError, match="max_probes"):
        search_max_batch(lambda b: True, guess=1, max_probes=0)


def test_guess_batch_extrapolates_linearly():
    # 100 MB fixed + 10 MB per sample: 20 samples measured at 300 MB; 1 GB fits 90.
    mb = 10**6
    assert (
        guess_batch(batch=20, peak_bytes=300 * mb, fixed_bytes=100 * mb, cap_bytes=1000 * mb) == 90
    )
    assert guess_batch(batch=20, peak_bytes=300 * mb, fixed_bytes=100 * mb, cap_bytes=50 * mb) == 1


def _linear_memory(fixed: int, per_sample: int, cap: int, calls: list[int]):
    """A fake step whose peak is fixed + per_sample * batch, with the allocator capped."""

    def fits(batch: int) -> tuple[bool, int | None]:
        calls.append(batch)
        peak = fixed + per_sample * batch
        return (True, peak) if peak <= cap else (False, None)

    return fits


@pytest.mark.parametrize("guess", [10, 252, 900, 5000])
def test_measured_peaks_steer_the_search(guess):
    # lstm-lm-large on an H100: the guess from the timed run was 252; the true answer
    # under 4 GB is far higher. Galloping alone ends 3 probes in with a lower bound.
    mb = 2**20
    fixed, per_sample, cap = 300 * mb, 7 * mb, 4000 * mb
    largest = (cap - fixed) // per_sample
    calls: list[int] = []
    found = search_max_batch(
        _linear_memory(fixed, per_sample, cap, calls), guess=guess, max_probes=64, cap_bytes=cap
    )
    assert found.exact and found.largest_fit == largest
    if guess < largest:  # two fits give the line: the answer, then its proof
        assert len(calls) <= 4, calls
    without_peaks = search_max_batch(_fake_limit(largest, []), guess=guess, max_probes=64)
    assert len(without_peaks.probes) > len(calls)


def test_a_bad_prediction_still_converges():
    # Memory grows faster than linearly: each secant step overshoots or falls short;
    # bisection in between still brackets the answer exactly.
    cap = 10_000

    def fits(batch: int) -> tuple[bool, int | None]:
        peak = batch * batch
        return (True, peak) if peak <= cap else (False, None)

    found = search_max_batch(fits, guess=3, max_probes=64, cap_bytes=cap)
    assert found.exact and found.largest_fit == 100


@pytest.mark.slow
def test_the_script_probes_in_processes_and_finds_the_largest_batch(tmp_path):
    cap_gb = 0.00005
    argv = [sys.executable, max_batch.__file__, "--quick", "--backend", "eager", "--cap-gb"]
    argv += [str(cap_gb), "--workloads", "mlp", "--methods", "eager", "--max-probes", "3"]
    done = subprocess.run([*argv, "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads((tmp_path / "max_batch.json").read_text())["results"]
    records = row["probe_records"]
    assert len(records) == 1 + len(row["probes"]) - 1  # the first probe is recorded too
    for record in records:
        # A batch fits exactly when its estimated peak is under the cap.
        assert record["fits"] == (record["peak_bytes"] <= cap_gb * 1e9)
    fits = [b for b, ok in row["probes"] if ok]
    assert row["largest_fit"] == max(fits) and row["largest_fit"] > records[0]["batch"]
    assert "| mlp | eager | " in done.stdout


@pytest.mark.parametrize(
    "argument, says",
    [
        (["--cap-gb", "nan"], "--cap-gb must be a finite number > 0, got nan"),
        (["--cap-gb", "1", "--max-probes", "0"], "--max-probes must be >= 1, got 0"),
        (["--cap-gb", "1", "--workloads", "nope"], "unknown workload nope"),
        (["--cap-gb", "1"], "name at least one workload"),
    ],
)
def test_the_script_refuses_bad_input(argument, says, capsys):
    with pytest.raises(SystemExit) as stop:
        max_batch.main(argument)
    assert stop.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_probe_fits_under_a_large_cap():
    from mirrorgrad.bench.runner import RunOptions

    opts = RunOptions(quick=True, steps=1, warmup=1, backend="eager", device="cuda", batch=4)
    assert max_batch.probe("mlp", "eager", opts, cap_bytes=10**9)["fits"]
    torch.cuda.set_per_process_memory_fraction(1.0)
