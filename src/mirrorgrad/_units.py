"""The one byte formatter: every layer prints sizes the same way (imports nothing of ours)."""

from __future__ import annotations

_SCALES = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10}


def _three_digits(value: float) -> str:
    # Three significant digits, whole numbers from 100 up: 1.00, 15.0, 154, 1,024.
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:#.3g}"


def format_bytes(nbytes: float | None, unit: str | None = None) -> str:
    """``nbytes`` as ``"1.50 GiB"`` (the largest binary unit it reaches), or, with ``unit``
    ("KiB", "MiB" or "GiB"), as a bare number in that unit for a table column that names
    it. Three significant digits; ``None`` (not measured) is ``"—"``."""
    if nbytes is None:
        return "—"
    if unit is not None:
        if unit not in _SCALES:
            raise ValueError(f"unit must be one of {', '.join(_SCALES)}, got {unit!r}")
        return _three_digits(nbytes / _SCALES[unit])
    for name, scale in _SCALES.items():
        if abs(nbytes) >= scale:
            return f"{_three_digits(nbytes / scale)} {name}"
    return f"{int(nbytes)} B"
