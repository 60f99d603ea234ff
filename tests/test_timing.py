import pytest
import torch

from mirrorgrad import _timing
from mirrorgrad._timing import Timing, time_calls


def test_quantiles_of_samples():
    t = Timing.of([5.0, 1.0, 3.0, 2.0, 4.0])
    assert t.median_ms == 3.0
    assert t.p20_ms == pytest.approx(1.8)
    assert t.p80_ms == pytest.approx(4.2)
    with pytest.raises(ValueError):
        Timing.of([])


def test_cpu_calls_are_timed_after_warmup(monkeypatch):
    # A clock that each call moves on by a known amount: a busy machine cannot blur it.
    now, calls = [0.0], []

    def fn():
        calls.append(1)
        now[0] += 0.002 if len(calls) > 2 else 0.05  # the warm-up calls are slow

    monkeypatch.setattr(_timing.time, "perf_counter", lambda: now[0])
    t = time_calls(fn, repeats=4, warmup=2, device="cpu")
    assert len(calls) == 6 and t.samples_ms == pytest.approx((2.0,) * 4)
    with pytest.raises(ValueError, match="repeats"):
        time_calls(fn, repeats=0, device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_peak_bytes_of_a_call_counts_what_it_allocates_beyond_what_exists():
    held = torch.empty(8 << 20, device="cuda")  # before the call: not counted
    calls = []

    def step():
        calls.append(torch.empty(1 << 20, device="cuda").shape)  # 4 MiB, freed at return

    # The call's 4 MiB, not the 32 held before it; on an H200 the allocator's peak also
    # counted 0.25 MiB beyond the tensor (allocated outside the call's code).
    assert 4 << 20 <= _timing.peak_bytes_of(step) < 5 << 20
    assert len(calls) == 2 and held.numel() == 8 << 20
