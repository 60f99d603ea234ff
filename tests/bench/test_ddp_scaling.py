"""benchmarks/ddp_scaling.py's own logic (the GPU runs themselves need 2 GPUs)."""

import subprocess
import sys

from benchmarks import ddp_scaling
from tests.child import read_line


def _run(name, gpus, first, tokens, peak):
    return {
        "run": name, "gpus": gpus, "status": "ok", "wall_s": 1.0, "first_step_s": first,
        "tokens_per_s_median": tokens, "peak_mib_per_gpu": peak,
    }  # fmt: skip


def test_table_gives_each_run_as_a_ratio_to_one_gpu():
    result = {
        "corpus": "synthetic",
        "steps": 10,
        "probe": {"status": "ok", "allreduce_ms": 0.3, "megabytes": 79.1},
        "runs": [
            _run("1 GPU", 1, 10.0, 100_000, 300.0),
            _run("allreduce", 2, 15.0, 190_000, 309.0),
            {"run": "ddp", "gpus": 2, "status": "skipped (time limit)"},
        ],
    }
    lines = ddp_scaling._table(result).splitlines()
    row = next(line for line in lines if line.startswith("| allreduce"))
    assert "| 15.0 | 1.50 | 190,000 | 1.90 | 309 | 1.03 |" in row
    assert any(line.startswith("| ddp |") and "skipped" in line for line in lines)


def test_descendants_finds_a_grandchild():
    # The child prints once it has started the grandchild: no polling against the clock.
    script = (
        "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
        "'import time; time.sleep(300)']); print('started', flush=True); time.sleep(300)"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert read_line(parent.stdout) == "started\n"
        assert len(ddp_scaling._descendants(parent.pid)) == 1
    finally:
        for pid in ddp_scaling._descendants(parent.pid):
            subprocess.run(["kill", str(pid)], check=False)
        parent.kill()
        parent.wait()
