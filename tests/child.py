"""Waiting on a child process by what it says, not by the clock.

A test that must act while a child is at a known point waits for a line the child
prints there; the timeout is generous (a busy 2-core machine is slow, not stuck) and
turns a child that never gets there into a failure instead of a hang.
"""

from __future__ import annotations

import queue
import threading
from typing import IO

import pytest

TIMEOUT_S = 300.0


def read_line(stream: IO[str], timeout: float = TIMEOUT_S) -> str:
    """The next line of ``stream`` ("" at its end); fails the test after ``timeout`` s."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(stream.readline()), daemon=True).start()
    try:
        return lines.get(timeout=timeout)
    except queue.Empty:
        pytest.fail(f"the child printed no line in {timeout:g} s")
