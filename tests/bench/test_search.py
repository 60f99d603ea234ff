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
