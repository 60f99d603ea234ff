"""Peak bytes of the tensors Python-visible ATen calls allocate (CPU or GPU), for
checking an op's declared memory formula. Allocations inside one ATen kernel (e.g.
logsumexp's own temporary) are below the dispatch mode and not seen."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakTracker(TorchDispatchMode):
    """Counts each new storage an op returns until it is freed; ``peak`` is the most
    bytes alive at once. Storages of ``existing`` tensors are not counted."""

    def __init__(self, *existing: object) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._alive: set[int] = set()
        self._existing = {
            t.untyped_storage().data_ptr() for t in existing if isinstance(t, torch.Tensor)
        }

    def _free(self, key: int, nbytes: int) -> None:
        self._alive.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in self._alive or key in self._existing:
                continue
            self._alive.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, nbytes)
        return out
