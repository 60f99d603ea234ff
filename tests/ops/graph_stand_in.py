"""Run the RNN kernels' CUDA Graph path on CPU: a stand-in 'graph' replays the captured
loop on the buffers of the call that replays it, after checking that every one of them
lies where the captured one did (address, shape, strides), which is what a CUDA Graph
needs to replay its kernels on fixed addresses. It keeps no buffer: whatever the cache
hands out, shares or reads in place is exercised as on the GPU."""

from __future__ import annotations

import dataclasses
import gc
import math

from torch import Tensor


def layout(buffers) -> dict:
    """Per field of a buffers dataclass: (address, shape, strides, dtype) or None."""
    out = {}
    for f in dataclasses.fields(buffers):
        value = getattr(buffers, f.name)
        if isinstance(value, Tensor):
            value = (value.data_ptr(), tuple(value.shape), value.stride(), value.dtype)
        out[f.name] = value
    return out


class ReplayedLoop:
    def __init__(self, buffers, loop) -> None:
        self.layout, self.loop, self.replays = layout(buffers), loop, 0
        # graphs._record runs the loop once before capturing it (kernels compile, cuBLAS
        # makes its workspace): on whatever its buffers hold, shared ones included.
        loop(buffers)
        gc.collect()

    def replay(self, buffers) -> None:
        now = layout(buffers)
        moved = {k: (self.layout[k], v) for k, v in now.items() if v != self.layout[k]}
        assert not moved, f"replayed on buffers that are not the captured ones: {moved}"
        self.replays += 1
        self.loop(buffers)
        # The Triton interpreter leaves reference cycles that hold the kernels' arguments
        # (views of the buffers) until a collection; compiled kernels hold nothing.
        gc.collect()


class ReusedBlocks:
    """The CUDA caching allocator's habit on CPU, for ``LoopConfig.empty`` (where the
    kernels allocate their outputs): a block nobody references any more is handed out
    again to the next request of its size, so a loop that repeats its allocations gets
    the same addresses, as on the GPU. (CPU malloc under the Triton interpreter's churn
    rarely gives an address back.) Each hand-out is poisoned as a fresh buffer is."""

    def __init__(self, poison) -> None:
        self.blocks: dict[int, list] = {}
        self.poison = poison

    def empty(self, config, *shape: int, dtype=None):
        import torch

        from mirrorgrad import _compat

        dtype = dtype or config.dtype
        if not _compat.dispatches_plainly(()):  # fake tensors: shapes only
            return torch.empty(shape, dtype=dtype, device=config.device)
        nbytes = max(1, math.prod(shape) * dtype.itemsize)
        alone = _compat.storage_use_count(torch.empty(0))
        blocks = self.blocks.setdefault(nbytes, [])
        block = next((b for b in blocks if _compat.storage_use_count(b) == alone), None)
        if block is None:
            block = torch.empty(nbytes, dtype=torch.uint8, device=config.device)
            blocks.append(block)
        out = torch.empty(0, dtype=dtype, device=config.device)
        return self.poison(out.set_(block.untyped_storage(), 0, shape))
