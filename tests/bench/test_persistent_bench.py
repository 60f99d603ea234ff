"""The persistent RNN studies' summaries (benchmarks/persistent_rnn.py, persistent_overhead.py)."""

import math

from benchmarks import persistent_overhead, persistent_rnn


def _row(mode, dtype, ms):
    return {"mode": mode, "dtype": dtype, "config": "c", "ms": ms}


def test_geomean_speedups_per_mode_and_dtype():
    rows = [
        _row("lstm", "fp32", {"cudnn": 4.0, "auto": 2.0}),
        _row("lstm", "fp32", {"cudnn": 1.0, "auto": 2.0}),
        _row("lstm", "bf16", {"cudnn": 3.0, "auto": 1.0}),
        _row("lstm", "bf16", {"cudnn": 3.0, "auto": None}),  # failed: left out
    ]
    g = persistent_rnn.geomean_speedups(rows, "auto", "cudnn")
    assert math.isclose(g[("lstm", "fp32")], 1.0) and math.isclose(g[("lstm", "bf16")], 3.0)
    table = persistent_rnn._table(rows, ["cudnn", "auto"])
    assert "| lstm | fp32 | c | 4.00 | 2.00 | - | - | 2.00x | - |" in table
    assert "geomean lstm bf16 auto vs cudnn: 3.00x (2 rows)" in table


def test_overhead_union_of_kernel_intervals():
    # Overlapping and nested intervals count once: [0, 5) and [7, 9) -> 7 us.
    spans = [(0.0, 3.0), (1.0, 5.0), (2.0, 4.0), (7.0, 9.0)]
    assert math.isclose(persistent_overhead._union_ms(spans), 7e-3)


def test_overhead_counts_calls_that_may_wait():
    wait = persistent_overhead._may_wait
    assert wait("cudaStreamSynchronize") and wait("cudaMalloc") and wait("cudaMemcpy")
    assert not wait("cudaLaunchKernel") and not wait("cudaMemcpyAsync")
