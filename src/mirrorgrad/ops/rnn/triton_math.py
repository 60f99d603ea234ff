"""Device functions the kernels of both Triton layers (kernels.py, persistent_kernels.py)
share: the gate nonlinearities and a masked fp32 tile load."""

import triton
import triton.language as tl


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def tanh(x):
    # tanh via sigmoid: exact enough in fp32 and available in the interpreter too.
    return 2.0 * sigmoid(2.0 * x) - 1.0


@triton.jit
def tile(ptr, rows, cols, mask, width, offset):
    """fp32 tile ``ptr[rows, offset + cols]`` of a row-major matrix ``width`` wide."""
    return tl.load(ptr + rows[:, None] * width + offset + cols[None, :], mask=mask, other=0.0).to(
        tl.float32
    )

