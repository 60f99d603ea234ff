"""MirrorOptions: one parser and one validation for keywords, backend options and CLI strings."""

from __future__ import annotations

import math

import pytest

import mirrorgrad
from mirrorgrad.options import MirrorOptions, parse_budget


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("balance", MirrorOptions(mode="balance")),
        ("off", MirrorOptions(mode="off")),
        ("budget:0.5", MirrorOptions(mode="budget", budget=0.5)),
        ("budget:1", MirrorOptions(mode="budget", budget=1.0)),
        ("budget:2GiB", MirrorOptions(mode="budget", budget=2 * 2**30)),
        ("budget:1.5gb", MirrorOptions(mode="budget", budget=1_500_000_000)),
        ("budget:2000000000", MirrorOptions(mode="budget", budget=2_000_000_000)),
        ("budget:2e9", MirrorOptions(mode="budget", budget=2_000_000_000)),
    ],
)
def test_cli_strings(text, expected):
    options = MirrorOptions.from_cli(text)
    assert options == expected
    assert MirrorOptions.from_cli(options.to_cli()) == options


@pytest.mark.parametrize(
    "text",
    ["", "fast", "balance:0.5", "off:1", "budget", "budget:", "budget:abc", "budget:1.5",
     "budget:nan", "budget:inf", "budget:0", "budget:-1", "budget:2XB", "budget:1B"],
)  # fmt: skip
def test_bad_cli_strings(text):
    with pytest.raises(ValueError, match="budget"):
        MirrorOptions.from_cli(text)


@pytest.mark.parametrize(
    "budget",
    ["abc", 1.5, 2.0, 2e9, math.nan, math.inf, -math.inf, 0, 0.0, -1, -0.5, True, [0.5], None],
)
def test_bad_budgets(budget):
    with pytest.raises(ValueError, match="budget"):
        MirrorOptions(mode="budget", budget=budget)


def test_budgets_normalise_to_fraction_or_bytes():
    assert parse_budget(1) == 1.0 and isinstance(parse_budget(1), float)
    assert parse_budget(0.25) == 0.25
    assert parse_budget(4096) == 4096 and isinstance(parse_budget(4096), int)
    assert parse_budget("4096") == 4096 and isinstance(parse_budget("4096"), int)
    assert parse_budget("512MiB") == 512 * 2**20
    assert parse_budget("0.5") == 0.5


@pytest.mark.parametrize("budget", [2.0, 2e9])
def test_a_float_above_one_is_refused_not_taken_as_bytes(budget):
    with pytest.raises(ValueError, match=r"budget=.*a float is a fraction in \(0, 1\]"):
        mirrorgrad.compile(lambda x: x * 2, mode="budget", budget=budget, backend="eager")
    with pytest.raises(ValueError, match="a float is a fraction"):
        MirrorOptions.from_dict({"mode": "budget", "budget": budget})  # backend options


@pytest.mark.parametrize("mode", ["balance", "off"])
def test_budget_outside_budget_mode_is_an_error(mode):
    with pytest.raises(ValueError, match="only used by mode='budget'"):
        MirrorOptions(mode=mode, budget=0.5)


@pytest.mark.parametrize("max_overhead", [-0.01, math.nan, math.inf, "0.1", True])
def test_bad_max_overhead(max_overhead):
    with pytest.raises(ValueError, match="max_overhead"):
        MirrorOptions(max_overhead=max_overhead)


def test_unknown_mode():
    with pytest.raises(ValueError, match="choose one of balance, budget, off"):
        MirrorOptions(mode="fast")


def test_from_dict_names_unknown_keys():
    assert MirrorOptions.from_dict({"mode": "budget", "budget": "1GiB"}).budget == 2**30
    known = r"'bugdet'.*known are budget, fuse_loss, max_overhead, mode"
    with pytest.raises(ValueError, match=known):
        MirrorOptions.from_dict({"mode": "budget", "bugdet": 0.5})


def test_options_are_frozen_and_exported():
    options = mirrorgrad.MirrorOptions(mode="budget", budget=0.5)
    with pytest.raises(AttributeError):
        options.mode = "off"
    assert options.as_kwargs() == {
        "mode": "budget",
        "budget": 0.5,
        "max_overhead": 0.03,
        "fuse_loss": None,
    }


def test_the_cli_spelling_of_a_budget_names_the_keyword_form():
    with pytest.raises(ValueError, match=r"pass mode='budget', budget='0.5'"):
        MirrorOptions(mode="budget:0.5")
