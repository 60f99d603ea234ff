"""Every private PyTorch name mirrorgrad touches, in one place.

Supported: torch 2.11 .. 2.14. Each name here has a test in tests/test_compat.py
that fails loudly when a torch release moves or changes it.
"""

from __future__ import annotations

import torch

TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split(".")[:2])  # type: ignore[assignment]

# --- AOTAutograd / partitioner (used by graph/, mirror/, compile.py) ---------------
from torch._functorch.aot_autograd import aot_function, aot_module_simplified  # noqa: E402
from torch._functorch.partitioners import (  # noqa: E402
    _extract_fwd_bwd_modules as extract_fwd_bwd_modules,
)
from torch._functorch.partitioners import (  # noqa: E402
    default_partition,
    min_cut_rematerialization_partition,
)

__all__ = [
    "TORCH_VERSION",
    "aot_function",
    "aot_module_simplified",
    "default_partition",
    "extract_fwd_bwd_modules",
    "min_cut_rematerialization_partition",
]
