"""The planner's options (mode, budget, overhead cap): one type, parsed and validated once.

Every way of choosing a plan ends here: ``mirrorgrad.compile(mode=, budget=,
max_overhead=)``, the registered backend's ``torch.compile(..., options={...})`` and the
CLIs' ``--mirror`` / ``--mode`` strings (``balance``, ``off``, ``budget:0.5``,
``budget:2GiB``, ``budget:2000000000``).
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

Mode = Literal["balance", "budget", "off"]
MODES: tuple[Mode, ...] = ("balance", "budget", "off")
# Balance's time cap. 3%: on an H100 the cost model's 5% measured 1.06-1.12x
# torch.compile's step on the suite's resnet50 (recomputed BatchNorm/ReLU priced
# low), 3% measured 0.95x (fastest step 1.01x) at 0.80x its peak.
DEFAULT_MAX_OVERHEAD = 0.03

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*")
_BUDGET_HELP = (
    "a fraction in (0, 1] on activation_memory_budget's scale (budget=0.5: half the saved "
    "activations of torch.compile's default plan), or peak bytes as a positive integer "
    "(budget=2_000_000_000) or a size string (budget='2GiB')"
)


@dataclass(kw_only=True, slots=True, frozen=True)
class MirrorOptions:
    """What the planner is asked for: the one options type behind every entry point.

    ``mirrorgrad.compile``, ``mirrorgrad.explain``, ``mirrorgrad.backend``, the
    registered backend's ``options={...}`` and the CLIs' ``--mirror`` / ``--mode``
    strings all build one of these; it is validated once, here.

    Args:
        mode: ``"balance"`` (default): the lowest estimated peak whose added
            recompute time stays within ``max_overhead``. ``"budget"``: the least
            added time whose estimated peak meets ``budget``. ``"off"``: stash every
            value the backward reads (no mirroring).
        budget: required by ``mode="budget"`` and refused by the others. An int
            number of peak bytes (> 1), or a float fraction in (0, 1] on the scale of
            PyTorch's ``activation_memory_budget``: PyTorch's rule applied to the
            planner's candidates (stash at most F of the way from the smallest stash
            to torch.compile's default plan's; the least-time plan within that sets
            the peak asked for). Strings such as ``"2GiB"``, ``"500MB"`` and ``"0.5"``
            are parsed into one of those.
        max_overhead: balance mode's cap on added time, a finite fraction >= 0 of the
            estimated step time (default 0.03).
        fuse_loss: ``True`` computes an LM head's ``F.cross_entropy(F.linear(h, w),
            t)`` with the fused ``linear_cross_entropy``, whose logits never exist
            whole (it recomputes the head's GEMM in backward: less memory, more time);
            ``None`` (default) and ``False``: not fused.

    Raises:
        ValueError: an unknown mode, a missing or misplaced budget, a budget out of
            range, a negative or non-finite ``max_overhead``; the message says what
            is accepted.

    Example::

        >>> MirrorOptions(mode="budget", budget="2GiB").budget
        2147483648
        >>> MirrorOptions.from_cli("budget:0.5")
        MirrorOptions(mode='budget', budget=0.5, max_overhead=0.03, fuse_loss=None)
        >>> MirrorOptions.from_cli("budget:0.5").to_cli()
        'budget:0.5'
    """

    mode: Mode = "balance"
    budget: float | int | None = None
    max_overhead: float = DEFAULT_MAX_OVERHEAD
    fuse_loss: bool | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            hint = ""
            if isinstance(self.mode, str) and self.mode.startswith("budget:"):
                hint = f" (the CLI's spelling: pass mode='budget', budget={self.mode[7:]!r})"
            raise ValueError(f"mode={self.mode!r}: choose one of {', '.join(MODES)}{hint}")
        if self.mode == "budget" and self.budget is None:
            raise ValueError(f"mode='budget' needs budget=: {_BUDGET_HELP}")
        if self.mode != "budget" and self.budget is not None:
            raise ValueError(
                f"budget={self.budget!r} is only used by mode='budget' (mode={self.mode!r}): "
                "pass mode='budget' or drop budget="
            )
        if self.budget is not None:
            object.__setattr__(self, "budget", parse_budget(self.budget))
        overhead = self.max_overhead
        if (
            isinstance(overhead, bool)
            or not isinstance(overhead, numbers.Real)
            or not math.isfinite(overhead)
            or overhead < 0
        ):
            raise ValueError(
                f"max_overhead={overhead!r}: a finite fraction of the step time >= 0 "
                "(max_overhead=0.05 allows 5% more time)"
            )
        object.__setattr__(self, "max_overhead", float(overhead))
        if not (self.fuse_loss is None or isinstance(self.fuse_loss, bool)):
            raise ValueError(
                f"fuse_loss={self.fuse_loss!r}: True, False or None (not fused)"
            )

    @classmethod
    def from_dict(cls, options: Mapping[str, Any]) -> MirrorOptions:
        """From ``torch.compile(..., backend="mirrorgrad", options={...})``; unknown keys
        are a ValueError naming the known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"unknown mirrorgrad option(s) {', '.join(map(repr, unknown))}: "
                f"known are {', '.join(sorted(known))}"
            )
        return cls(**options)

    @classmethod
    def from_cli(cls, text: str, *, max_overhead: float = DEFAULT_MAX_OVERHEAD) -> MirrorOptions:
        """``balance`` | ``off`` | ``budget:FRACTION`` | ``budget:BYTES`` (``budget:2GiB``,
        ``budget:2000000000``); ValueError on anything else."""
        name, sep, value = text.strip().partition(":")
        usage = (
            "use balance, off, budget:FRACTION with 0 < FRACTION <= 1 (budget:0.5 keeps half "
            "the saved activations of torch.compile's default plan, as "
            "activation_memory_budget=0.5 does) or budget:BYTES (budget:2GiB, budget:2000000000)"
        )
        if name in ("balance", "off") and not sep:
            return cls(mode=name, max_overhead=max_overhead)
        if name == "budget" and value:
            try:
                budget = parse_budget(value)
            except ValueError:
                raise ValueError(f"{text!r}: {value!r} is not a budget; {usage}") from None
            return cls(mode="budget", budget=budget, max_overhead=max_overhead)
        raise ValueError(f"{text!r}: {usage}")

    def to_cli(self) -> str:
        """The CLI spelling: ``from_cli(o.to_cli())`` gives ``o`` back (max_overhead aside)."""
        if self.mode != "budget":
            return self.mode
        return (
            f"budget:{self.budget:g}"
            if isinstance(self.budget, float)
            else (f"budget:{self.budget}")
        )

    def as_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``mirrorgrad.compile`` that give these options."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def parse_budget(value: object) -> float | int:
    """A budget as the planner takes it: a float fraction in (0, 1] or int bytes > 1.

    Numbers up to 1 are fractions (``1`` is torch.compile's default plan); integers above
    1 are bytes; a float above 1 is refused (``budget=2.0`` reads as a fraction gone
    wrong, not as 2 bytes). Strings: a number (an integral one above 1, ``"2e9"``, is
    bytes), or a size with a unit (``512MiB``, ``2GB``)."""
    if isinstance(value, str):
        return _parse_budget_text(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"budget={value!r}: {_BUDGET_HELP}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"budget={value!r} must be finite and > 0: {_BUDGET_HELP}")
    if value <= 1:
        return float(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    raise ValueError(
        f"budget={value!r}: a float is a fraction in (0, 1]; give bytes as an int "
        "(budget=2_000_000_000) or a size string ('2GiB')"
    )


def _parse_budget_text(text: str) -> float | int:
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"budget={text!r}: {_BUDGET_HELP}")
    number, unit = match.groups()
    if not unit:
        value = float(number)
        return parse_budget(int(value) if value > 1 and value.is_integer() else value)
    scale = _UNITS.get(unit.lower())
    if scale is None:
        raise ValueError(
            f"budget={text!r}: unknown unit {unit!r}; use one of {', '.join(_UNITS)} (any case)"
        )
    nbytes = float(number) * scale
    if nbytes < 2:
        raise ValueError(f"budget={text!r} is below 2 bytes: {_BUDGET_HELP}")
    return int(nbytes)
