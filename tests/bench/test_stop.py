"""A `mirrorgrad bench` run stopped midway leaves the results measured so far."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from tests.child import TIMEOUT_S

from mirrorgrad.bench import command

METHODS = ["eager", "compile-budget-0.5", "mirror-balance"]

# `mirrorgrad bench` whose workers hold in the last method until they are killed, so the
# signal lands at a known point: eager measured and reported, mirror-balance not.
_WORKER_HOLDING_THE_LAST_METHOD = """
import sys, time
from mirrorgrad.bench import methods, runner

real_prepare = methods.Method.prepare

def prepare(self, model, **kwargs):
    if self.name == "mirror-balance":
        print("holding", file=sys.stderr, flush=True)  # into the workload's log
        time.sleep(600)
    return real_prepare(self, model, **kwargs)

methods.Method.prepare = prepare
sys.exit(runner.main(sys.argv[1:]))
"""
_BENCH = """
import sys
from mirrorgrad import cli
from mirrorgrad.bench import command

real_cmd = command._Bench.worker_cmd

def worker_cmd(self, *args, **kwargs):
    cmd = real_cmd(self, *args, **kwargs)
    assert cmd[1:3] == ["-m", "mirrorgrad.bench.runner"], cmd
    return [cmd[0], "-c", sys.argv[1], *cmd[3:]]

command._Bench.worker_cmd = worker_cmd
sys.exit(cli.main(sys.argv[2:]))
"""


def _holding(out):
    log = out / "logs" / "mlp.run.log"
    return log.is_file() and "holding" in log.read_text()


def _eager_reported(out):
    try:
        doc = json.loads((out / "results.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return doc["workloads"]["mlp"]["methods"][0]["status"] == "ok"


@pytest.mark.slow
def test_sigterm_after_the_first_method_keeps_its_results(tmp_path):
    out = tmp_path / "out"
    argv = [sys.executable, "-c", _BENCH, _WORKER_HOLDING_THE_LAST_METHOD, "bench", "--quick"]
    argv += ["--workloads", "mlp", "--methods", *METHODS, "--out", str(out), "--no-progress"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Markers the processes write, not a sleep: the worker holds in mirror-balance
        # and the parent has written eager's result.
        give_up = time.monotonic() + TIMEOUT_S
        while not (_holding(out) and _eager_reported(out)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < give_up, f"no markers in {TIMEOUT_S:g} s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=TIMEOUT_S)
    finally:
        proc.kill()
    assert proc.returncode == 143, stderr
    assert "mirrorgrad bench: stopped by SIGTERM;" in stderr.strip().splitlines()[-1]
    doc = json.loads((out / "results.json").read_text())
    assert doc["complete"] is False and doc["stopped"] == "SIGTERM"
    methods = doc["workloads"]["mlp"]["methods"]
    assert [m["method"] for m in methods] == METHODS
    eager = methods[0]
    assert eager["status"] == "ok" and eager["median_ms"] > 0 and eager["peak_bytes"] > 0
    # compile-budget-0.5 finished before the hold; its result may not have been read yet.
    not_run = [m for m in methods if m["status"] != "ok"]
    assert methods[-1] in not_run
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
