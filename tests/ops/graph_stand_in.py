"""Run the RNN kernels' CUDA Graph path on CPU: a stand-in 'graph' replays the captured
loop on the buffers it was captured with, as a CUDA Graph replays its kernels on fixed
addresses, so whatever the cache hands out, shares or reads in place is exercised."""

from __future__ import annotations

import copy
import gc


class ReplayedLoop:
    def __init__(self, buffers, loop) -> None:
        # A shallow copy: later rebinding of a buffer attribute does not reach a real
        # graph either; the tensors (the addresses) are the same.
        self.buffers, self.loop, self.replays = copy.copy(buffers), loop, 0
        # graphs._record runs the loop once before capturing it (kernels compile, cuBLAS
        # makes its workspace): on whatever its buffers hold, shared ones included.
        loop(buffers)
        gc.collect()

    def replay(self) -> None:
        self.replays += 1
        self.loop(self.buffers)
        # The Triton interpreter leaves reference cycles that hold the kernels' arguments
        # (views of the buffers) until a collection; compiled kernels hold nothing.
        gc.collect()
