"""Ratios, markdown tables and PNG plots from a `mirrorgrad bench` results document.

The document (``results.json``) is ``{"env": ..., "options": ..., "workloads": {name:
{"description", "methods": [MethodResult dicts]}}}``; everything here reads only it,
so a report can be redrawn from a saved file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mirrorgrad._units import format_bytes

MIB = 2**20
# Ratios are taken against these methods, measured in the same process run.
BASELINES = ("eager", "compile")


def add_ratios(methods: list[dict[str, Any]]) -> None:
    """Set ``peak_vs_<base>`` and ``time_vs_<base>`` (medians) on each successful result,
    ``fastest_vs_compile`` (fastest steps: noise only slows steps down, so where a run was
    disturbed this is the better estimate of the cost), and ``est_vs_measured`` where the
    planner estimated the peak."""
    by_name = {m["method"]: m for m in methods if m["status"] == "ok"}
    compile_steps = by_name.get("compile", {}).get("step_ms")
    for m in by_name.values():
        if m.get("est_peak_bytes"):
            m["est_vs_measured"] = m["est_peak_bytes"] / m["peak_bytes"]
        for base_name in BASELINES:
            base = by_name.get(base_name)
            ok = base is not None and base["peak_bytes"] and base["median_ms"]
            m[f"peak_vs_{base_name}"] = m["peak_bytes"] / base["peak_bytes"] if ok else None
            m[f"time_vs_{base_name}"] = m["median_ms"] / base["median_ms"] if ok else None
        steps = m.get("step_ms")
        m["fastest_vs_compile"] = (
            min(steps) / min(compile_steps) if steps and compile_steps else None
        )


def _num(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def _mib(value: int | None) -> str:
    return format_bytes(value, "MiB")


def _max_batch(m: dict[str, Any]) -> str:
    search = m.get("max_batch")
    if not search:
        return "—"
    if search["largest_fit"] is None:
        return "none"
    return f"{search['largest_fit']}" if search["exact"] else f"≥{search['largest_fit']}"


def _compile_time(m: dict[str, Any]) -> str:
    """Seconds of the first call beyond a step; "warm / cold" after --precompile-jobs."""
    if m.get("compile_s") is None:
        return "—"
    if m.get("cold_compile_s") is None:
        return _num(m["compile_s"], 1)
    return f"{m['compile_s']:.1f} / {m['cold_compile_s']:.1f}"


_COLUMNS = (
    "method",
    "median ms",
    "p20 / p80 ms",
    "peak MiB",
    "est. peak MiB",
    "peak / compile",
    "time / compile",
    "fastest step / compile",
    "peak / eager",
    "time / eager",
    "samples/s",
    "compile s",
    "max batch",
)


def workload_table(name: str, workload: dict[str, Any]) -> str:
    methods = workload["methods"]
    batch = next((m["batch"] for m in methods if m.get("batch")), None)
    lines = [
        f"### {name}",
        "",
        f"{workload['description']}; batch {batch}.",
        "",
        "| " + " | ".join(_COLUMNS) + " |",
        "|" + "|".join("---" if c == "method" else "---:" for c in _COLUMNS) + "|",
    ]
    notes = []
    for m in methods:
        if m["status"] != "ok":
            lines.append(f"| {m['method']} | {m['status']} |" + " — |" * (len(_COLUMNS) - 2))
            notes.append(f"- `{m['method']}` {m['status']}: {m['error']}")
            continue
        cells = [
            m["method"],
            _num(m["median_ms"], 2),
            f"{_num(m['p20_ms'], 2)} / {_num(m['p80_ms'], 2)}",
            _mib(m["peak_bytes"]),
            _mib(m.get("est_peak_bytes")),
            _ratio(m.get("peak_vs_compile")),
            _ratio(m.get("time_vs_compile")),
            _ratio(m.get("fastest_vs_compile")),
            _ratio(m.get("peak_vs_eager")),
            _ratio(m.get("time_vs_eager")),
            _num(m["samples_per_s"], 0),
            _compile_time(m),
            _max_batch(m),
        ]
        lines.append("| " + " | ".join(cells) + " |")
        if m.get("est_error"):
            notes.append(f"- `{m['method']}`: no planner estimate ({m['est_error']})")
        elif m.get("est_graphs", 0) > 1:
            notes.append(
                f"- `{m['method']}`: graph breaks; the estimate is the largest of "
                f"{m['est_graphs']} compiled graphs' peaks, not the step's"
            )
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)


def markdown(doc: dict[str, Any]) -> str:
    env, options = doc["env"], doc["options"]
    device = env.get("gpu") or "CPU"
    header = [
        "## mirrorgrad bench",
        "",
        f"Device: {device}; torch {env.get('torch')}, CUDA {env.get('cuda')}, "
        f"Triton {env.get('triton')}; commit {doc.get('git_commit')}.",
        f"dtype {options['dtype']}, {options['warmup']} warm-up + {options['steps']} timed "
        f"steps per method, backend {options['backend']}"
        + (f", batch cap {options['cap_gb']} GB" if options.get("cap_gb") else "")
        + f". Peak memory: {_peak_source(doc)}."
        + (
            f" compile s: warm / cold; the cold compiles ran {options['precompile_jobs']} at a "
            "time to warm Inductor's caches before the timed runs."
            if options.get("precompile_jobs")
            else ""
        ),
        "",
        f"Command: `{doc['command']}`",
    ]
    tables = [workload_table(name, w) for name, w in doc["workloads"].items()]
    return "\n\n".join(["\n".join(header), *tables]) + "\n"


def _peak_source(doc: dict[str, Any]) -> str:
    sources = {
        m.get("peak_source")
        for w in doc["workloads"].values()
        for m in w["methods"]
        if m.get("peak_source")
    }
    if sources == {"cuda"}:
        return "torch.cuda.max_memory_allocated over full steps (fwd+bwd+SGD)"
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
            f"({_ratio(low.get('peak_vs_compile'))} of compile); fastest {fast['method']} "
            f"{_num(fast['median_ms'], 2)} ms ({_ratio(fast.get('time_vs_compile'))} of compile)"
            + (f"; {failed} not measured" if failed else "")
        )
    return "\n".join(lines)


def plots(doc: dict[str, Any], out_dir: Path) -> list[Path]:
    """``peak_vs_time.png``: peak memory against step time, one panel per workload, one
    labelled point per method; ``max_batch.png``: the largest batch per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    device = doc["env"].get("gpu") or "CPU"
    measured = {
        name: [m for m in w["methods"] if m["status"] == "ok"]
        for name, w in doc["workloads"].items()
    }
    measured = {name: ms for name, ms in measured.items() if ms}
    if measured:
        cols = min(3, len(measured))
        rows = -(-len(measured) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.5 * rows), squeeze=False)
        for ax in axes.flat[len(measured) :]:
            ax.set_visible(False)
        for ax, (name, ms) in zip(axes.flat, measured.items()):
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
        fig.tight_layout()
        path = out_dir / "peak_vs_time.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    searched = {
        name: [m for m in w["methods"] if (m.get("max_batch") or {}).get("largest_fit")]
        for name, w in doc["workloads"].items()
    }
    searched = {name: ms for name, ms in searched.items() if ms}
    if searched:
        fig, axes = plt.subplots(len(searched), 1, figsize=(8, 3 * len(searched)), squeeze=False)
        for ax, (name, ms) in zip(axes[:, 0], searched.items()):
            labels = [m["method"] for m in ms]
            values = [m["max_batch"]["largest_fit"] for m in ms]
            ax.bar(labels, values)
            ax.set_title(f"{name}: largest batch under {doc['options']['cap_gb']} GB", fontsize=10)
            ax.set_ylabel("batch")
            ax.tick_params(axis="x", rotation=30, labelsize=8)
        fig.tight_layout()
        path = out_dir / "max_batch.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
