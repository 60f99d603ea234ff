"""The zoo sweep's CPU slice (benchmarks/zoo_sweep.py): every small model trains in every
mode with compile's gradients."""

import pytest
from benchmarks import zoo_sweep as zoo

from mirrorgrad.bench.gradients import GradCheck
from mirrorgrad.bench.runner import RunOptions, measure
from mirrorgrad.bench.suites import get_method

OPTS = RunOptions(quick=True, steps=1, warmup=1, backend="eager")
CPU_SLICE = zoo.SUITE.workload_names(quick=True)


def test_the_cpu_slice_is_about_a_dozen_models():
    assert 10 <= len(CPU_SLICE) <= 14
    assert len(zoo.WORKLOADS) >= 60  # the GPU sweep


@pytest.mark.slow
@pytest.mark.parametrize("name", CPU_SLICE)
def test_every_mode_trains_with_compiles_gradients(name, tmp_path):
    workload = zoo.WORKLOADS[name]
    if workload.missing_packages():
        pytest.skip(f"not installed: {workload.missing_packages()}")
    grads = GradCheck("compile", tmp_path / "grads.pt", "fp32")
    results = [measure(workload, get_method(m), OPTS, grads) for m in zoo.METHODS[1:]]
    results.append(measure(workload, get_method("eager"), OPTS, grads))
    for r in results:
        assert r.status == "ok", (r.method, r.error)
        assert r.fallback is None, (r.method, r.fallback)
        if r.method != "compile":
            assert r.grads_ok, (r.method, r.grad_error, r.grad_worst)
