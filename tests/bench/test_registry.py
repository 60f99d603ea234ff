"""The workload and method registries: names, shapes, and that every quick model trains."""

import math

import pytest
import torch
from benchmarks import rnn_kernels, zoo_sweep

from mirrorgrad.bench import rnn_modules, word_lm
from mirrorgrad.bench.methods import MGNN_BASES, default_methods
from mirrorgrad.bench.suites import METHODS, SUITES, Suite, get_method, get_workload, register
from mirrorgrad.bench.suites import WORKLOADS as suites_workloads
from mirrorgrad.bench.workloads import WORKLOADS

ALL_WORKLOADS = (
    "lstm-lm-medium",
    "lstm-lm-large",
    "nmt-attention",
    "resnet50",
    "transformer",
    "resnet152",
    "gpt2",
    "deepspeech2",
    "mlp",
)
BASE_METHODS = (
    "eager",
    "compile",
    "compile-budget-0.7",
    "compile-budget-0.5",
    "compile-budget-0.3",
    "compile-budget-0.1",
    "checkpoint",
    "mirror-balance",
    "mirror-budget-0.7",
    "mirror-budget-0.5",
    "mirror-budget-0.3",
    "mirror-budget-0.1",
    "cuda-graph",
)
FRONTIER_ONLY = ("compile-budget-0.7", "mirror-budget-0.7", "mirror-budget-0.1")


def test_workload_names():
    assert tuple(WORKLOADS) == ALL_WORKLOADS
    with pytest.raises(KeyError, match="mirrorgrad bench --list"):
        get_workload("resnet-18")


def test_method_names():
    suites = set(rnn_modules.METHODS) | {m.name for m in rnn_modules.module_methods()}
    suites |= set(word_lm.METHODS)
    mgnn = {f"{m}+mgnn" for m in BASE_METHODS}
    assert set(METHODS) == set(BASE_METHODS) | mgnn | suites
    assert all(METHODS[f"{m}+mgnn"].swap_rnn for m in BASE_METHODS)
    assert set(MGNN_BASES) <= set(BASE_METHODS)
    planner = [m for m in BASE_METHODS if m != "cuda-graph" and m not in FRONTIER_ONLY]
    assert default_methods(recurrent=False) == planner
    assert default_methods(recurrent=True) == [*planner, *(f"{m}+mgnn" for m in MGNN_BASES)]
    assert METHODS["mirror-budget-0.3"].mirror_options == {"mode": "budget", "budget": 0.3}
    with pytest.raises(KeyError, match="choose from"):
        get_method("compile-budget-0.2")


# The issue's full-size shapes, batch included: (first input's shape, other inputs').
FULL_SHAPES = {
    "lstm-lm-medium": [(35, 20), (35, 20)],
    "lstm-lm-large": [(35, 20), (35, 20)],
    "nmt-attention": [(50, 80), (30, 80), (30, 80)],
    "resnet50": [(64, 3, 224, 224), (64,)],
    "transformer": [(8, 1024), (8, 1024)],
    "resnet152": [(32, 3, 224, 224), (32,)],
    "gpt2": [(8, 1024)],
    "deepspeech2": [(32, 1, 161, 300), (32, 60)],
    "mlp": [(2048, 1024), (2048,)],
}


@pytest.mark.parametrize("name", ALL_WORKLOADS)
def test_full_size_batch_shapes(name):
    workload = WORKLOADS[name]
    _skip_if_missing(workload)
    with torch.device("meta"):
        _, sample, _ = workload.builder(workload.batch, False)
    batch = sample(torch.Generator().manual_seed(0))
    assert [tuple(t.shape) for t in batch] == FULL_SHAPES[name]


def test_resnet50_has_resnet50_parameter_count():
    # torchvision's resnet50 (v1.5) has 25,557,032 parameters.
    with torch.device("meta"):
        model, _, blocks = WORKLOADS["resnet50"].builder(64, False)
    assert sum(p.numel() for p in model.parameters()) == 25_557_032
    assert len(blocks) == 16


def _skip_if_missing(workload):
    if workload.missing_packages():
        pytest.skip(f"needs {', '.join(workload.missing_packages())}")


def test_resnet152_and_gpt2_have_their_parameter_counts():
    # torchvision's resnet152: 60,192,808; GPT-2 small (tied head): 124,439,808.
    expected = {"resnet152": 60_192_808, "gpt2": 124_439_808}
    for name, count in expected.items():
        workload = WORKLOADS[name]
        if workload.missing_packages():
            continue
        with torch.device("meta"):
            model, _, blocks = workload.builder(workload.batch, False)
        assert sum(p.numel() for p in model.parameters()) == count, name
        assert len(blocks) == {"resnet152": 50, "gpt2": 12}[name]


def test_lstm_lm_large_sizes():
    with torch.device("meta"):
        model, _, _ = WORKLOADS["lstm-lm-large"].builder(20, False)
    assert (model.rnn.hidden_size, model.rnn.num_layers) == (1500, 2)
    assert model.embed.num_embeddings == 10_000


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL_WORKLOADS)
def test_quick_workload_trains(name):
    workload = WORKLOADS[name]
    _skip_if_missing(workload)
    built = workload.build(quick=True, dtype=torch.float64)
    assert built.batch == workload.quick_batch
    for block in built.blocks:
        built.model.get_submodule(block)
    loss = built.model(*built.make_batch())
    assert loss.dim() == 0 and math.isfinite(loss.item())
    loss.backward()
    grads = [p.grad for p in built.model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    # Identical batches on each call: methods are compared on the same data.
    first, second = built.make_batch(), built.make_batch()
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    has_rnn = any(isinstance(m, torch.nn.RNNBase) for m in built.model.modules())
    assert workload.recurrent == has_rnn


def test_a_script_registers_its_suite_and_methods_once(monkeypatch):
    monkeypatch.setattr("mirrorgrad.bench.suites.SUITES", dict(SUITES))
    monkeypatch.setattr("mirrorgrad.bench.suites.METHODS", dict(METHODS))
    monkeypatch.setattr("mirrorgrad.bench.suites.WORKLOADS", dict(suites_workloads))
    from mirrorgrad.bench import suites

    methods = rnn_kernels.kernel_methods()
    # The kernel suite shares the module suite's workloads (the same objects).
    register(rnn_kernels.SUITE, methods)
    assert suites.SUITES["rnn-kernels"] is rnn_kernels.SUITE
    assert suites.METHODS["kernel-auto"] is methods[1]
    assert rnn_kernels.SUITE.worker_command() == [str(rnn_kernels.SUITE.script), "--worker"]
    assert SUITES["planner"].worker_command() == ["-m", "mirrorgrad.bench.runner"]
    with pytest.raises(ValueError, match="already registered: rnn-kernels, mgnn-triton-stash"):
        register(rnn_kernels.SUITE, methods[:1])
    # Another workload under a name taken.
    clash = Suite(name="clash", description="", workloads={"mlp": zoo_sweep.WORKLOADS["ours-mlp"]})
    with pytest.raises(ValueError, match="already registered: mlp"):
        register(clash)


def test_build_rejects_bad_batch():
    with pytest.raises(ValueError, match="batch must be >= 1"):
        WORKLOADS["mlp"].build(batch=-1, quick=True)
