"""``torch.compile(model, backend="mirrorgrad", options={...})`` from a fresh interpreter.

The name comes from the ``torch_dynamo_backends`` entry point of the installed package
(``pip install -e .`` in CI); the subprocess never imports mirrorgrad itself."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib import metadata

import pytest
import torch

from mirrorgrad import compiler
from mirrorgrad.cli import main


def _entry_point_installed() -> bool:
    group = metadata.entry_points(group="torch_dynamo_backends")
    return any(ep.name == "mirrorgrad" for ep in group)


needs_entry_point = pytest.mark.skipif(
    not _entry_point_installed(),
    reason="the installed mirrorgrad has no torch_dynamo_backends entry point: "
    "run `pip install -e .` with this pyproject.toml",
)

SCRIPT = textwrap.dedent(
    """
    import copy, sys, torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
        torch.nn.Linear(32, 4),
    ).double()
    reference = copy.deepcopy(model)
    x = torch.randn(16, 8, dtype=torch.float64)
    assert "mirrorgrad" not in sys.modules, "imported before torch.compile"
    compiled = torch.compile(model, backend="mirrorgrad", options=OPTIONS)
    try:
        compiled(x).pow(2).mean().backward()
    except Exception as e:
        print("ERROR", type(e).__name__, e)
        sys.exit(3)
    reference(x).pow(2).mean().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12)
    print("OK", "mirrorgrad" in sys.modules)
    """
)


def _run(options: dict) -> subprocess.CompletedProcess:
    code = SCRIPT.replace("OPTIONS", repr(options))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)


@needs_entry_point
@pytest.mark.slow
def test_backend_by_name_in_a_fresh_interpreter():
    done = _run({"mode": "budget", "budget": 0.5})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK True" in done.stdout  # loaded through the entry point


@needs_entry_point
@pytest.mark.slow
def test_backend_by_name_validates_its_options():
    done = _run({"mode": "balance", "budget": 0.5})
    assert done.returncode == 3, done.stdout + done.stderr
    assert "only used by mode='budget'" in done.stdout


@pytest.mark.slow
def test_registered_backend_plans_and_passes_inductor_settings(monkeypatch):
    seen = []
    def record(self, plan, *_):
        seen.append((self, plan))

    monkeypatch.setattr(compiler.MirrorBackend, "_record", record)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    compiled = torch.compile(
        model,
        backend=compiler.registered_backend,
        options={"mode": "budget", "budget": "1KiB", "max_overhead": 0.2},
    )
    compiled(torch.randn(3, 4)).sum().backward()
    (backend, plan), *_ = seen
    assert backend.options.budget == 1024 and backend.options.max_overhead == 0.2
    assert plan.mode == "budget" and plan.budget_bytes == 1024


def test_registered_backend_rejects_unknown_options():
    match = r"unknown option\(s\) 'bugdet'.*budget, fuse_loss, max_overhead, mode"
    with pytest.raises(ValueError, match=match):
        compiler.registered_backend(None, [], options={"mode": "budget", "bugdet": 0.5})


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"mirrorgrad {metadata.version('mirrorgrad')}"
