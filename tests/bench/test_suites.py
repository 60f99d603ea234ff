"""The rnn-kernels and word-lm suites on the CPU: their methods run and agree where they must."""

import pytest
import torch

from mirrorgrad.bench import rnn_kernels, word_lm
from mirrorgrad.bench.gradients import GradCheck
from mirrorgrad.bench.runner import RunOptions, measure
from mirrorgrad.bench.suite_tables import rnn_table
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
    methods = ("eager", "eager+mgnn", *rnn_kernels.MODULE_IMPLS, "kernel-auto", "kernel-recompute")
    for name in methods:
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


def test_rnn_table_leads_with_the_module_and_says_what_it_adds_to_the_kernels():
    def method(name, ms, **extra):
        return {"method": name, "status": "ok", "median_ms": ms, **extra}

    doc = {
        "env": {"peak_tflops": {"fp32": 100.0}},
        "options": {"dtype": "fp32"},
        "workloads": {
            "rnn-lstm-L2-I8-H8-B20-T3": {"methods": [
                method("eager", 4.0), method("cuda-graph", 2.0),
                method("eager+mgnn", 2.5, tflops=10.0), method("mgnn-triton", 2.2),
                method("mgnn-cudnn", 4.1), method("mgnn-triton-stash", 1.98),
                method("kernel-recompute", 2.0), method("kernel-auto", 1.8, grads_ok=False),
            ]},
        },
    }  # fmt: skip
    table = rnn_table(doc)
    head, _, row, *_ = table.splitlines()
    assert head.split(" | ")[1:4] == ["cuDNN ms", "cuDNN graphed ms", "mirrorgrad.nn ms"]
    cells = dict(zip(head.split(" | "), row.split(" | ")))
    assert cells["vs cuDNN"] == "1.60x" and cells["vs graphed"] == "0.80x"
    assert cells["of peak"] == "10.0%" and cells["mgnn-cudnn ms"] == "4.10"
    assert cells["module / kernels"] == "1.10x"  # mgnn-triton-stash over kernel-auto
    assert cells["best kernel ms"] == "1.80 (kernel-auto)"
    assert cells["auto / best"] == "1.26x"  # 2.5 against mgnn-triton-stash 1.98
    assert "WRONG: kernel-auto" in row
    assert "lstm: mirrorgrad.nn geomean 1.60x of cuDNN, 0.80x of cuDNN in a CUDA Graph" in table
    doc["workloads"]["rnn-lstm-L1-I8-H8-B4-T3"] = doc["workloads"]["rnn-lstm-L2-I8-H8-B20-T3"]
    assert "- lstm, batch 1-4: mirrorgrad.nn geomean 1.60x" in rnn_table(doc)


def test_the_subset_flag_names_workloads_and_methods_that_exist(monkeypatch):
    from mirrorgrad import cli

    seen = []
    monkeypatch.setattr(cli, "main", lambda argv: seen.append(argv) or 0)
    rnn_kernels.main(["--subset", "--dtype", "bf16"])
    (argv,) = seen
    assert argv[:3] == ["bench", "--suite", "rnn-kernels"] and argv[-2:] == ["--dtype", "bf16"]
    assert set(rnn_kernels.SUBSET["workloads"]) <= set(rnn_kernels.WORKLOADS)
    assert set(rnn_kernels.SUBSET["methods"]) <= set(rnn_kernels.METHODS)
