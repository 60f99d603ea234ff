"""The table each suite leads its report with: one line per workload, the suite's question.

rnn-kernels: module-level times against cuDNN and graphed cuDNN, kernels beside them;
zoo-sweep: ok / fallback / failed per model and mode, with peak and time ratios;
word-lm: tokens/s and peak of `mirrorgrad train lm`'s step against PyTorch's example.
"""

from __future__ import annotations

import math
from typing import Any

from mirrorgrad._units import format_bytes


def _ok(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["method"]: m for m in workload["methods"] if m["status"] == "ok"}


def _ms(m: dict[str, Any] | None) -> str:
    return "—" if m is None else f"{m['median_ms']:.2f}"


def _x(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def _geomean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def _speedup(base: dict | None, m: dict | None) -> float | None:
    return base["median_ms"] / m["median_ms"] if base and m else None


def rnn_table(doc: dict[str, Any]) -> str:
    """Module level first: cuDNN plain and graphed, mirrorgrad.nn as users get it (auto)
    and with each implementation fixed; then the kernels alone, and what the module adds
    to them (``mgnn-triton-stash`` over ``kernel-auto``: same kernels, same memory mode)."""
    peak = (doc["env"].get("peak_tflops") or {}).get(doc["options"]["dtype"])
    impls = [n for n in _methods(doc) if n.startswith("mgnn-")]
    head = ["workload", "cuDNN ms", "cuDNN graphed ms", "mirrorgrad.nn ms", "vs cuDNN",
            "vs graphed", "TFLOP/s", "of peak", *(f"{n} ms" for n in impls),
            "auto / best", "mgnn graphed ms", "best kernel ms", "module / kernels",
            "gradients"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    ratios: dict[str, tuple[list[float], list[float]]] = {}
    for name, w in doc["workloads"].items():
        ok = _ok(w)
        cu, cug, mg = ok.get("eager"), ok.get("cuda-graph"), ok.get("eager+mgnn")
        kernels = [m for n, m in ok.items() if n.startswith("kernel-")]
        best = min(kernels, key=lambda m: m["median_ms"], default=None)
        vs, vsg = _speedup(cu, mg), _speedup(cug, mg)
        group = _rnn_group(name)
        for bucket, value in zip(ratios.setdefault(group, ([], [])), (vs, vsg)):
            if value:
                bucket.append(value)
        share = f"{100 * mg['tflops'] / peak:.1f}%" if mg and peak and mg.get("tflops") else "—"
        wrong = [n for n, m in ok.items() if m.get("grads_ok") is False]
        added = _speedup(ok.get("kernel-auto"), ok.get("mgnn-triton-stash"))  # both stash
        # impl="auto" against the fastest fixed choice a user could have made (cuDNN too).
        fixed = [m for n, m in ok.items() if n in impls or n == "eager"]
        best_fixed = min(fixed, key=lambda m: m["median_ms"], default=None)
        auto_vs_best = _speedup(best_fixed, mg)
        cells = [name, _ms(cu), _ms(cug), _ms(mg), _x(vs), _x(vsg),
                 "—" if not mg or mg.get("tflops") is None else f"{mg['tflops']:.2f}", share,
                 *(_ms(ok.get(n)) for n in impls),
                 _x(1 / auto_vs_best if auto_vs_best else None), _ms(ok.get("cuda-graph+mgnn")),
                 "—" if best is None else f"{best['median_ms']:.2f} ({best['method']})",
                 _x(1 / added if added else None),
                 "WRONG: " + ", ".join(wrong) if wrong else "ok"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for group, (vs, vsg) in ratios.items():
        lines.append(
            f"- {group}: mirrorgrad.nn geomean {_x(_geomean(vs))} of cuDNN, "
            f"{_x(_geomean(vsg))} of cuDNN in a CUDA Graph ({len(vs)} shapes); "
            f"{sum(v < 1 for v in vs)} shapes slower than cuDNN"
        )
    return "\n".join(lines)


def _rnn_group(workload: str) -> str:
    """"lstm", or "lstm, batch 1-4" (issue 16's two tables) from rnn-<mode>-...-B<b>-..."""
    parts = workload.split("-")
    batch = next((int(p[1:]) for p in parts if p[:1] == "B" and p[1:].isdigit()), None)
    return parts[1] + (", batch 1-4" if batch is not None and batch <= 4 else "")


def _methods(doc: dict[str, Any]) -> list[str]:
    """Every method of the document, in the order first seen."""
    return list(dict.fromkeys(m["method"] for w in doc["workloads"].values()
                              for m in w["methods"]))  # fmt: skip


def _zoo_cell(m: dict[str, Any]) -> str:
    if m["status"] == "skipped":
        return "skipped"
    if m["status"] != "ok":
        return "CRASH"
    if m.get("grads_ok") is False:
        return "WRONG"
    return "fallback" if m.get("fallback") else "ok"


def zoo_table(doc: dict[str, Any]) -> str:
    methods = _methods(doc)
    mirror = [m for m in methods if m.startswith("mirror-")]
    head = ["model", *methods]
    for m in mirror:
        head += [f"{m} peak / eager", "peak / compile", "time / compile"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---|" * len(methods)
             + "---:|" * (3 * len(mirror))]  # fmt: skip
    counts: dict[str, int] = {}
    notes, skipped = [], {}
    for name, w in doc["workloads"].items():
        by = {m["method"]: m for m in w["methods"]}
        if all(m["status"] == "skipped" for m in by.values()):
            reason = next(iter(by.values()))["error"]
            skipped.setdefault(reason, []).append(name)
            continue
        eager = by.get("eager")
        if eager is not None and eager["status"] == "failed":
            # The model did not train even without compiling: a build problem, not a plan's.
            counts["model failed eagerly"] = counts.get("model failed eagerly", 0) + 1
            notes.append(f"- {name}: fails eagerly, not counted: {eager['error']}")
            continue
        cells = [name]
        for method in methods:
            cell = _zoo_cell(by[method]) if method in by else "—"
            counts[cell] = counts.get(cell, 0) + 1
            cells.append(cell)
            m = by.get(method)
            if m and (m.get("fallback") or m["status"] == "failed"):
                notes.append(f"- {name} / {method}: {m.get('fallback') or m.get('error')}")
            if m and m.get("grads_ok") is False:
                notes.append(f"- {name} / {method}: gradients off by {m['grad_error']:.1e} "
                             f"(worst {m['grad_worst']})")  # fmt: skip
        for method in mirror:
            m = by.get(method, {})
            cells += [_x(m.get("peak_vs_eager")), _x(m.get("peak_vs_compile")),
                      _x(m.get("time_vs_compile"))]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    total = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    lines = [f"Model x mode results: {total}.", "", *lines]
    if notes:
        lines += ["", "Fallbacks, crashes and wrong gradients:", "", *notes]
    for reason, names in skipped.items():
        lines += ["", f"Skipped ({reason}): {len(names)} models ({', '.join(names[:6])}...)"]
    return "\n".join(lines)


def word_lm_table(doc: dict[str, Any]) -> str:
    head = ["workload", "method", "tokens/s", "peak", "tokens/s vs example", "peak vs example"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * 4]
    for name, w in doc["workloads"].items():
        for m in w["methods"]:
            if m["status"] != "ok":
                lines.append(f"| {name} | {m['method']} | {m['status']}: {m['error']} | | | |")
                continue
            speed = m.get("time_vs_pytorch-example")
            cells = [
                name,
                m["method"],
                f"{m['tokens_per_s']:,.0f}",
                format_bytes(m["peak_bytes"]),
                _x(1 / speed if speed else None),
                _x(m.get("peak_vs_pytorch-example")),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


_LEADS = {"rnn-kernels": rnn_table, "zoo-sweep": zoo_table, "word-lm": word_lm_table}


def lead_table(doc: dict[str, Any]) -> str:
    """The suite's own table ("" for the planner suite: its workload tables say it)."""
    lead = _LEADS.get(doc.get("suite", "planner"))
    return "" if lead is None else lead(doc)
