"""The table each suite leads its report with: one line per workload, the suite's question.

rnn-modules: cuDNN and mirrorgrad.nn, plain and in one CUDA Graph, against graphed cuDNN;
word-lm: tokens/s and peak of `mirrorgrad train lm`'s step against PyTorch's example.
"""

from __future__ import annotations

import math
from typing import Any

from mirrorgrad._units import format_bytes


def _ok(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["method"]: m for m in workload["methods"] if m["status"] == "ok"}


def x_ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def _geomean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def _speedup(base: dict | None, m: dict | None) -> float | None:
    return base["median_ms"] / m["median_ms"] if base and m else None


def methods_of(doc: dict[str, Any]) -> list[str]:
    """Every method of the document, in the order first seen."""
    return list(dict.fromkeys(m["method"] for w in doc["workloads"].values()
                              for m in w["methods"]))  # fmt: skip


# The module table's columns: (header, method); the best fixed implementation is added.
MODULE_COLUMNS = (
    ("cuDNN", "eager"),
    ("cuDNN graphed", "cuda-graph"),
    ("mgnn auto", "eager+mgnn"),
    ("mgnn auto graphed", "cuda-graph+mgnn"),
)
_GRAPHED_IMPL = "cuda-graph+mgnn-"


def module_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per workload: each column's ms and peak bytes (None where not measured),
    the fastest graphed fixed implementation, and speedups and peaks over graphed cuDNN
    (speedup = graphed cuDNN's ms / the method's: above 1 is faster); then each graphed
    fixed implementation's ms and peak."""
    impl_names = [n for n in methods_of(doc) if n.startswith(_GRAPHED_IMPL)]
    rows = []
    for name, w in doc["workloads"].items():
        ok = _ok(w)
        impls = [m for n, m in ok.items() if n.startswith(_GRAPHED_IMPL)]
        best = min(impls, key=lambda m: m["median_ms"], default=None)
        base = ok.get("cuda-graph")
        row: dict[str, Any] = {"workload": name}
        picks = [*((h, ok.get(m)) for h, m in MODULE_COLUMNS), ("best fixed graphed", best)]
        for header, m in picks:
            row[f"{header} ms"] = None if m is None else m["median_ms"]
            row[f"{header} peak bytes"] = None if m is None else m["peak_bytes"]
            row[f"{header} speedup"] = _speedup(base, m)
            peak_ratio = m["peak_bytes"] / base["peak_bytes"] if m and base else None
            row[f"{header} peak ratio"] = peak_ratio
        row["best fixed impl"] = None if best is None else best["method"][len(_GRAPHED_IMPL) :]
        row["wrong gradients"] = [n for n, m in ok.items() if m.get("grads_ok") is False]
        graphed = ok.get("cuda-graph+mgnn") or {}
        row["auto picked graphed"] = "; ".join(graphed.get("auto_picks") or [])
        for n in impl_names:
            impl = n[len(_GRAPHED_IMPL) :]
            row[f"graphed {impl} ms"] = ok[n]["median_ms"] if n in ok else None
            row[f"graphed {impl} peak bytes"] = ok[n]["peak_bytes"] if n in ok else None
        row["not measured"] = {m["method"]: m["error"] for m in w["methods"] if m["status"] != "ok"}
        rows.append(row)
    return rows


def module_table(doc: dict[str, Any]) -> str:
    """Per workload: ms and peak of cuDNN and mirrorgrad.nn, plain and in one CUDA Graph,
    each with its speedup and peak over graphed cuDNN; geomeans per mode below."""
    heads = [h for h, _ in MODULE_COLUMNS] + ["best fixed graphed"]
    head = ["workload", *(f"{h}: ms (x) / peak MiB (x)" for h in heads), "gradients"]
    head.append("auto picked, graphed (captured ms)")
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * len(heads) + "---|---|"]
    speedups: dict[str, dict[str, list[float]]] = {}
    rows = module_rows(doc)
    for row in rows:
        cells = [row["workload"]]
        for h in heads:
            ms, x = row[f"{h} ms"], row[f"{h} speedup"]
            peak = format_bytes(row[f"{h} peak bytes"], "MiB")
            ratio = x_ratio(row[f"{h} peak ratio"])
            cells.append("—" if ms is None else f"{ms:.2f} ({x_ratio(x)}) / {peak} ({ratio})")
            if x:
                speedups.setdefault(row["workload"].split("-")[1], {}).setdefault(h, []).append(x)
        if row["best fixed impl"]:
            cells[-1] += f" {row['best fixed impl']}"
        wrong = row["wrong gradients"]
        cells.append("WRONG: " + ", ".join(wrong) if wrong else "ok")
        cells.append(row["auto picked graphed"] or "—")
        lines.append("| " + " | ".join(cells) + " |")
    dtype = doc["options"]["dtype"]
    lines += [
        "",
        f"{dtype}. ms (x): graphed cuDNN's ms over the method's (above 1: faster); "
        "peak MiB (x): the method's peak over graphed cuDNN's (below 1: less memory).",
    ]
    for mode, by in speedups.items():
        parts = [f"{h} {x_ratio(_geomean(v))} ({len(v)})" for h, v in by.items() if h != heads[1]]
        lines.append(f"- {mode}, geomean speedup over graphed cuDNN: " + "; ".join(parts))
    why: dict[str, dict[str, int]] = {}  # reason -> method -> workloads
    for row in rows:
        for method, reason in row["not measured"].items():
            counts = why.setdefault(reason, {})
            counts[method] = counts.get(method, 0) + 1
    if why:
        lines += ["", "Not measured:"]
        lines += [f"- {reason}: " + ", ".join(f"{m} ({n} workloads)" for m, n in counts.items())
                  for reason, counts in why.items()]  # fmt: skip
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
                x_ratio(1 / speed if speed else None),
                x_ratio(m.get("peak_vs_pytorch-example")),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# Balance's promise: this much of compile's peak at most, at this much of its time.
BALANCE_PEAK, BALANCE_TIME = 0.8, 1.03


def budgets(methods: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The entries of ``methods`` (by name) whose name is ``prefix`` + a fraction, by
    that fraction's text, largest fraction first (twins such as ``+mgnn`` left out)."""
    fractions = {}
    for name in methods:
        text = name[len(prefix):] if name.startswith(prefix) else ""
        try:
            fractions[text] = float(text)
        except ValueError:
            continue
    return {f: methods[prefix + f] for f in sorted(fractions, key=fractions.get, reverse=True)}


def estimated_target(balance: dict[str, Any]) -> str:
    """"; estimated: ..." with the planner's verdict on balance's target (``explain``'s:
    against min-cut's partition simulated), where the runner worked it out."""
    target = balance.get("balance_target")
    if not target:
        return ""
    if "error" in target:
        return f"; estimated: not worked out ({target['error']})"
    # The verdict starts with the goal, which the row already says.
    return f"; estimated: {target['verdict'].partition(': ')[2]}"


def _added(m: dict[str, Any], base: dict[str, Any]) -> float:
    return m["median_ms"] / base["median_ms"] - 1


def frontier_table(doc: dict[str, Any]) -> str:
    """The planner's frontier, one line per workload and fraction F where both
    `compile-budget-F` (min-cut with ``activation_memory_budget``) and `mirror-budget-F`
    ran: peaks and added step time over `compile`, and whether ours dominates (peak at
    most min-cut's, added time at most half of min-cut's); then balance against its
    promise (≤ 0.8x compile's peak at ≤ 1.03x its time), measured and, where the runner
    worked it out, as the planner estimated it. Empty without `compile`."""
    lines = []
    for name, w in doc["workloads"].items():
        ok = _ok(w)
        base = ok.get("compile")
        if base is None:
            continue
        for f, theirs in budgets(ok, "compile-budget-").items():
            ours = ok.get(f"mirror-budget-{f}")
            if ours is None:
                continue
            peak_ok = ours["peak_bytes"] <= theirs["peak_bytes"]
            time_ok = _added(ours, base) <= max(_added(theirs, base), 0) / 2
            verdict = "yes" if peak_ok and time_ok else "no: " + " and ".join(
                why for why, bad in (("peak", not peak_ok), ("time", not time_ok)) if bad
            )
            lines.append(
                f"| {name} | {f} | {format_bytes(theirs['peak_bytes'])}, "
                f"{_added(theirs, base):+.1%} | {format_bytes(ours['peak_bytes'])}, "
                f"{_added(ours, base):+.1%} | {verdict} |"
            )
        balance = ok.get("mirror-balance")
        if balance is not None:
            peak = balance["peak_bytes"] / base["peak_bytes"]
            time = balance["median_ms"] / base["median_ms"]
            kept = peak <= BALANCE_PEAK and time <= BALANCE_TIME
            lines.append(
                f"| {name} | balance | | {format_bytes(balance['peak_bytes'])} ({peak:.2f}x), "
                f"{time - 1:+.1%} | {'yes' if kept else 'no'} (≤ {BALANCE_PEAK}x at ≤ "
                f"{BALANCE_TIME}x){estimated_target(balance)} |"
            )
    if not lines:
        return ""
    head = ("| workload | F | min-cut: peak, added time | ours: peak, added time | "
            "ours dominates |\n|---|---|---|---|---|")  # fmt: skip
    return "**The frontier**, against `compile`:\n\n" + head + "\n" + "\n".join(lines)
