"""mirrorgrad.ops.aligned_mm: the padded product equals a @ b in every layout, and pads
only where cuBLAS's tensor cores need it (a CUDA device, a half type or TF32, a big
enough product)."""

import pytest
import torch

from mirrorgrad.ops import aligned_mm
from mirrorgrad.ops.aligned_mm import mm, padded_mm


def _layout(t: torch.Tensor, column_major: bool) -> torch.Tensor:
    return t.t().contiguous().t() if column_major else t


@pytest.mark.parametrize("a_col", [False, True])
@pytest.mark.parametrize("b_col", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_product_equals_the_plain_one(a_col, b_col, dtype):
    g = torch.Generator().manual_seed(0)
    a64 = torch.randn(37, 65, generator=g, dtype=torch.float64)
    b64 = torch.randn(65, 29, generator=g, dtype=torch.float64)
    a = _layout(a64.to(dtype), a_col)
    b = _layout(b64.to(dtype), b_col)
    got = padded_mm(a, b)
    assert got.shape == (37, 29)
    reference = a.double() @ b.double()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.double() - reference).abs().max() <= tolerance * reference.abs().max()


def test_the_pads_reach_16_bytes_on_every_leading_dimension(monkeypatch):
    seen = []
    real = torch.Tensor.__matmul__
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda x, y: seen.append((x, y)) or real(x, y))
    a = torch.randn(65, 37).t()  # column-major [37, 65]: its leading dimension is M = 37
    b = torch.randn(65, 29)  # row-major: N = 29
    padded_mm(a, b)
    (pa, pb), = seen
    for t in (pa, pb):
        ld = t.stride(0) if t.stride(1) == 1 else t.stride(1)
        assert ld * t.element_size() % 16 == 0
    assert pa.stride(0) == 1  # still column-major: the transpose's copy, not a transposing one


def test_out_and_accumulate():
    a, b = torch.randn(9, 5), torch.randn(5, 3)
    out = torch.zeros(9, 3)
    mm(a, b, out=out)
    mm(a, b, out=out, accumulate=True)
    torch.testing.assert_close(out, 2 * (a @ b))


def test_pads_only_on_cuda_where_they_pay(monkeypatch):
    big = torch.randn(700, 650), torch.randn(650, 2600)
    assert not aligned_mm.pads(*big)  # CPU
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda")))
    matmul = torch.backends.cuda.matmul  # a module object: monkeypatch cannot undo it
    was = matmul.allow_tf32
    try:
        matmul.allow_tf32 = True
        assert not aligned_mm.pads(*big)  # 700 rows: the pads cost more than they win
        assert aligned_mm.pads(torch.randn(4480, 650), torch.randn(650, 2600))
        shapes = ((4480, 650), (650, 2600), (650, 10000))
        x, w_ih, w = (torch.randn(*s).bfloat16() for s in shapes)
        assert not aligned_mm.pads(x, w_ih)  # bf16: an LSTM layer's product does not pay
        assert not aligned_mm.pads(x, w)  # nor the LM head's (its whole call ran slower)
        assert aligned_mm.pays_to_pad(1e12, 1e6, torch.bfloat16, "cuda")  # a big enough one
        assert not aligned_mm.pads(torch.randn(704, 656), torch.randn(656, 2624))  # aligned
        matmul.allow_tf32 = False
        # CUDA-core fp32 kernels: no 16-byte rule
        assert not aligned_mm.pads(torch.randn(4480, 650), torch.randn(650, 2600))
    finally:
        matmul.allow_tf32 = was
