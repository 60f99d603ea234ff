"""Each private torch name in mirrorgrad._compat must resolve on this torch."""

from mirrorgrad import _compat


def test_torch_version_supported():
    assert _compat.TORCH_VERSION >= (2, 11)
