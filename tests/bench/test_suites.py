"""The rnn-kernels and word-lm suites on the CPU: their methods run and agree where they must."""

import pytest
import torch

from mirrorgrad.bench import rnn_kernels, word_lm
from mirrorgrad.bench.gradients import GradCheck
from mirrorgrad.bench.runner import RunOptions, measure
from mirrorgrad.bench.suites import get_method

OPTS = RunOptions(quick=True, steps=1, warmup=1, backend="eager")


def test_rnn_flops_count_the_gate_gemms():
    cfg = rnn_kernels.Config(layers=2, input=3, hidden=5, batch=7, T=11)
    forward = 2 * 11 * 7 * 4 * 5 * ((3 + 5) + (5 + 5))
    assert rnn_kernels.step_flops("lstm", cfg) == 3 * forward
    bi = rnn_kernels.Config(layers=1, input=3, hidden=5, batch=7, T=11, bidirectional=True)
    assert rnn_kernels.step_flops("gru", bi) == 3 * 2 * (2 * 11 * 7 * 3 * 5 * (3 + 5))


@pytest.mark.parametrize("mode", rnn_kernels.SUITE_MODES)
def test_rnn_module_and_kernels_match_cudnns_gradients(mode, tmp_path):
    workload = rnn_kernels.WORKLOADS[f"rnn-{mode}-{rnn_kernels.CONFIGS[0].name}"]
    grads = GradCheck("eager", tmp_path / "grads.pt", "fp32")
    for name in ("eager", "eager+mgnn", "kernel-auto", "kernel-recompute"):
        result = measure(workload, get_method(name), OPTS, grads)
        assert result.status == "ok", (name, result.error)
        assert result.tflops is not None and result.tflops > 0
        if name != "eager":
            assert result.grads_ok and result.grad_error < 1e-5, (name, result.grad_error)


def test_cuda_graph_needs_a_gpu():
    workload = next(iter(rnn_kernels.WORKLOADS.values()))
    result = measure(workload, get_method("cuda-graph"), OPTS)
    assert result.status == "failed"
    assert result.error == "RuntimeError: CUDA Graphs need a CUDA device"


def test_word_lm_runs_the_example_and_the_train_step():
    workload = word_lm.WORKLOADS["word-lm-medium-b20"]
    for name in ("pytorch-example", "train-lm"):
        result = measure(workload, get_method(name), OPTS)
        assert result.status == "ok", (name, result.error)
        assert result.tokens_per_s == pytest.approx(result.samples_per_s * 5)
    # The train step's model starts from the example's weights: same first loss.
    example = measure(workload, get_method("pytorch-example"), OPTS)
    train = measure(workload, get_method("train-lm-off"), OPTS)
    assert example.first_loss == pytest.approx(train.first_loss, rel=0.05)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_rnn_suite_on_the_gpu_module_graphs_and_kernels_agree(mode, tmp_path):
    import dataclasses

    opts = dataclasses.replace(OPTS, device="cuda", steps=3)
    workload = rnn_kernels.WORKLOADS[f"rnn-{mode}-{rnn_kernels.CONFIGS[0].name}"]
    grads = GradCheck("eager", tmp_path / "grads.pt", "fp32")
    for name in ("eager", "cuda-graph", "eager+mgnn", "cuda-graph+mgnn", "kernel-auto"):
        result = measure(workload, get_method(name), opts, grads)
        assert result.status == "ok", (name, result.error)
        if name != "eager":
            assert result.grads_ok, (name, result.grad_error)
