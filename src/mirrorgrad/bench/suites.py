"""Named suites of `mirrorgrad bench`: which workloads, which methods; the one registry.

Every suite runs through the same harness (runner, command, report): ``planner`` is the
recompute planner against PyTorch's options; ``rnn-kernels`` the recurrent layers alone,
module and kernel level; ``zoo-sweep`` public model families through every planner mode;
``word-lm`` PyTorch's word_language_model step against `mirrorgrad train lm`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from mirrorgrad.bench import rnn_kernels, word_lm, workloads, zoo
from mirrorgrad.bench.methods import BASE_METHODS, Method, default_methods
from mirrorgrad.bench.workloads import Workload


@dataclass(kw_only=True, slots=True, frozen=True)
class Suite:
    name: str
    description: str
    workloads: dict[str, Workload]
    # None: the planner's methods for each workload (recurrent ones get `+mgnn` twins).
    methods: tuple[str, ...] | None = None

    def methods_for(self, workload: Workload) -> list[str]:
        if self.methods is None:
            return default_methods(workload.recurrent)
        return list(self.methods)

    def workload_names(self, quick: bool) -> list[str]:
        """All of the suite's workloads; with ``quick`` its CPU slice."""
        return [name for name, w in self.workloads.items() if w.cpu_slice or not quick]


SUITES: dict[str, Suite] = {
    s.name: s
    for s in (
        Suite(
            name="planner",
            description="the recompute planner against torch.compile, its budgets, checkpoint",
            workloads=workloads.WORKLOADS,
        ),
        Suite(
            name="rnn-kernels",
            description="LSTM/GRU/RNN stacks: torch.nn (cuDNN), graphed, mirrorgrad.nn, kernels",
            workloads=rnn_kernels.WORKLOADS,
            methods=rnn_kernels.METHODS,
        ),
        Suite(
            name="zoo-sweep",
            description="public model families: eager, torch.compile and every planner mode",
            workloads=zoo.WORKLOADS,
            methods=zoo.METHODS,
        ),
        Suite(
            name="word-lm",
            description="PyTorch's word_language_model step against mirrorgrad train lm's",
            workloads=word_lm.WORKLOADS,
            methods=word_lm.METHODS,
        ),
    )
}
WORKLOADS: dict[str, Workload] = {n: w for s in SUITES.values() for n, w in s.workloads.items()}


METHODS: dict[str, Method] = {
    **BASE_METHODS,
    **{m.name: m for m in (*rnn_kernels.kernel_methods(), *word_lm.methods())},
}


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
