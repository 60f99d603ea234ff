import os

import pytest
import torch

# Triton kernels run on the CPU through the interpreter in CI; on a GPU they run natively
# (the interpreter copies device tensors to the host, which CUDA Graph capture forbids).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The LM head's fp32 passes on torch's ops: under the interpreter the Triton passes
    # tripled the training tests' time. test_linear_cross_entropy.py runs the fp32
    # kernels explicitly; on a GPU the shipped default runs.
    from mirrorgrad.ops.linear_cross_entropy import op as _lce_op

    _lce_op.TRITON_PASSES = tuple(d for d in _lce_op.TRITON_PASSES if d != torch.float32)

# Under pytest-xdist each worker takes its share of the cores: torch's default (every core
# in every process) makes the workers fight over them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // _WORKERS))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
