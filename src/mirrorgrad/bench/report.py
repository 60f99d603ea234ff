"""Ratios, markdown tables and PNG plots from a `mirrorgrad bench` results document.

The document (``results.json``) is ``{"env": ..., "options": ..., "workloads": {name:
{"description", "methods": [MethodResult dicts]}}}``; everything here reads only it,
so a report can be redrawn from a saved file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mirrorgrad._units import format_bytes
from mirrorgrad.bench import suite_tables
from mirrorgrad.bench.suite_tables import x_ratio

MIB = 2**20
# Ratios are taken against these methods, measured in the same process run (a suite
# may name its own).
BASELINES = ("eager", "compile")


def baselines_of(doc: dict[str, Any]) -> tuple[str, ...]:
    return tuple(doc.get("baselines") or BASELINES)


def add_ratios(methods: list[dict[str, Any]], baselines: tuple[str, ...] = BASELINES) -> None:
    """Set ``peak_vs_<base>`` and ``time_vs_<base>`` (medians) on each successful result,
    ``fastest_vs_<last base>`` (fastest steps: noise only slows steps down, so where a
    run was disturbed this is the better estimate of the cost), and ``est_vs_measured``
    where the planner estimated the peak."""
    by_name = {m["method"]: m for m in methods if m["status"] == "ok"}
    first = baselines[-1]
    first_steps = by_name.get(first, {}).get("step_ms")
    for m in by_name.values():
        if m.get("est_peak_bytes"):
            m["est_vs_measured"] = m["est_peak_bytes"] / m["peak_bytes"]
        for base_name in baselines:
            base = by_name.get(base_name)
            ok = base is not None and base["peak_bytes"] and base["median_ms"]
            m[f"peak_vs_{base_name}"] = m["peak_bytes"] / base["peak_bytes"] if ok else None
            m[f"time_vs_{base_name}"] = m["median_ms"] / base["median_ms"] if ok else None
        steps = m.get("step_ms")
        m[f"fastest_vs_{first}"] = min(steps) / min(first_steps) if steps and first_steps else None


def _num(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def _mib(value: int | None) -> str:
    return format_bytes(value, "MiB")


def _compile_time(m: dict[str, Any]) -> str:
    """Seconds of the first call beyond a step; "warm / cold" after --precompile-jobs."""
    if m.get("compile_s") is None:
        return "—"
    if m.get("cold_compile_s") is None:
        return _num(m["compile_s"], 1)
    return f"{m['compile_s']:.1f} / {m['cold_compile_s']:.1f}"


def _peak_share(m: dict[str, Any], doc: dict[str, Any]) -> str:
    peaks = doc["env"].get("peak_tflops") or {}
    peak = peaks.get(doc["options"]["dtype"])
    return "—" if not (peak and m.get("tflops")) else f"{100 * m['tflops'] / peak:.1f}%"


def _grads(m: dict[str, Any]) -> str:
    if m.get("grad_error") is None:
        return "ref." if m.get("grad_note") is None and m.get("grads_ok") is None else "—"
    return f"{m['grad_error']:.1e}" + ("" if m.get("grads_ok") else " WRONG")


def _columns(methods: list[dict[str, Any]], doc: dict[str, Any]) -> list[tuple[str, Any]]:
    """(header, cell of a result) for the columns the results have something in."""
    cols: list[tuple[str, Any]] = [
        ("median ms", lambda m: _num(m["median_ms"], 2)),
        ("p20 / p80 ms", lambda m: f"{_num(m['p20_ms'], 2)} / {_num(m['p80_ms'], 2)}"),
        ("peak MiB", lambda m: _mib(m["peak_bytes"])),
    ]
    if any(m.get("est_peak_bytes") for m in methods):
        cols.append(("est. peak MiB", lambda m: _mib(m.get("est_peak_bytes"))))
    for base in reversed(baselines_of(doc)):
        if not any(m.get(f"time_vs_{base}") for m in methods):
            continue
        cols.append((f"peak / {base}", lambda m, b=base: x_ratio(m.get(f"peak_vs_{b}"))))
        cols.append((f"time / {base}", lambda m, b=base: x_ratio(m.get(f"time_vs_{b}"))))
        if any(m.get(f"fastest_vs_{base}") for m in methods):
            cols.append(
                (f"fastest step / {base}", lambda m, b=base: x_ratio(m.get(f"fastest_vs_{b}")))
            )
    if any(m.get("tokens_per_s") for m in methods):
        cols.append(("tokens/s", lambda m: _num(m.get("tokens_per_s"), 0)))
    else:
        cols.append(("samples/s", lambda m: _num(m["samples_per_s"], 0)))
    if any(m.get("tflops") for m in methods):
        cols.append(("TFLOP/s", lambda m: _num(m.get("tflops"), 2)))
        cols.append(("of peak", lambda m: _peak_share(m, doc)))
    if any(m.get("grad_error") is not None for m in methods):
        cols.append(("grad error", _grads))
    if any(m.get("compile_s") is not None for m in methods):
        cols.append(("compile s", _compile_time))
    return cols


def _notes(m: dict[str, Any]) -> list[str]:
    name = m["method"]
    if m["status"] != "ok":
        return [f"- `{name}` {m['status']}: {m['error']}"]
    notes = [f"- `{name}` fell back: {m['fallback']}"] if m.get("fallback") else []
    if m.get("budget_warning"):
        notes.append(f"- `{name}` budget not met: {m['budget_warning']}")
    target = m.get("balance_target")
    if target:
        why = target.get("reason") or f"not worked out ({target.get('error')})"
        notes.append(f"- `{name}`, balance's target (estimated): {why}")
    if m.get("est_error"):
        notes.append(f"- `{name}`: no planner estimate ({m['est_error']})")
    elif m.get("est_graphs", 0) > 1:
        notes.append(
            f"- `{name}`: graph breaks; the estimate is the largest of "
            f"{m['est_graphs']} compiled graphs' peaks, not the step's"
        )
    return notes


def workload_table(name: str, workload: dict[str, Any], doc: dict[str, Any]) -> str:
    methods = workload["methods"]
    batch = next((m["batch"] for m in methods if m.get("batch")), None)
    ok = [m for m in methods if m["status"] == "ok"]
    cols = _columns(ok, doc)
    lines = [
        f"### {name}",
        "",
        f"{workload['description']}; batch {batch}.",
        "",
        "| method | " + " | ".join(header for header, _ in cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    notes = []
    for m in methods:
        if m["status"] != "ok":
            lines.append(f"| {m['method']} | {m['status']} |" + " — |" * (len(cols) - 1))
        else:
            lines.append(f"| {m['method']} | " + " | ".join(cell(m) for _, cell in cols) + " |")
        notes += _notes(m)
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)


def markdown(doc: dict[str, Any], lead: str = "", lead_only: bool = False) -> str:
    """The header, the suite's ``lead`` table, and (unless ``lead_only``) a table per
    workload."""
    env, options = doc["env"], doc["options"]
    device = env.get("gpu") or "CPU"
    header = [
        "## mirrorgrad bench",
        "",
        f"Device: {device}; torch {env.get('torch')}, CUDA {env.get('cuda')}, "
        f"Triton {env.get('triton')}; commit {doc.get('git_commit')}.",
        f"dtype {options['dtype']}, {options['warmup']} warm-up + {options['steps']} timed "
        f"steps per method, backend {options['backend']}"
        + f". Peak memory: {_peak_source(doc)}."
        + (
            f" compile s: warm / cold; the cold compiles ran {options['precompile_jobs']} at a "
            "time to warm Inductor's caches before the timed runs."
            if options.get("precompile_jobs")
            else ""
        ),
        "",
        f"Command: `{doc['command']}`",
        *_incomplete(doc),
    ]
    tables = [] if lead_only else [workload_table(n, w, doc) for n, w in doc["workloads"].items()]
    return "\n\n".join(t for t in ["\n".join(header), lead, *tables] if t) + "\n"


def _incomplete(doc: dict[str, Any]) -> list[str]:
    """A line saying the run did not finish, if so ("complete" is absent in older files)."""
    if doc.get("complete", True):
        return []
    methods = [m for w in doc["workloads"].values() for m in w["methods"]]
    done = sum(m["status"] != "not run" for m in methods)
    how = (
        f"stopped by {doc['stopped']}"
        if doc.get("stopped")
        else "written while the run went on; if it is over, it was killed"
    )
    return ["", f"**Incomplete run** ({how}): {done} of {len(methods)} methods finished."]


def _peak_source(doc: dict[str, Any]) -> str:
    sources = {
        m.get("peak_source")
        for w in doc["workloads"].values()
        for m in w["methods"]
        if m.get("peak_source")
    }
    if sources == {"cuda"}:
        return (
            "torch.cuda.max_memory_allocated over the warm-ups after the compiling call "
            "and the timed steps (fwd+bwd+SGD; a CUDA Graph method's recording included)"
        )
    return "CPU estimate (parameters + gradients + tensors saved for backward)"


def summary(doc: dict[str, Any]) -> str:
    """One line per workload: the lowest peak and the fastest step, against compile."""
    lines = []
    for name, w in doc["workloads"].items():
        ok = [m for m in w["methods"] if m["status"] == "ok"]
        failed = len(w["methods"]) - len(ok)
        if not ok:
            lines.append(f"{name}: no method succeeded")
            continue
        low = min(ok, key=lambda m: m["peak_bytes"])
        fast = min(ok, key=lambda m: m["median_ms"])
        lines.append(
            f"{name}: lowest peak {low['method']} {_mib(low['peak_bytes'])} MiB "
            f"({x_ratio(low.get('peak_vs_compile'))} of compile); fastest {fast['method']} "
            f"{_num(fast['median_ms'], 2)} ms ({x_ratio(fast.get('time_vs_compile'))} of compile)"
            + (f"; {failed} not measured" if failed else "")
        )
    return "\n".join(lines)


# More workloads than this: one scatter of ratios instead of a panel per workload.
_MAX_PANELS = 12


def _ratio_plot(doc: dict[str, Any], measured: dict[str, list], out_dir: Path, plt: Any) -> Path:
    """``ratios.png``: every method's peak against its time, both over the last baseline's,
    one point per workload."""
    base = baselines_of(doc)[-1]
    fig, ax = plt.subplots(figsize=(8, 6))
    methods = dict.fromkeys(m["method"] for ms in measured.values() for m in ms)
    for method in methods:
        points = [
            (m[f"time_vs_{base}"], m[f"peak_vs_{base}"])
            for ms in measured.values()
            for m in ms
            if m["method"] == method and m.get(f"time_vs_{base}") and m["method"] != base
        ]
        if points:
            ax.scatter(*zip(*points), s=18, label=method, alpha=0.7)
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.axvline(1.0, color="grey", lw=0.5)
    ax.set_xlabel(f"step time / {base}")
    ax.set_ylabel(f"peak memory / {base}")
    ax.set_title(f"{len(measured)} workloads on {doc['env'].get('gpu') or 'CPU'}", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    return _save(fig, out_dir / "ratios.png", plt)


def _frontiers(methods: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The budget families a panel joins by a line, from fraction 1 down: min-cut
    (`compile`, then `compile-budget-F`) and ours (`mirror-budget-F`); two points each
    at least."""
    by_name = {m["method"]: m for m in methods}
    first = [by_name["compile"]] if "compile" in by_name else []
    budgets = suite_tables.budgets
    lines = {
        "torch.compile, activation_memory_budget": [
            *first, *budgets(by_name, "compile-budget-").values()
        ],
        "mirrorgrad budget": list(budgets(by_name, "mirror-budget-").values()),
    }
    return {label: ms for label, ms in lines.items() if len(ms) >= 2}


def plots(doc: dict[str, Any], out_dir: Path) -> list[Path]:
    """``peak_vs_time.png``: peak memory against step time, one panel per workload, one
    labelled point per method, and lines through the budget fractions of min-cut and of
    ours (the frontiers); ``ratios.png`` with more than a dozen workloads."""
    plt = _pyplot()
    written = []
    device = doc["env"].get("gpu") or "CPU"
    measured = {
        name: [m for m in w["methods"] if m["status"] == "ok"]
        for name, w in doc["workloads"].items()
    }
    measured = {name: ms for name, ms in measured.items() if ms}
    if len(measured) > _MAX_PANELS:
        written.append(_ratio_plot(doc, measured, out_dir, plt))
    elif measured:
        cols = min(3, len(measured))
        rows = -(-len(measured) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.5 * rows), squeeze=False)
        for ax in axes.flat[len(measured) :]:
            ax.set_visible(False)
        for ax, (name, ms) in zip(axes.flat, measured.items()):
            frontiers = _frontiers(ms)
            for label, family in frontiers.items():
                times = [m["median_ms"] for m in family]
                ax.plot(times, [m["peak_bytes"] / MIB for m in family], alpha=0.5, label=label)
            if frontiers:
                ax.legend(fontsize=7)
            for m in ms:
                x, y = m["median_ms"], m["peak_bytes"] / MIB
                ax.scatter([x], [y], s=30)
                ax.annotate(
                    m["method"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7
                )
            ax.set_xlabel("median step time (ms)")
            ax.set_ylabel("peak memory (MiB)")
            ax.set_title(name, fontsize=10)
            ax.grid(True, alpha=0.3)
        fig.suptitle(f"peak memory vs step time on {device} (lower left is better)")
        written.append(_save(fig, out_dir / "peak_vs_time.png", plt))
    return written


def module_files(doc: dict[str, Any], out_dir: Path) -> list[Path]:
    """The RNN module suite's ``module_table.csv`` (its table's numbers, one row per
    workload) and ``module_speedups.png`` (speedup over graphed cuDNN per shape, a
    panel per mode)."""
    import csv

    rows = suite_tables.module_rows(doc)
    if not rows:
        return []
    path = out_dir / "module_table.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: " ".join(v) if isinstance(v, list | dict) else v
                             for k, v in row.items()})  # fmt: skip
    return [path, _module_plot(doc, rows, out_dir)]


def _module_plot(doc: dict[str, Any], rows: list[dict[str, Any]], out_dir: Path) -> Path:
    plt = _pyplot()
    series = [h for h, _ in suite_tables.MODULE_COLUMNS if h != "cuDNN graphed"]
    series.append("best fixed graphed")
    modes = list(dict.fromkeys(r["workload"].split("-")[1] for r in rows))
    fig, axes = plt.subplots(len(modes), 1, figsize=(11, 3.2 * len(modes)), squeeze=False)
    width = 0.8 / len(series)
    for ax, mode in zip(axes[:, 0], modes):
        mine = [r for r in rows if r["workload"].split("-")[1] == mode]
        for i, name in enumerate(series):
            xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(mine))]
            ax.bar(xs, [r[f"{name} speedup"] or 0.0 for r in mine], width, label=name)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(range(len(mine)))
        ax.set_xticklabels([r["workload"].split("-", 2)[2] for r in mine], fontsize=7)
        ax.set_ylabel("speedup over\ngraphed cuDNN")
        ax.set_title(mode, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0, 0].legend(fontsize=7, ncol=len(series))
    device = doc["env"].get("gpu") or "CPU"
    fig.suptitle(f"RNN modules on {device}, {doc['options']['dtype']} (above 1: faster)")
    return _save(fig, out_dir / "module_speedups.png", plt)


def _pyplot() -> Any:
    """matplotlib's pyplot, drawing to files (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
