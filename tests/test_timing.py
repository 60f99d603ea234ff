import time

import pytest

from mirrorgrad._timing import Timing, time_calls


def test_quantiles_of_samples():
    t = Timing.of([5.0, 1.0, 3.0, 2.0, 4.0])
    assert t.median_ms == 3.0
    assert t.p20_ms == pytest.approx(1.8)
    assert t.p80_ms == pytest.approx(4.2)
    with pytest.raises(ValueError):
        Timing.of([])


def test_cpu_calls_are_timed_after_warmup():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.002 if len(calls) > 2 else 0.05)  # the warm-up calls are slow

    t = time_calls(fn, repeats=4, warmup=2, device="cpu")
    assert len(calls) == 6 and len(t.samples_ms) == 4
    assert 1.5 < t.median_ms < 40
    with pytest.raises(ValueError, match="repeats"):
        time_calls(fn, repeats=0, device="cpu")
