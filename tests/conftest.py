import os

import pytest
import torch

# Triton kernels run on the CPU through the interpreter in CI.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
