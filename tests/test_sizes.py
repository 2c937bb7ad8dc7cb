"""offload.sizes: one meaning for every size. GB is 10**9 and GiB 2**30 (as `df -H`/`df -h`
write them), a printed size reads back as the same number, a size that cannot be read is a
ValueError that says how to write one, and alignment is pure integer arithmetic."""

from __future__ import annotations

import pytest

from offload.sizes import (
    ALIGNMENT,
    GiB,
    KiB,
    MiB,
    TiB,
    align_up,
    format_bytes,
    format_count,
    parse_bytes,
    parse_count,
)


def test_decimal_suffixes_are_powers_of_ten_and_iec_suffixes_powers_of_two():
    assert parse_bytes("1GB") == 10**9 and parse_bytes("1G") == 10**9 and parse_bytes("1g") == 10**9
    assert parse_bytes("1GiB") == 2**30 == GiB and parse_bytes("1gib") == GiB
    assert parse_bytes("80GiB") - parse_bytes("80GB") == 80 * (GiB - 10**9)
    assert parse_bytes("2TiB") == 2 * TiB and parse_bytes("2TB") == 2 * 10**12
    assert parse_bytes("512MiB") == 512 * MiB and parse_bytes("500MB") == 500 * 10**6
    assert parse_bytes("4KiB") == 4096 and parse_bytes("4kB") == 4000 and parse_bytes("4k") == 4000


def test_numbers_and_spacing():
    assert parse_bytes(" 1.5 GiB ") == 3 * GiB // 2
    assert parse_bytes("1.5e9") == 1_500_000_000 and parse_bytes("1e3KiB") == 1000 * KiB
    assert parse_bytes("4096") == 4096 and parse_bytes("12B") == 12
    assert parse_bytes(1024) == 1024 and parse_bytes(2.0e9) == 2 * 10**9
    assert parse_count("7e9") == parse_count("7B") == parse_count("7b") == 7 * 10**9
    assert parse_count("350M") == 350 * 10**6 and parse_count("64k") == 64_000
    assert parse_count(125) == 125


@pytest.mark.parametrize("text", ["80 gibibytes", "GiB", "", "1.2.3GB", "-1GB", "5Gi", "1 PB"])
def test_an_unreadable_size_is_a_value_error_that_says_how_to_write_one(text):
    with pytest.raises(ValueError, match=r"cannot read .* as a size; write e\.g\. 80GiB"):
        parse_bytes(text)


def test_a_bool_is_not_a_size_or_a_count():
    with pytest.raises(ValueError, match="True"):
        parse_bytes(True)
    with pytest.raises(ValueError, match="False"):
        parse_count(False)
    with pytest.raises(ValueError, match="7e9, 7B or 350M"):
        parse_count("seven")
    with pytest.raises(ValueError):
        parse_count("7GB")  # a count has no bytes


def test_format_bytes_is_iec_with_the_largest_unit_that_keeps_the_number_at_least_one():
    assert format_bytes(3 * GiB // 2) == "1.50 GiB"
    assert format_bytes(10**9) == "953.67 MiB"  # a decimal GB is not a GiB
    assert format_bytes(12 * KiB) == "12.00 KiB"
    assert format_bytes(2 * TiB, digits=1) == "2.0 TiB"
    assert format_bytes(1023) == "1023 bytes" and format_bytes(0) == "0 bytes"
    assert format_bytes(MiB - 1) == "1024.00 KiB"  # rounds in the unit; never "1.00 MiB" early
    assert format_count(6_740_000_000) == "6.74B" and format_count(512) == "512"


def _read_back(text: str) -> int:
    return parse_bytes(text.removesuffix(" bytes").replace(" ", ""))


@pytest.mark.parametrize("n", [0, 1, 1023, 4 * KiB, 3 * GiB // 2, 80 * GiB, 2 * TiB, 5 * TiB // 4])
def test_a_printed_size_reads_back_as_the_same_number(n):
    # Sizes that are whole hundredths of their unit print exactly, so parse them back exactly
    # (a decimal formatter would print 80 GiB as 85.90 GB and read back 85.9e9).
    assert _read_back(format_bytes(n)) == n, format_bytes(n)


def test_a_printed_size_reads_back_within_half_its_last_digit():
    for n in (7 * MiB + 1, 10**9, 123_456_789_012, 5555):
        text = format_bytes(n)
        unit = next(u for u in (TiB, GiB, MiB, KiB, 1) if n >= u)
        assert abs(_read_back(text) - n) <= unit / 200, (n, text)


def test_align_up_rounds_bytes_or_elements_and_refuses_nonsense():
    assert ALIGNMENT == 4096
    assert [align_up(n) for n in (0, 1, 4095, 4096, 4097)] == [0, 4096, 4096, 4096, 8192]
    assert align_up(17, 16) == 32 and align_up(16, 16) == 16 and align_up(5, 1) == 5
    with pytest.raises(ValueError, match="must be >= 0"):
        align_up(-1)
    with pytest.raises(ValueError, match="alignment must be positive"):
        align_up(3, 0)
