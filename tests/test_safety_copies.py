"""safety_copies: the copies a planned backward's first call runs from if it fails."""

from __future__ import annotations

import types

import pytest
import torch

from mirrorgrad.safety_copies import DEVICE_MARGIN, SafetyCopies, device_room

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
    ),
]
ROOMS = {"device": lambda device: 1 << 62, "host": lambda device: 0}


def _overwrite(t: torch.Tensor) -> None:
    """What the compiled backward may do to an input it was donated."""
    t.fill_(float("nan") if t.is_floating_point() or t.is_complex() else 7)


def _inputs(device: str) -> tuple[list, list[bool], list[bool]]:
    """A backward's inputs as AOTAutograd hands them over: a parameter and a view of it
    (kept), a saved value and two views of its storage (one transposed, one a slice), a
    value that aliases none, an int, an input the graph does not read, an empty tensor,
    a conjugate view, an integer seed."""
    weight = torch.nn.Parameter(torch.randn(3, 2, device=device))
    saved = torch.randn(6, 5, device=device)
    inputs = [
        weight, weight.detach().t(),
        saved, saved.t(), saved[1:4, 2:],
        torch.randn(7, device=device, dtype=torch.float16),
        2,
        torch.randn(4, device=device),
        torch.empty(0, 3, device=device),
        torch.randn(3, dtype=torch.complex64, device=device).conj(),
        torch.tensor([123], device=device),
    ]  # fmt: skip
    keep = [True, True] + [False] * 9
    needed = [True] * 7 + [False] + [True] * 3
    return inputs, keep, needed


@pytest.mark.parametrize("where", list(ROOMS))
@pytest.mark.parametrize("device", DEVICES)
def test_the_copies_hold_the_inputs_as_they_were_once_the_originals_are_overwritten(
    device, where
):
    inputs, keep, needed = _inputs(device)
    expected = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
    copies = SafetyCopies.of(inputs, keep=keep, needed=needed, room=ROOMS[where])
    for x, kept in zip(inputs, keep):
        if isinstance(x, torch.Tensor) and not kept:
            _overwrite(x)
    restored = copies.restore()
    assert restored[0] is inputs[0] and restored[1] is inputs[1]  # parameters: kept
    assert restored[6] == 2 and restored[7] is None  # not read: not copied, not kept alive
    for i in (2, 3, 4, 5, 8, 9, 10):
        got, want, original = restored[i], expected[i], inputs[i]
        assert got is not original and got.device == original.device, i
        assert (got.dtype, got.shape, got.stride()) == (
            original.dtype, original.shape, original.stride()
        ), i  # fmt: skip
        assert torch.equal(got.resolve_conj(), want.resolve_conj()), i
    # The saved value and its views come back as views of one copy.
    storages = {restored[i].untyped_storage().data_ptr() for i in (2, 3, 4)}
    assert len(storages) == 1
    # Each storage copied once: the saved value's 120 bytes, the half-precision value's
    # 14, the empty one's none, the complex one's 24 and the seed's 8.
    placed = copies.placed()
    assert placed == {"device": 0, "host": 0} | {where: 120 + 14 + 24 + 8}
    copies.release()
    assert copies.values == []


def test_the_bytes_a_storage_holds_beyond_its_views_are_not_copied():
    buffer = torch.arange(1000, dtype=torch.float32)
    inputs = [buffer[101:110], buffer[200:205].view(5, 1)]
    expected = [x.clone() for x in inputs]
    copies = SafetyCopies.of(inputs, keep=[False, False], needed=[True, True], room=ROOMS["host"])
    # From the 16-byte boundary at or below the first view's start to the last one's end.
    assert copies.placed()["host"] == 205 * 4 - 400
    buffer.zero_()
    restored = copies.restore()
    assert [r.storage_offset() for r in restored] == [1, 100]
    for got, want in zip(restored, expected):
        assert torch.equal(got, want)


def test_what_the_device_has_no_room_for_goes_to_host_memory():
    big, small = torch.randn(64), torch.randn(8)
    room = lambda device: 64 * 4  # noqa: E731  # room for the first storage only
    copies = SafetyCopies.of([big, small], keep=[False, False], needed=[True, True], room=room)
    assert copies.placed() == {"device": 64 * 4, "host": 8 * 4}
    big_copy, small_copy = copies.restore()
    assert torch.equal(big_copy, big) and torch.equal(small_copy, small)


def _plan(**fields) -> types.SimpleNamespace:
    defaults = {"step_peak": 10_000, "stash_bytes_after": 4_000, "peak_after": 9_000}
    return types.SimpleNamespace(**{"budget_bytes": None, **defaults, **fields})


def test_device_room_is_the_free_memory_less_the_backwards_growth_and_a_margin(monkeypatch):
    # free 50,000 of 100,000 on the device, 5,000 cached by the allocator but unused; an
    # earlier peak far above the memory in use (its headroom does not bind here)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (50_000, 100_000))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 30_000)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 25_000)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 10**6)
    cuda = torch.device("cuda", 0)
    margin = int(DEVICE_MARGIN * 100_000)
    growth = 10_000 - 4_000  # the plan's peak less its stash
    assert device_room(lambda: _plan())(cuda) == 50_000 + 5_000 - growth - margin
    assert device_room(lambda: None)(cuda) == 50_000 + 5_000 - margin
    # Under a budget: at most what the plan's peak leaves of it.
    assert device_room(lambda: _plan(budget_bytes=9_500))(cuda) == 500
    assert device_room(lambda: _plan(budget_bytes=8_000))(cuda) == 0  # budget missed
    assert device_room(lambda: _plan(step_peak=200_000))(cuda) == 0
    assert device_room(lambda: _plan())(torch.device("cpu")) == 0  # host memory anyway


def test_device_room_never_raises_the_process_peak(monkeypatch):
    """Copies on the device only in what an earlier peak left above the memory in use
    and the backward's growth: the first step's peak stays where it would be."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (50_000, 100_000))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 30_000)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 25_000)
    cuda = torch.device("cuda", 0)
    growth = 10_000 - 4_000
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 40_000)
    assert device_room(lambda: _plan())(cuda) == 40_000 - 25_000 - growth
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 25_000)
    assert device_room(lambda: _plan())(cuda) == 0  # at its peak now: all to the host
