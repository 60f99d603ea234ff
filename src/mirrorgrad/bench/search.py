"""The largest batch that fits under a memory cap: gallop from a guess, then bisect.

Each probe is expensive (a fresh process, often a compile), so the search starts
from a guess extrapolated from one measured peak and stops after ``max_probes``;
then the answer is a bracket: ``largest_fit`` fits, ``smallest_fail`` does not.
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

    def record(self, batch: int, fits: bool) -> None:
        self.probes.append((batch, fits))
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
    fits: Callable[[int], bool], *, guess: int, max_probes: int, limit: int = 1 << 20
) -> BatchSearch:
    """Largest ``b`` in ``[1, limit]`` with ``fits(b)``, assuming ``fits`` is monotone."""
    if max_probes < 1:
        raise ValueError(f"max_probes must be >= 1, got {max_probes}")
    result = BatchSearch()
    b = min(max(1, guess), limit)
    step = max(1, round(b * _FIRST_STEP))
    for _ in range(max_probes):
        result.record(b, fits(b))
        lo, hi = result.largest_fit or 0, result.smallest_fail
        if hi is None:
            if lo >= limit:
                break
            b = min(limit, lo + step)
        elif hi == lo + 1:
            break
        elif lo == 0:
            b = max(1, hi - step)
        else:
            b = (lo + hi) // 2
        step *= 2
    return result
