"""The largest batch that fits under a memory cap: gallop from a guess, then bisect.

Each probe is expensive (a fresh process, often a compile), so the search starts
from a guess extrapolated from one measured peak and stops after ``max_probes``;
then the answer is a bracket: ``largest_fit`` fits, ``smallest_fail`` does not.
Probes that fit report their peak: memory is close to linear in the batch, so once two
have, the line through them predicts the answer (a secant step), tried in turn with
bisection so that a poor prediction costs at most every other probe.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# First gallop step as a fraction of the guess, doubling after each probe: memory is
# close to linear in the batch, so a guess from one measurement is near the answer.
_FIRST_STEP = 0.05


@dataclass(kw_only=True, slots=True)
class BatchSearch:
    largest_fit: int | None = None
    smallest_fail: int | None = None
    probes: list[tuple[int, bool]] = field(default_factory=list)
    # Measured peak bytes of the probes that fit and reported one.
    peaks: dict[int, int] = field(default_factory=dict)

    def record(self, batch: int, fits: bool, peak_bytes: int | None = None) -> None:
        self.probes.append((batch, fits))
        if fits and peak_bytes is not None:
            self.peaks[batch] = peak_bytes
        if fits:
            self.largest_fit = max(batch, self.largest_fit or 0)
        else:
            self.smallest_fail = min(batch, self.smallest_fail or batch)

    @property
    def exact(self) -> bool:
        """Is ``largest_fit`` the answer, not only a lower bound?"""
        if self.smallest_fail is None:
            return False
        return self.smallest_fail == (self.largest_fit or 0) + 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "largest_fit": self.largest_fit,
            "smallest_fail": self.smallest_fail,
            "exact": self.exact,
            "probes": [list(p) for p in self.probes],
        }


def guess_batch(*, batch: int, peak_bytes: int, fixed_bytes: int, cap_bytes: int) -> int:
    """Batch whose peak reaches ``cap_bytes`` if the peak is ``fixed + per_sample * batch``
    (``fixed``: parameters and gradients), from one measurement at ``batch``."""
    per_sample = max(1.0, (peak_bytes - fixed_bytes) / batch)
    return max(1, math.floor((cap_bytes - fixed_bytes) / per_sample))


def search_max_batch(
    fits: Callable[[int], bool | tuple[bool, int | None]],
    *,
    guess: int,
    max_probes: int,
    limit: int = 1 << 20,
    cap_bytes: int | None = None,
) -> BatchSearch:
    """Largest ``b`` in ``[1, limit]`` with ``fits(b)``, assuming ``fits`` is monotone.

    ``fits`` may return ``(fits, peak_bytes)``; with ``cap_bytes`` the peaks steer the
    search (secant steps)."""
    if max_probes < 1:
        raise ValueError(f"max_probes must be >= 1, got {max_probes}")
    result = BatchSearch()
    b = min(max(1, guess), limit)
    step = max(1, round(b * _FIRST_STEP))
    secant_last = False
    for _ in range(max_probes):
        answer = fits(b)
        ok, peak = answer if isinstance(answer, tuple) else (answer, None)
        result.record(b, bool(ok), peak)
        lo, hi = result.largest_fit or 0, result.smallest_fail
        if hi == lo + 1 or (hi is None and lo >= limit):
            break
        upper = limit if hi is None else hi - 1
        predicted = _secant(result, cap_bytes)
        if predicted is not None and not secant_last:
            # Into the open bracket: a line at or below lo says lo is the top (lo + 1
            # is the probe that proves it); one past the failing batch says hi - 1.
            b = min(max(predicted, lo + 1), upper)
            secant_last = hi is not None
        else:
            if hi is None:
                b = min(limit, lo + step)
            elif lo == 0:
                b = max(1, hi - step)
            else:
                b = (lo + hi) // 2
            secant_last = False
        step *= 2
    return result


def _secant(result: BatchSearch, cap_bytes: int | None) -> int | None:
    """The batch at which the line through the two largest measured peaks meets the cap."""
    if cap_bytes is None or len(result.peaks) < 2:
        return None
    (b0, p0), (b1, p1) = sorted(result.peaks.items())[-2:]
    slope = (p1 - p0) / (b1 - b0)
    if slope <= 0:
        return None
    return math.floor(b1 + (cap_bytes - p1) / slope)
