"""Sizes for a person: bytes, and the collectives of one module and phase.

>>> fmt_bytes(12288), fmt_bytes(3 * 2**30)
('12.0 KiB', '3.0 GiB')
"""

from __future__ import annotations

import sympy

__all__ = ["fmt_bytes", "summary"]


def fmt_bytes(n) -> str:
    """Bytes for a person; a symbolic size as its formula.

    >>> fmt_bytes(512), fmt_bytes(12288), fmt_bytes(sympy.Symbol("b") * 8)
    ('512 B', '12.0 KiB', '8*b')
    """
    n = sympy.sympify(n)
    if n.free_symbols:
        return str(n)
    value = float(n)
    if abs(value) < 1024:
        return f"{value:g} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}"


def summary(kinds: dict) -> str:
    """The collectives of one module and phase, ``{kind: (count, bytes)}``, for a person.

    >>> summary({"all_reduce": (1, 28672), "all_gather": (2, 2**20)})
    '1 all_reduce 28.0 KiB; 2 all_gather 1.0 MiB'
    """
    return "; ".join(f"{n} {k} {fmt_bytes(b)}" for k, (n, b) in kinds.items()) or "-"
