"""`mirrorgrad bench --quick` and `mirrorgrad explain --quick` end to end on the CPU."""

import argparse
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from benchmarks import zoo_sweep
from tqdm import tqdm

from mirrorgrad import cli
from mirrorgrad.bench import explain
from mirrorgrad.bench.command import _Bench, _share, _WorkerSettings
from mirrorgrad.bench.explain import parse_mode
from mirrorgrad.bench.workloads import Workload

METHODS = ["eager", "checkpoint", "compile-budget-0.5", "mirror-balance"]


@pytest.fixture(scope="module")
def bench_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = ["bench", "--quick", "--workloads", "mlp", "--methods", *METHODS, "--out", str(out)]
    argv += ["--precompile-jobs", "2", "--time-limit", "600"]
    assert cli.main([*argv, "--no-progress"]) == 0
    return out


@pytest.mark.slow
def test_bench_writes_json_with_every_method(bench_out):
    doc = json.loads((bench_out / "results.json").read_text())
    assert doc["env"]["torch"] and doc["env"]["device"] == "cpu"
    assert doc["options"] | {"quick": True, "steps": 3, "warmup": 2} == doc["options"]
    methods = doc["workloads"]["mlp"]["methods"]
    assert [m["method"] for m in methods] == METHODS
    for m in methods:
        assert m["status"] == "ok", m
        assert m["peak_bytes"] > 0 and m["median_ms"] > 0 and m["samples_per_s"] > 0
        assert m["time_vs_eager"] is not None
        # Compiling methods were pre-compiled (cold), then timed with warm caches.
        assert ("cold_compile_s" in m) == (m["method"] in ("compile-budget-0.5", "mirror-balance"))
    mirror = methods[-1]
    assert mirror["est_peak_bytes"] > 0 and mirror["compile_s"] is not None
    assert mirror["cold_compile_s"] > 0 and mirror["precompile_error"] is None


@pytest.mark.slow
def test_bench_writes_markdown_and_plots(bench_out):
    table = (bench_out / "results.md").read_text()
    for method in METHODS:
        assert f"| {method} |" in table
    assert (bench_out / "peak_vs_time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_report_redrawn_from_json(bench_out, tmp_path):
    argv = ["bench", "--from-json", str(bench_out / "results.json"), "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    assert (tmp_path / "results.md").read_text() == (bench_out / "results.md").read_text()
    assert (tmp_path / "peak_vs_time.png").exists()


def test_unknown_names_are_rejected(tmp_path, capsys):
    argv = ["bench", "--quick", "--methods", "eager,nope", "--out", str(tmp_path)]
    assert cli.main(argv) == 2
    assert "unknown method nope" in capsys.readouterr().err


def test_hung_methods_time_out_and_the_rest_still_run(tmp_path):
    args = argparse.Namespace(
        quick=True,
        suite="planner",
        steps=None,
        warmup=None,
        backend=None,
        method_timeout=0.01,
        out=tmp_path,
        dtype="fp32",
        device=None,
        no_progress=True,
        profile=False,
    )
    bench = _Bench(args)
    bench.logs.mkdir()
    phase = _WorkerSettings(steps=1, warmup=1, name="run")
    with tqdm(disable=True) as bar:
        results = bench.run_workload("mlp", ["eager", "checkpoint"], phase, bar)
    assert [(r["method"], r["status"]) for r in results] == [
        ("eager", "failed"),
        ("checkpoint", "failed"),
    ]
    assert all(r["error"] == "timed out after 0.01 s" for r in results)


def test_time_limit_stops_a_busy_worker(tmp_path):
    args = argparse.Namespace(
        quick=True,
        suite="planner",
        steps=None,
        warmup=None,
        backend=None,
        method_timeout=None,
        out=tmp_path,
        dtype="fp32",
        device=None,
        no_progress=True,
        profile=False,
    )
    bench = _Bench(args)
    bench.logs.mkdir()
    phase = _WorkerSettings(steps=1, warmup=1, name="run", kill_at=time.time() + 0.01)
    with tqdm(disable=True) as bar:
        (result,) = bench.run_workload("mlp", ["eager"], phase, bar)
    assert (result["status"], result["error"]) == ("skipped", "stopped at the time limit")


@pytest.mark.slow
def test_explain_prints_json(capsys):
    assert cli.main(["explain", "mlp", "--quick", "--json", "--mode", "budget:0.5"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert isinstance(plan, dict) and plan


@pytest.mark.slow
def test_explain_prints_a_table(capsys):
    assert cli.main(["explain", "nmt-attention", "--quick"]) == 0
    assert capsys.readouterr().out.startswith("nmt-attention: ")


@pytest.mark.slow
def test_explain_lists_the_op_memory_of_swapped_rnns(capsys):
    assert cli.main(["explain", "lstm-lm-medium", "--quick", "--mgnn", "--mode", "off"]) == 0
    out = capsys.readouterr().out
    assert "mirrorgrad.nn RNNs" in out.splitlines()[0]
    assert "op memory:      rnn_forward (rnn): stash [off] (recompute: saved " in out


def test_explain_of_a_workload_whose_package_is_missing_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr(Workload, "missing_packages", lambda self: ["torchvision"])
    assert cli.main(["explain", "mlp", "--quick"]) == 2
    assert capsys.readouterr().err.strip() == (
        "mirrorgrad explain: error: mlp needs torchvision, not installed here: "
        "pip install torchvision"
    )


@pytest.mark.parametrize(
    ("text", "options"),
    [
        ("balance", {"mode": "balance"}),
        ("off", {"mode": "off"}),
        ("budget:0.5", {"mode": "budget", "budget": 0.5}),
        ("budget:2e9", {"mode": "budget", "budget": 2_000_000_000}),
    ],
)
def test_parse_mode(text, options):
    assert parse_mode(text) == options


@pytest.mark.parametrize(
    "text", ["budget", "budget:-1", "budget:x", "budget:inf", "balance:1", "fast"]
)
def test_parse_mode_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError, match="budget:FRACTION"):
        parse_mode(text)


def test_time_shares_pass_unused_time_on():
    assert _share(100.0, None, 3) is None
    assert _share(100.0, 190.0, 3) == 130.0
    # A workload that finished early leaves its time to the next ones.
    assert _share(110.0, 190.0, 2) == 150.0
    assert _share(200.0, 190.0, 1) == 200.0


_ENV = '"env": {}, "options": {"dtype": "fp32"}'
_OK = '"method": "eager", "status": "ok"'


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "No such file or directory"),
        ("not json", "is not JSON"),
        ("[1, 2]", "a JSON object at the top, not a list"),
        ('{"no": "workloads"}', "no 'workloads' object"),
        ('{"workloads": {"mlp": {}}, ' + _ENV + "}", "workload 'mlp' has no 'methods' list"),
        ('{"workloads": {"mlp": {"methods": [{}]}}, ' + _ENV + "}", "has no 'method', 'status'"),
        ('{"workloads": {"mlp": {"methods": [{' + _OK + "}]}}, " + _ENV + "}", "'median_ms'"),
        ('{"workloads": {}, "env": {}, "options": {}}', "no 'dtype' in 'options'"),
    ],
    ids=["missing", "text", "list", "object", "workload", "method", "measured", "options"],
)
def test_from_json_of_a_bad_file_is_one_line(tmp_path, capsys, content, says):
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content)
    assert cli.main(["bench", "--from-json", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mirrorgrad bench: --from-json: ") and "\n" not in err, err
    assert str(path) in err and says in err, err
    assert not list((tmp_path / "o").iterdir())  # nothing drawn


@pytest.mark.parametrize("option", ["--steps", "--warmup", "--jobs", "--limit"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_counts_below_one_are_rejected(tmp_path, capsys, option, value):
    argv = ["bench", "--quick", "--workloads", "mlp", option, value, "--out", str(tmp_path)]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.strip() == (
        f"mirrorgrad bench: {option} must be >= 1, got {value}"
    )


def test_an_unwritable_output_folder_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = blocker / "sub"
    for extra in ([], ["--from-json", str(tmp_path / "results.json")]):
        argv = ["bench", "--quick", "--workloads", "mlp", "--out", str(out), *extra]
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err == (
            f"mirrorgrad bench: --out {out}: cannot create or write there (Not a directory); "
            "pass a writable folder with --out"
        )


_NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")


@pytest.mark.parametrize(
    ("argument", "says"),
    [
        ("--time-limit=-1", "--time-limit must be a finite number > 0, got -1.0"),
        ("--method-timeout=inf", "--method-timeout must be a finite number > 0, got inf"),
        ("--workload-time=nan", "--workload-time must be a finite number > 0, got nan"),
        ("--precompile-jobs=-1", "--precompile-jobs must be >= 0, got -1"),
        ("--device=gpu", "--device 'gpu': choose cpu, cuda or cuda:N"),
        pytest.param("--device=cuda", "--device cuda: torch sees no CUDA GPU", marks=_NO_GPU),
    ],
)
def test_bench_refuses_bad_input_before_any_work(tmp_path, capsys, argument, says):
    out = tmp_path / "out"
    argv = ["bench", "--quick", "--workloads", "mlp", "--out", str(out), argument]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"mirrorgrad bench: {says}") and "\n" not in err, err
    assert not out.exists()


@pytest.mark.parametrize(
    ("argument", "says"),
    [
        ("--max-overhead=nan", "--max-overhead nan: a finite fraction of the step time >= 0"),
        ("--max-overhead=-1", "--max-overhead -1.0: a finite fraction of the step time >= 0"),
        ("--batch=-3", "--batch must be >= 1, got -3"),
        ("--batch=0", "--batch must be >= 1, got 0"),  # not the workload's default
        ("--device=tpu", "--device 'tpu': choose cpu, cuda or cuda:N"),
        pytest.param("--device=cuda", "--device cuda: torch sees no CUDA GPU", marks=_NO_GPU),
    ],
)
def test_explain_refuses_bad_input_before_any_work(capsys, monkeypatch, argument, says):
    def no_work(name):
        raise AssertionError("built a workload")

    monkeypatch.setattr(explain, "get_workload", no_work)
    assert cli.main(["explain", "mlp", "--quick", argument]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"mirrorgrad explain: error: {says}") and "\n" not in err, err


@pytest.mark.slow
def test_a_scripts_suite_runs_through_the_harness(tmp_path):
    # benchmarks/zoo_sweep.py registers its suite; its workers run the script again.
    out = tmp_path / "zoo"
    # The reference gradients go to the temp folder, which is removed at the end.
    temp = tmp_path / "temp"
    temp.mkdir()
    argv = [sys.executable, zoo_sweep.__file__, "--quick", "--workloads", "ours-m*", "--limit"]
    argv += ["1", "--out", str(out), "--steps", "1", "--warmup", "1", "--no-progress"]
    done = subprocess.run(
        argv, env=os.environ | {"TMPDIR": str(temp)}, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads((out / "results.json").read_text())
    assert doc["suite"] == "zoo-sweep" and list(doc["workloads"]) == ["ours-mlp"]
    assert doc["command"].startswith("python benchmarks/zoo_sweep.py --workloads 'ours-m*'")
    methods = doc["workloads"]["ours-mlp"]["methods"]
    assert [m["method"] for m in methods] == list(zoo_sweep.METHODS)
    assert all(m["status"] == "ok" for m in methods)
    assert all(m["grads_ok"] for m in methods if m["method"] != "compile")
    assert not list(out.rglob("*.pt")) and not list(temp.iterdir())
    assert "Model x mode results: 5 ok." in (out / "results.md").read_text()


def test_list_names_every_suite(capsys):
    assert cli.main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    for suite in ("planner:", "rnn-modules:", "word-lm:"):
        assert suite in out
