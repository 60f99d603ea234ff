"""Every private PyTorch name mirrorgrad touches, in one place.

Supported: torch 2.11 .. 2.14. Each name here has a test in tests/test_compat.py
that fails loudly when a torch release moves or changes it.
"""

from __future__ import annotations

import torch

TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split(".")[:2])  # type: ignore[assignment]
