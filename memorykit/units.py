"""Sizes as people read them: one formatter for every message of the pack (plain Python)."""
from __future__ import annotations

GIB = 1 << 30


def _three_digits(x: float) -> str:
    return f"{x:.0f}" if x >= 99.95 else f"{x:.1f}" if x >= 9.995 else f"{x:.2f}"


def size_text(n: float) -> str:
    """``n`` bytes in a unit that fits: ``26.62 GiB`` from 1 GiB up (two decimals, as the
    pack's figures always were), else three significant digits of MiB, KiB (``512 MiB``,
    ``10.2 MiB``, ``340 KiB``) or a count of bytes -- never ``0.00 GiB`` for a size that is
    not zero."""
    sign, n = ("-" if n < 0 else ""), abs(float(n))
    if n >= GIB:
        return f"{sign}{n / GIB:.2f} GiB"
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{sign}{_three_digits(n / size)} {unit}"
    return f"{sign}{round(n)} bytes"
