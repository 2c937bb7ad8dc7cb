"""Bytes and counts: one meaning for every size in offload, one alignment.

- Decimal suffixes are powers of ten (k/K/KB = 10**3, M/MB = 10**6, G/GB = 10**9, T/TB =
  10**12), IEC suffixes are powers of two (KiB = 2**10 ... TiB = 2**40), as `df -H`/`df -h`,
  `fio` and disk vendors write them. A config, the planner's command line and the examples
  read sizes through `parse_bytes`; messages and reports write them through `format_bytes`
  (always IEC, so a printed size reads back as the same number).
- `ALIGNMENT` is the O_DIRECT unit (buffer addresses, file offsets, lengths): 4096 bytes.
  The native AIO engine checks the same number at load (`offload.storage.io`).
"""

from __future__ import annotations

import re
from typing import Union

__all__ = ["KiB", "MiB", "GiB", "TiB", "ALIGNMENT", "align_up", "parse_bytes", "parse_count",
           "format_bytes", "format_count"]

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

ALIGNMENT = 4096
"""Bytes: O_DIRECT alignment of buffer addresses, file offsets and lengths."""

_BYTE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
               "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": KiB, "mib": MiB, "gib": GiB,
               "tib": TiB}
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"


def align_up(n: int, multiple: int = ALIGNMENT) -> int:
    """`n` rounded up to a multiple of `multiple` (bytes or elements)."""
    if multiple <= 0:
        raise ValueError(f"alignment must be positive, got {multiple}")
    if n < 0:
        raise ValueError(f"cannot align a negative size: nbytes must be >= 0, got {n}")
    return -(-n // multiple) * multiple


def parse_bytes(text: Union[str, int, float]) -> int:
    """'80GiB', '80GB', '512G', '2TiB', '1.5e9', 1024 -> bytes (GB = 10**9, GiB = 2**30)."""
    if isinstance(text, bool):
        raise ValueError(f"cannot read {text!r} as a size")
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*" + _NUMBER + r"\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _BYTE_UNITS:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 80GiB, 512GB, 2TiB or a "
                         "number of bytes (GB = 10**9 bytes, GiB = 2**30)")
    return int(float(m.group(1)) * _BYTE_UNITS[unit])


def parse_count(text: Union[str, int, float]) -> int:
    """'7e9', '7B', '350M', '1.3b', '64k' -> a count (of parameters, say)."""
    if isinstance(text, bool):
        raise ValueError(f"cannot read {text!r} as a count")
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*" + _NUMBER + r"\s*([kKmMbBtT]?)\s*", str(text))
    if m is None:
        raise ValueError(f"cannot read {text!r} as a count; write e.g. 7e9, 7B or 350M")
    return int(float(m.group(1)) * _COUNT_UNITS[m.group(2).lower()])


def format_bytes(n: float, digits: int = 2) -> str:
    """Bytes in the largest IEC unit that keeps the number >= 1: '1.50 GiB', '12.00 KiB',
    '512 bytes'."""
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.{digits}f} {unit}"
    return f"{int(n)} bytes"


def format_count(n: int, digits: int = 2) -> str:
    """A count with a decimal suffix: '6.74B', '125.00M', '512'."""
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if abs(n) >= size:
            return f"{n / size:.{digits}f}{unit}"
    return str(int(n))
