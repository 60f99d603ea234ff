"""``mirrorgrad.compile`` on an FSDP2 ``fully_shard`` transformer over 2 processes: the
gathered gradients equal those of the same sharded model without mirrorgrad.

Runs ``fsdp2_check.py`` (the script the README shows) under ``torchrun``: with gloo on
the CPU (tiny sizes, mirrorgrad's eager codegen), and with NCCL on 2 GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

# Two processes each: under pytest-xdist, one such test at a time (a 2-core machine).
pytestmark = pytest.mark.xdist_group("two-processes")

SCRIPT = Path(__file__).with_name("fsdp2_check.py")
SRC = Path(__file__).parents[2] / "src"


def _torchrun(out: Path, *extra: str, timeout: int) -> dict:
    path = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", str(SCRIPT), str(out), *extra]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "fsdp2.json").read_text())


def _check(result: dict, tolerance: float, recomputes: bool = False) -> None:
    assert [r["rank"] for r in result["rows"]] == [0, 1]
    for row in result["rows"]:
        assert row["fallbacks"] == []
        assert row["plans"] >= 1  # one backend for all blocks: a plan per distinct graph
        assert row["grad_error"] <= tolerance, row
        assert row["recomputed"] > 0 or not recomputes, row


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs gloo")
def test_fsdp2_on_cpu_same_gradients(tmp_path):
    # Budget 0.5, so that the plan recomputes something at these tiny sizes.
    result = _torchrun(tmp_path, "--cpu", "--mode", "budget", "--budget", "0.5", timeout=300)
    _check(result, tolerance=1e-5, recomputes=True)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fsdp2_on_two_gpus_same_gradients(tmp_path):
    _check(_torchrun(tmp_path, timeout=600), tolerance=1e-3)
