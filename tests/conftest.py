import os

import pytest
import torch

# Triton kernels run on the CPU through the interpreter in CI; on a GPU they run natively
# (the interpreter copies device tensors to the host, which CUDA Graph capture forbids).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
