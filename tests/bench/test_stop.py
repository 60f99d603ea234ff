"""A `mirrorgrad bench` run stopped midway leaves the results measured so far."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mirrorgrad.bench import command

# eager is quick; the compiling methods after it take seconds on the CPU.
METHODS = ["eager", "compile-budget-0.5", "mirror-balance"]


def _finished(out):
    try:
        doc = json.loads((out / "results.json").read_text())
    except (OSError, json.JSONDecodeError):
        return []
    return [m for m in doc["workloads"]["mlp"]["methods"] if m["status"] == "ok"]


def test_sigterm_after_the_first_method_keeps_its_results(tmp_path):
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "mirrorgrad", "bench", "--quick", "--workloads", "mlp"]
    argv += ["--methods", *METHODS, "--out", str(out), "--no-progress"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        give_up = time.time() + 90
        while not _finished(out) and proc.poll() is None and time.time() < give_up:
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, stderr
    assert "mirrorgrad bench: stopped by SIGTERM;" in stderr.strip().splitlines()[-1]
    doc = json.loads((out / "results.json").read_text())
    assert doc["complete"] is False and doc["stopped"] == "SIGTERM"
    methods = doc["workloads"]["mlp"]["methods"]
    assert [m["method"] for m in methods] == METHODS
    eager = methods[0]
    assert eager["status"] == "ok" and eager["median_ms"] > 0 and eager["peak_bytes"] > 0
    not_run = [m for m in methods if m["status"] != "ok"]
    assert not_run, "every method finished before the signal: the test proves nothing"
    for m in not_run:
        assert (m["status"], m["error"]) == ("not run", "stopped before this method")
    table = (out / "results.md").read_text()
    assert f"**Incomplete run** (stopped by SIGTERM): {3 - len(not_run)} of 3" in table
    assert "| eager | " in table and "`mirror-balance` not run" in table
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


def test_results_are_replaced_atomically(tmp_path, monkeypatch):
    path = tmp_path / "results.json"
    command._write_atomic(path, "old")
    assert path.read_text() == "old"

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        command._write_atomic(path, "new")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]
