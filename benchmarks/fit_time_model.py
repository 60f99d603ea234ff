"""Fit the constants of impl="auto"'s cost rule (mirrorgrad/ops/rnn/time_model.py) to
measured tables: its COSTS, RECOMPUTE_EXTRA and FORWARD_SHARE.

    python benchmarks/fit_time_model.py RESULTS.json ...

prints the COSTS entries fitted to `python benchmarks/rnn_kernels.py` results (the
module methods ``mgnn-<impl>``); ``fit_extra(timing_extra_samples(rows))`` and
``timing_forward_share(rows)`` give the other two from benchmarks/op_memory_timing.py's
rows. tests/ops/test_rnn_time_model.py checks the committed constants against these fits.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path

from mirrorgrad.ops.rnn.time_model import Shape, memory_class


def fit(samples: Iterable[tuple[Shape, float]]) -> tuple[float, ...]:
    """Constants (>= 0) minimising the squared relative error of the rule over measured
    (shape, ms) samples."""
    import numpy as np

    samples = list(samples)
    features = np.array([s.features() for s, _ in samples])
    measured = np.array([ms for _, ms in samples])
    return _nonnegative_lstsq(features / measured[:, None], np.ones(len(samples)))


def _nonnegative_lstsq(a, b) -> tuple[float, ...]:
    """Least squares of ``a @ c = b`` with negative constants dropped one at a time."""
    import numpy as np

    active = list(range(a.shape[1]))
    while True:
        constants = np.zeros(a.shape[1])
        constants[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
        if (constants >= 0).all():
            return tuple(round(float(c), 3) for c in constants)
        active.remove(int(np.argmin(constants)))


def fit_extra(samples: Iterable[tuple[Shape, float]]) -> tuple[float, ...]:
    """Constants (>= 0) minimising the squared error (in ms, not relative: the measured
    differences come near zero) of RECOMPUTE_EXTRA's sum over (shape, recompute - stash ms).
    Never below zero: where recompute measured faster the rule says it costs nothing."""
    import numpy as np

    samples = list(samples)
    features = np.array([s.features() for s, _ in samples])
    return _nonnegative_lstsq(features, np.array([ms for _, ms in samples]))


def timing_shape(row: dict) -> Shape:
    """The Shape of a ``benchmarks/op_memory_timing.py`` row (older files: 2-layer LSTMs, T 35)."""
    return Shape(mode=row.get("mode", "lstm"), T=row.get("T", 35), B=row["batch"],
                 H=row["hidden"], layers=row["layers"],
                 directions=row.get("directions", 1))  # fmt: skip


def _step_ms(times: dict) -> float:
    return times.get("step_ms", times["forward_ms"] + times["backward_ms"])


def timing_extra_samples(rows: Iterable[dict]) -> list[tuple[Shape, float]]:
    """(shape, what recompute added to the op's forward+backward, ms) of each LSTM or GRU
    row of ``benchmarks/op_memory_timing.py`` results: the samples RECOMPUTE_EXTRA is fitted to.
    The whole step, not its backward alone: the rule prices both modes' forwards alike."""
    return [
        (shape, _step_ms(row["recompute"]) - _step_ms(row["stash"]))
        for row in rows
        if (shape := timing_shape(row)).mode in ("lstm", "gru")
    ]


def timing_forward_share(rows: Iterable[dict]) -> float:
    """The mean share of the forward in forward+backward with memory="stash"."""
    shares = [row["stash"]["forward_ms"] / _step_ms(row["stash"]) for row in rows]
    return sum(shares) / len(shares)


def shape_of(workload: str) -> Shape:
    """The Shape of an rnn-kernels workload, rnn-<mode>-L<l>-I<i>-H<h>-B<b>-T<t>[-bi]."""
    parts = workload.split("-")
    sizes = {p[0]: int(p[1:]) for p in parts[2:] if p[:1] in "LIHBT" and p[1:].isdigit()}
    return Shape(mode=parts[1], T=sizes["T"], B=sizes["B"], H=sizes["H"], layers=sizes["L"],
                 directions=2 if parts[-1] == "bi" else 1)  # fmt: skip


def fit_results(docs: Iterable[dict]) -> dict[tuple[str, str, str], tuple[float, ...]]:
    """COSTS entries fitted to rnn-kernels results: one per module method ``mgnn-<impl>``
    (memory: the module's default, or stash for ``-stash``), mode-independent as COSTS."""
    samples: dict[tuple[str, str, str], list[tuple[Shape, float]]] = {}
    for doc in docs:
        dtype = "fp32" if doc["options"]["dtype"] == "fp32" else "half"
        for name, workload in doc["workloads"].items():
            shape = shape_of(name)
            for m in workload["methods"]:
                if m["status"] != "ok" or not m["method"].startswith("mgnn-"):
                    continue
                impl, _, memory = m["method"][5:].partition("-")
                memory = memory or ("recompute" if shape.mode == "lstm" else "stash")
                key = (impl, memory_class(impl, memory), dtype)
                samples.setdefault(key, []).append((shape, m["median_ms"]))
    return {key: fit(rows) for key, rows in samples.items() if len(rows) >= 4}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path, help="rnn_kernels results.json files")
    args = parser.parse_args(argv)
    fitted = fit_results(json.loads(path.read_text()) for path in args.results)
    for key, constants in sorted(fitted.items()):
        print(f"    {key}: {constants},")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
