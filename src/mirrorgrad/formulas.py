"""What our custom ops declare to the planner beyond FLOPs: bytes moved and memory.

FLOPs go to torch's own registry (``torch.utils.flop_counter.register_flop_formula``).
The planner also needs what fake tensors cannot show:

- ``register_bytes_formula(op, fn)``: bytes the op reads and writes in memory (its
  intermediates included), for the cost model's time estimate;
- ``register_memory_formula(op, fn)``: the peak of the temporaries the op allocates
  while it runs, beyond its inputs and outputs (workspace, chunk buffers), for the
  liveness simulation. What an op saves for backward is one of its outputs and is
  sized from its fake value like any other;
- ``register_held_formula(op, fn)``: memory the op keeps allocated *between* calls
  (a cache of CUDA Graph arenas, per loop configuration), as ``{key: bytes}``: ops whose
  calls share a buffer return the same key, and it counts once per step (graph/held.py).
  Memory counted here is held for the whole step, so it is not a temporary as well;
- ``register_time_formula(op, fn)``: seconds one call takes, where the op knows better
  than FLOPs and bytes over the device's rates (a recurrence bound by its per-step
  latency); ``fn`` returns None where it has no estimate and the cost model's roofline
  prices the call instead.

Formulas receive the op's arguments with fake tensors (or real ones) in place of
tensors, as ``fn(*args, **kwargs) -> int``; register them on the overload packet
(``torch.ops.mirrorgrad.rnn_forward``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Formula = Callable[..., int]

_BYTES: dict[Any, Formula] = {}
_TEMPORARY: dict[Any, Formula] = {}
_HELD: dict[Any, Callable[..., dict]] = {}
_TIME: dict[Any, Callable[..., float | None]] = {}


def _packet(op: Any) -> Any:
    return getattr(op, "overloadpacket", op)


def register_bytes_formula(op: Any) -> Callable[[Formula], Formula]:
    """Decorator: ``fn(*args, **kwargs)`` returns the bytes ``op`` moves in memory."""

    def register(fn: Formula) -> Formula:
        _BYTES[_packet(op)] = fn
        return fn

    return register


def register_memory_formula(op: Any) -> Callable[[Formula], Formula]:
    """Decorator: ``fn(*args, **kwargs)`` returns the peak bytes of the temporaries
    ``op`` allocates while it runs, beyond its inputs and outputs."""

    def register(fn: Formula) -> Formula:
        _TEMPORARY[_packet(op)] = fn
        return fn

    return register


def register_held_formula(op: Any) -> Callable[[Callable[..., dict]], Callable[..., dict]]:
    """Decorator: ``fn(*args, **kwargs)`` returns ``{key: bytes}`` that ``op`` keeps
    allocated between calls; equal keys are one buffer."""

    def register(fn: Callable[..., dict]) -> Callable[..., dict]:
        _HELD[_packet(op)] = fn
        return fn

    return register


def register_time_formula(
    op: Any,
) -> Callable[[Callable[..., float | None]], Callable[..., float | None]]:
    """Decorator: ``fn(*args, **kwargs)`` returns the seconds one call of ``op`` takes, or
    None where it cannot say (the cost model then uses FLOPs and bytes)."""

    def register(fn: Callable[..., float | None]) -> Callable[..., float | None]:
        _TIME[_packet(op)] = fn
        return fn

    return register


def time_formula(op: Any) -> Callable[..., float | None] | None:
    """The registered time formula of ``op``, or None."""
    return _TIME.get(_packet(op))


def held_formula(op: Any) -> Callable[..., dict] | None:
    """The registered between-calls memory formula of ``op``, or None."""
    return _HELD.get(_packet(op))


def bytes_formula(op: Any) -> Formula | None:
    """The registered bytes formula of ``op`` (an overload or its packet), or None."""
    return _BYTES.get(_packet(op))


def memory_formula(op: Any) -> Formula | None:
    """The registered temporary-memory formula of ``op``, or None."""
    return _TEMPORARY.get(_packet(op))
