"""The rnn-modules and word-lm suites on the CPU: their methods run and agree where they must;
the module table from a hand-written results document."""

import pytest
import torch
from benchmarks import rnn_kernels

from mirrorgrad.bench import report, rnn_modules, word_lm
from mirrorgrad.bench.gradients import GradCheck
from mirrorgrad.bench.runner import RunOptions, measure
from mirrorgrad.bench.suite_tables import module_rows, module_table
from mirrorgrad.bench.suites import SUITES, get_method

OPTS = RunOptions(quick=True, steps=1, warmup=1, backend="eager")


def test_rnn_flops_count_the_gate_gemms():
    cfg = rnn_modules.Config(layers=2, input=3, hidden=5, batch=7, T=11)
    forward = 2 * 11 * 7 * 4 * 5 * ((3 + 5) + (5 + 5))
    assert rnn_modules.step_flops("lstm", cfg) == 3 * forward
    bi = rnn_modules.Config(layers=1, input=3, hidden=5, batch=7, T=11, bidirectional=True)
    assert rnn_modules.step_flops("gru", bi) == 3 * 2 * (2 * 11 * 7 * 3 * 5 * (3 + 5))


def test_the_module_suite_has_seven_shapes_per_mode_and_every_graphed_impl():
    names = [c.name for c in rnn_modules.CONFIGS]
    assert names == ["L2-I650-H650-B20-T35", "L2-I1500-H1500-B20-T35", "L2-I1024-H1024-B64-T35",
                     "L4-I1024-H1024-B128-T35", "L1-I512-H512-B16-T100", "L2-I512-H512-B256-T35",
                     "L2-I1024-H1024-B64-T35-bi"]  # fmt: skip
    assert len(rnn_modules.WORKLOADS) == 7 * 3
    methods = SUITES["rnn-modules"].methods
    assert {"eager", "cuda-graph", "cuda-graph+mgnn"} <= set(methods)
    for impl in rnn_modules.IMPLS:
        assert f"cuda-graph+mgnn-{impl}" in methods
        assert get_method(f"cuda-graph+mgnn-{impl}").cuda_graph
        assert not get_method(f"mgnn-{impl}").cuda_graph


@pytest.mark.slow
@pytest.mark.parametrize("mode", rnn_modules.SUITE_MODES)
def test_rnn_module_and_kernels_match_cudnns_gradients(mode, tmp_path):
    workload = rnn_modules.WORKLOADS[f"rnn-{mode}-{rnn_modules.CONFIGS[0].name}"]
    grads = GradCheck("eager", tmp_path / "grads.pt", "fp32")
    kernels = {m.name: m for m in rnn_kernels.kernel_methods()}
    methods = [get_method(n) for n in ("eager", "eager+mgnn", "mgnn-triton", "mgnn-cudnn")]
    methods += [kernels[n] for n in ("mgnn-triton-stash", "kernel-auto", "kernel-recompute")]
    for method in methods:
        result = measure(workload, method, OPTS, grads)
        assert result.status == "ok", (method.name, result.error)
        assert result.tflops is not None and result.tflops > 0
        if method.name != "eager":
            assert result.grads_ok and result.grad_error < 1e-5, (method.name, result.grad_error)


def test_a_cuda_graph_needs_cuda():
    workload = next(iter(rnn_modules.WORKLOADS.values()))
    for name in ("cuda-graph", "cuda-graph+mgnn", "cuda-graph+mgnn-triton"):
        result = measure(workload, get_method(name), OPTS)
        assert result.status == "skipped"
        assert result.error == "needs CUDA (the step is captured in a CUDA Graph)"


@pytest.mark.slow
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
def test_rnn_module_suite_on_the_gpu_every_method_agrees_with_cudnn(mode, tmp_path):
    import dataclasses

    opts = dataclasses.replace(OPTS, device="cuda", steps=3)
    workload = rnn_modules.WORKLOADS[f"rnn-{mode}-{rnn_modules.CONFIGS[0].name}"]
    grads = GradCheck("eager", tmp_path / "grads.pt", "fp32")
    peaks = {}
    for name in ("eager", *SUITES["rnn-modules"].methods):
        result = measure(workload, get_method(name), opts, grads)
        assert result.status == "ok", (name, result.error)
        peaks[name] = result.peak_bytes
        if name != "eager":
            assert result.grads_ok, (name, result.grad_error)
    # A graph's peak is its recording's: at least the parameters, gradients and what the
    # step saves, as the plain step's is (not the ~0 its replays allocate).
    assert peaks["cuda-graph"] >= 0.5 * peaks["eager"]


def _result(name, ms, peak, **extra):
    return {"method": name, "status": "ok", "median_ms": ms, "peak_bytes": peak, **extra}


def _module_doc():
    mib = 2**20
    return {
        "env": {"gpu": "test GPU"},
        "options": {"dtype": "bf16"},
        "workloads": {
            "rnn-lstm-L2-I8-H8-B20-T35": {"methods": [
                _result("eager", 4.0, 10 * mib), _result("cuda-graph", 2.0, 20 * mib),
                _result("eager+mgnn", 2.5, 8 * mib),
                _result("cuda-graph+mgnn", 1.6, 10 * mib, grads_ok=False,
                        auto_picks=["persistent (cudnn 1.70, persistent 1.50)"]),
                _result("cuda-graph+mgnn-triton", 1.0, 5 * mib),
                _result("cuda-graph+mgnn-persistent", 1.25, 4 * mib),
                {"method": "cuda-graph+mgnn-cudnn", "status": "failed", "error": "OOM"},
            ]},
            "rnn-gru-L2-I8-H8-B20-T35": {"methods": [
                _result("eager", 3.0, mib), _result("cuda-graph", 3.0, mib),
                {"method": "cuda-graph+mgnn", "status": "skipped", "error": "needs CUDA"},
            ]},
        },
    }  # fmt: skip


def test_module_rows_set_each_method_against_graphed_cudnn():
    lstm, gru = module_rows(_module_doc())
    assert lstm["mgnn auto graphed speedup"] == pytest.approx(2.0 / 1.6)
    assert lstm["mgnn auto graphed peak ratio"] == pytest.approx(0.5)
    # The fastest graphed fixed implementation, not the one with the least memory.
    assert lstm["best fixed impl"] == "triton" and lstm["best fixed graphed ms"] == 1.0
    assert lstm["best fixed graphed speedup"] == pytest.approx(2.0)
    assert lstm["cuDNN speedup"] == pytest.approx(0.5)
    assert lstm["wrong gradients"] == ["cuda-graph+mgnn"]
    assert lstm["auto picked graphed"] == "persistent (cudnn 1.70, persistent 1.50)"
    assert lstm["not measured"] == {"cuda-graph+mgnn-cudnn": "OOM"}
    assert gru["mgnn auto graphed ms"] is None and gru["best fixed impl"] is None
    # Every graphed implementation's numbers, the same keys in every row (the CSV's columns).
    assert lstm["graphed persistent ms"] == 1.25 and lstm["graphed cudnn ms"] is None
    assert lstm.keys() == gru.keys()


def test_module_table_rows_geomeans_and_what_was_not_measured():
    table = module_table(_module_doc())
    head, _, lstm, gru, *_ = table.splitlines()
    cells = dict(zip(head.split(" | "), lstm.split(" | ")))
    assert cells["mgnn auto graphed: ms (x) / peak MiB (x)"] == "1.60 (1.25x) / 10.0 (0.50x)"
    best = cells["best fixed graphed: ms (x) / peak MiB (x)"]
    assert best == "1.00 (2.00x) / 5.00 (0.25x) triton"
    assert lstm.endswith("| WRONG: cuda-graph+mgnn | persistent (cudnn 1.70, persistent 1.50) |")
    assert gru.endswith("| ok | — |")
    assert "- lstm, geomean speedup over graphed cuDNN: cuDNN 0.50x (1)" in table
    assert "- needs CUDA: cuda-graph+mgnn (1 workloads)" in table
    assert "- OOM: cuda-graph+mgnn-cudnn (1 workloads)" in table


def test_module_files_write_the_csv_and_the_plot(tmp_path):
    import csv

    paths = report.module_files(_module_doc(), tmp_path)
    assert [p.name for p in paths] == ["module_table.csv", "module_speedups.png"]
    with open(paths[0]) as f:
        rows = list(csv.DictReader(f))
    assert [r["workload"] for r in rows] == list(_module_doc()["workloads"])
    assert float(rows[0]["best fixed graphed speedup"]) == 2.0
    assert paths[1].stat().st_size > 1000
