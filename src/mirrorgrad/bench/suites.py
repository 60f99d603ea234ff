"""Named suites of `mirrorgrad bench`: which workloads, which methods; the one registry.

Every suite runs through the same harness (runner, command, report): ``planner`` is the
recompute planner against PyTorch's options; ``rnn-modules`` the recurrent layers alone,
cuDNN against mirrorgrad.nn, plain and in one CUDA Graph; ``word-lm`` PyTorch's
word_language_model step against `mirrorgrad train lm`'s. Two tables are scripts of
their own, not harness suites: the LM-step table (the step as users run each option,
``python -m mirrorgrad.bench.lm_step``) and the planner frontier (our plans against
min-cut's on the joint graph, no training step: ``python -m mirrorgrad.bench.frontier``).
Studies in the repository's ``benchmarks/`` folder add their own suites with `register`
and run them through the same harness.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mirrorgrad.bench import report, rnn_modules, suite_tables, word_lm, workloads
from mirrorgrad.bench.methods import BASE_METHODS, Method, default_methods
from mirrorgrad.bench.workloads import Workload

Doc = dict[str, Any]


@dataclass(kw_only=True, slots=True, frozen=True)
class Suite:
    name: str
    description: str
    workloads: dict[str, Workload]
    # None: the planner's methods for each workload (recurrent ones get `+mgnn` twins).
    methods: tuple[str, ...] | None = None
    # Ratios are taken against these methods (the last one in plots and CSV).
    baselines: tuple[str, ...] = report.BASELINES
    # The table the report leads with; with ``table_only`` the only one (no table per
    # workload: results.json has every number).
    table: Callable[[Doc], str] | None = None
    table_only: bool = False
    # (results document, folder) -> the suite's own files beside results.json (CSV, plots).
    files: Callable[[Doc, Path], list[Path]] | None = None
    # The script that registered the suite: its workers run it with `--worker` first.
    script: Path | None = None

    def methods_for(self, workload: Workload) -> list[str]:
        if self.methods is None:
            return default_methods(workload.recurrent)
        return list(self.methods)

    def workload_names(self, quick: bool) -> list[str]:
        """All of the suite's workloads; with ``quick`` its CPU slice."""
        return [name for name, w in self.workloads.items() if w.cpu_slice or not quick]

    def worker_command(self) -> list[str]:
        """The worker process's command line before its arguments (`runner.main`'s)."""
        if self.script is None:
            return ["-m", "mirrorgrad.bench.runner"]
        return [str(self.script), "--worker"]


SUITES: dict[str, Suite] = {}
WORKLOADS: dict[str, Workload] = {}
METHODS: dict[str, Method] = dict(BASE_METHODS)


def register(suite: Suite, methods: list[Method] = ()) -> None:
    """Add ``suite`` and the methods only it uses to the registry: names must be new,
    but a suite may share workloads with another (the same objects)."""
    taken = [suite.name] if suite.name in SUITES else []
    taken += [n for n, w in suite.workloads.items() if WORKLOADS.get(n, w) is not w]
    taken += [m.name for m in methods if m.name in METHODS]
    if taken:
        raise ValueError(f"suite {suite.name!r}: names already registered: {', '.join(taken)}")
    SUITES[suite.name] = suite
    WORKLOADS.update(suite.workloads)
    METHODS.update({m.name: m for m in methods})


register(
    Suite(
        name="planner",
        description="the recompute planner against torch.compile, its budgets, checkpoint",
        workloads=workloads.WORKLOADS,
        table=suite_tables.frontier_table,
    )
)
register(
    Suite(
        name="rnn-modules",
        description="LSTM/GRU/RNN stacks: torch.nn (cuDNN) and mirrorgrad.nn, plain and graphed",
        workloads=rnn_modules.WORKLOADS,
        methods=rnn_modules.METHODS,
        baselines=("eager", "cuda-graph"),
        table=suite_tables.module_table,
        table_only=True,
        files=report.module_files,
    ),
    rnn_modules.module_methods(),
)
register(
    Suite(
        name="word-lm",
        description="PyTorch's word_language_model step against mirrorgrad train lm's",
        workloads=word_lm.WORKLOADS,
        methods=word_lm.METHODS,
        baselines=("pytorch-example",),
        table=suite_tables.word_lm_table,
    ),
    word_lm.methods(),
)


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise KeyError(f"unknown method {name!r}; choose from {', '.join(METHODS)}") from None


def suite_of(workload: str) -> Suite:
    return next(s for s in SUITES.values() if workload in s.workloads)


def get_workload(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise KeyError(
            f"unknown workload {name!r}; see `mirrorgrad bench --list` for the names"
        ) from None
