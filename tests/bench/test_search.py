"""The batch-size search against a fake memory limit (a pure function)."""

import pytest

from mirrorgrad.bench.search import guess_batch, search_max_batch


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
