import pytest

from mirrorgrad._units import format_bytes


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (3 * 2**19, "1.50 MiB"),
        (154.5 * 2**20, "154 MiB"),
        (2**30, "1.00 GiB"),
        (3000 * 2**30, "3,000 GiB"),
        (-(2**20), "-1.00 MiB"),
    ],
)
def test_picks_the_largest_unit_with_three_digits(nbytes, text):
    assert format_bytes(nbytes) == text


def test_fixed_unit_for_table_columns():
    assert format_bytes(5 * 2**30, "MiB") == "5,120"
    assert format_bytes(12_345, "MiB") == "0.0118"
    assert format_bytes(None, "MiB") == "—"
    with pytest.raises(ValueError, match="unit must be one of"):
        format_bytes(1, "MB")
