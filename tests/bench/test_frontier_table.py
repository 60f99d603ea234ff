"""The planner suite's frontier table and plot lines, from hand-written results."""

from mirrorgrad.bench import report
from mirrorgrad.bench.methods import FRONTIER_METHODS, PLANNER_METHODS
from mirrorgrad.bench.suite_tables import frontier_table

MIB = 2**20


def _m(method, ms, mib):
    return {"method": method, "status": "ok", "median_ms": ms, "peak_bytes": int(mib * MIB)}


def _doc(*methods):
    return {"workloads": {"gpt2": {"methods": list(methods)}}}


def test_ours_dominates_with_no_more_peak_and_at_most_half_the_added_time():
    doc = _doc(
        _m("compile", 100.0, 1000),
        _m("compile-budget-0.5", 110.0, 600),
        _m("mirror-budget-0.5", 105.0, 600),  # +5% against +10%: exactly half
        _m("compile-budget-0.3", 120.0, 500),
        _m("mirror-budget-0.3", 111.0, 480),  # +11% against +20%: more than half
        _m("compile-budget-0.1", 130.0, 400),
        _m("mirror-budget-0.1", 140.0, 450),
        _m("mirror-balance", 102.0, 790),
    )
    table = frontier_table(doc)
    rows = [line for line in table.splitlines() if line.startswith("| gpt2")]
    assert [row.split(" | ")[1] for row in rows] == ["0.5", "0.3", "0.1", "balance"]
    assert rows[0].endswith("| yes |")
    assert rows[1].endswith("| no: time |")
    assert rows[2].endswith("| no: peak and time |")
    assert "(0.79x), +2.0% | yes" in rows[3]


def test_a_fraction_needs_both_sides_and_a_table_needs_compile():
    only_theirs = _doc(_m("compile", 100.0, 1000), _m("compile-budget-0.5", 110.0, 600),
                       _m("compile-budget-0.5+mgnn", 110.0, 600))  # a twin is no fraction
    assert "| gpt2 | 0.5" not in frontier_table(only_theirs)
    assert frontier_table(_doc(_m("mirror-budget-0.5", 1.0, 1))) == ""


def test_balance_over_its_time_promise_is_a_no():
    table = frontier_table(_doc(_m("compile", 100.0, 1000), _m("mirror-balance", 104.0, 700)))
    assert table.splitlines()[-1].endswith("| no (≤ 0.8x at ≤ 1.03x) |")


def test_balance_row_carries_the_planners_verdict_where_the_runner_worked_it_out():
    verdict = "≤ 0.8x at ≤ 1.03x: not within +3%: a plan at 0.676x at +5.4%"
    balance = _m("mirror-balance", 102.0, 790) | {"balance_target": {"verdict": verdict}}
    table = frontier_table(_doc(_m("compile", 100.0, 1000), balance))
    assert table.splitlines()[-1].endswith(
        "| yes (≤ 0.8x at ≤ 1.03x); estimated: not within +3%: a plan at 0.676x at +5.4% |"
    )
    failed = _m("mirror-balance", 102.0, 790) | {"balance_target": {"error": "ValueError: x"}}
    table = frontier_table(_doc(_m("compile", 100.0, 1000), failed))
    assert table.splitlines()[-1].endswith("; estimated: not worked out (ValueError: x) |")


def test_plot_lines_run_from_compile_down_the_fractions():
    ms = [_m("mirror-budget-0.3", 3, 3), _m("compile-budget-0.3", 2, 2), _m("compile", 1, 1),
          _m("compile-budget-0.7", 4, 4), _m("mirror-balance", 5, 5),
          _m("compile-budget-0.5+mgnn", 6, 6)]  # fmt: skip
    lines = report._frontiers(ms)
    assert [m["method"] for m in lines["torch.compile, activation_memory_budget"]] == [
        "compile", "compile-budget-0.7", "compile-budget-0.3"
    ]
    assert "mirrorgrad budget" not in lines  # one point is no line


def test_the_frontier_methods_exist_and_the_default_run_leaves_the_extra_fractions_out():
    from mirrorgrad.bench.suites import get_method

    for name in FRONTIER_METHODS:
        get_method(name)
    assert "mirror-budget-0.7" not in PLANNER_METHODS
    assert "mirror-budget-0.5" in PLANNER_METHODS
