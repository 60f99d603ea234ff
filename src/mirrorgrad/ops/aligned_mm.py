"""Matrix products on the fast tensor-core kernels whatever the width of the operands' rows.

cuBLAS takes its fast kernels only where every operand's leading dimension is a multiple
of 16 bytes. A row of 650 elements (the word LM's hidden size) is not, and on an H200 the
medium LM's products then run 1.4x (700 rows) to 3x (4,480 rows) as long as at 656 with
``align1``/``align2`` kernels (benchmarks/gemm_alignment.py). `mm` zero-pads the misaligned
dimensions to 16 bytes, multiplies and returns the product's real block: zero rows and
columns add nothing, so the values are those of ``a @ b`` up to the order of the sums. It
pads only where the copies pay (`pays_to_pad`): on a CUDA device, in a half type or TF32,
and where the product has enough FLOPs per byte copied; elsewhere it is ``a @ b``.
"""

from __future__ import annotations

import torch
from torch import Tensor

ALIGN_BYTES = 16
# FLOPs of the products per byte the pads copy above which padding paid on an H200
# (benchmarks/gemm_alignment.py, lce_padding.py, copies included). TF32 (half bf16's rate)
# paid from ~800: an LSTM layer's products at 4,480 rows ran 1.5-1.9x faster, the LM head's
# whole call (1,550-2,300) 3.69 -> 2.98 ms; neither paid at 700 rows (~300-490). In bf16
# the head's products alone ran 2.4-2.8x faster at 4,480 rows, but its whole call
# (3,100-4,600) ran slower padded (2.89 -> 3.13 ms): no bf16 call measured has paid yet.
MIN_FLOPS_PER_COPIED_BYTE = {torch.float32: 600.0, torch.bfloat16: 8000.0, torch.float16: 8000.0}


def aligned_width(n: int, dtype: torch.dtype) -> int:
    """``n`` rounded up to a multiple of 16 bytes of ``dtype``."""
    per = max(1, ALIGN_BYTES // dtype.itemsize)
    return -(-n // per) * per


def pays_to_pad(flops: float, copied_bytes: float, dtype: torch.dtype, device) -> bool:
    """Whether products of ``flops`` in all, whose pads copy ``copied_bytes``, run faster
    padded: on CUDA, in a half type or fp32 with TF32 allowed (CUDA-core fp32 kernels
    have no 16-byte rule to meet)."""
    if torch.device(device).type != "cuda" or dtype not in MIN_FLOPS_PER_COPIED_BYTE:
        return False
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return False
    return flops >= MIN_FLOPS_PER_COPIED_BYTE[dtype] * max(copied_bytes, 1.0)


def width_to_run(width: int, flops: float, copied_elements: float, dtype: torch.dtype,
                 device) -> int:  # fmt: skip
    """The width products of ``flops`` in all should run at: ``width`` padded to 16 bytes
    where it is misaligned and the pads, copying ``copied_elements`` elements of
    ``dtype``, pay (`pays_to_pad`); else ``width``."""
    padded_width = aligned_width(width, dtype)
    if padded_width == width:
        return width
    pays = pays_to_pad(flops, copied_elements * dtype.itemsize, dtype, device)
    return padded_width if pays else width


def _row_major(t: Tensor) -> bool:
    return t.stride(1) == 1


def _leading_ok(t: Tensor) -> bool:
    """cuBLAS's vector loads: a leading dimension and a start on 16 bytes."""
    ld = t.stride(0) if _row_major(t) else t.stride(1)
    return (ld * t.element_size()) % ALIGN_BYTES == 0 and t.data_ptr() % ALIGN_BYTES == 0


def _padded_shapes(a: Tensor, b: Tensor) -> tuple[int, int, int]:
    """(Mp, Kp, Np): K is a's leading dimension (row-major a) or b's (column-major b), M
    is a's (column-major a), N is b's (row-major b) and the product's."""
    M, K, N = a.shape[0], a.shape[1], b.shape[1]
    a_row, b_row = _row_major(a), _row_major(b)
    Kp = aligned_width(K, a.dtype) if a_row or not b_row else K
    Mp = M if a_row else aligned_width(M, a.dtype)
    return Mp, Kp, aligned_width(N, a.dtype)


def pads(a: Tensor, b: Tensor) -> bool:
    """Whether `mm` runs ``a @ b`` padded."""
    if a.dim() != 2 or b.dim() != 2 or a.dtype != b.dtype:
        return False
    M, K, N = a.shape[0], a.shape[1], b.shape[1]
    if _leading_ok(a) and _leading_ok(b) and (N * a.element_size()) % ALIGN_BYTES == 0:
        return False
    Mp, Kp, Np = _padded_shapes(a, b)
    copied = M * K * ((Mp, Kp) != (M, K)) + K * N * ((Kp, Np) != (K, N)) + M * N * (Np != N)
    return pays_to_pad(2.0 * M * N * K, copied * a.element_size(), a.dtype, a.device)


def padded(t: Tensor, rows: int, cols: int) -> Tensor:
    """``t`` zero-padded to [rows, cols] in one write; column-major where ``t`` is (a
    transposed view's copy is its transpose's copy)."""
    r, c = t.shape
    if (r, c) == (rows, cols) and _leading_ok(t):
        return t
    if t.stride(0) == 1 and t.stride(1) != 1:
        return padded(t.t(), cols, rows).t()
    return pad_into(t.new_empty(rows, cols), t)


def pad_into(buffer: Tensor, t: Tensor) -> Tensor:
    """``buffer`` [rows, cols] holding ``t`` [r, c] and zeros past it, in one write
    (``buffer`` may be reused workspace: the zeros are written every time)."""
    r, c = t.shape
    buffer[:r, :c].copy_(t)
    if buffer.shape[1] > c:
        buffer[:, c:].zero_()
    if buffer.shape[0] > r:
        buffer[r:, :c].zero_()
    return buffer


def padded_mm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` with every leading dimension padded to 16 bytes: the real block of the
    padded product (a strided view where N was padded)."""
    M, N = a.shape[0], b.shape[1]
    Mp, Kp, Np = _padded_shapes(a, b)
    return (padded(a, Mp, Kp) @ padded(b, Kp, Np))[:M, :N]


def mm(a: Tensor, b: Tensor, *, out: Tensor | None = None, accumulate: bool = False) -> Tensor:
    """``a @ b`` ([M, K] @ [K, N]), run padded where that pays (`pads`).

    ``out``: written (or added to, with ``accumulate``) and returned. Without ``out`` the
    result may be a strided view of a padded product: ``.contiguous()`` where the caller
    needs one."""
    if not pads(a, b):
        if out is None:
            return a @ b
        return out.addmm_(a, b) if accumulate else torch.mm(a, b, out=out)
    product = padded_mm(a, b)
    if out is None:
        return product
    return out.add_(product) if accumulate else out.copy_(product)
