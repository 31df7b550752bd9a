"""Sizes for a person: bytes, shapes, ranks, shares, and the collectives of one module and phase.

>>> fmt_bytes(12288), fmt_bytes(3 * 2**30), fmt_shape((8,)), fmt_ranks(0, 2), fmt_pct(0.25)
('12.0 KiB', '3.0 GiB', '(8,)', 'ranks 0-2', '25.0%')
"""

from __future__ import annotations

import sympy

from tpfn._fqn import generalize

__all__ = ["fmt_bytes", "fmt_seconds", "fmt_shape", "fmt_ranks", "fmt_pct", "fmt_ratio", "summary", "runs", "grouped"]


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


def fmt_seconds(s: float) -> str:
    """Seconds for a person, to three digits.

    >>> fmt_seconds(2.0), fmt_seconds(0.0459), fmt_seconds(2.56e-10), fmt_seconds(0)
    ('2 s', '45.9 ms', '0.000256 µs', '0 s')
    """
    for unit, scale in (("s", 1), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(s) >= scale or unit == "µs" or s == 0:
            return f"{s / scale:.3g} {unit}"


def fmt_shape(shape) -> str:
    """``'(10, 4)'``, ``'(8,)'``: a shape of ints or sympy expressions."""
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def fmt_ranks(first, last) -> str:
    """``'rank 3'`` or ``'ranks 0-2'``."""
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def fmt_pct(x) -> str:
    """A share as a percentage; a symbolic one as its formula; None as ``'-'``."""
    return "-" if x is None else str(x) if sympy.sympify(x).free_symbols else f"{100 * float(x):.1f}%"


def fmt_ratio(x) -> str:
    """A ratio, simplified, to two decimals (``'1.00'``); a symbolic one as its formula; None as ``'-'``."""
    if x is None:
        return "-"
    x = sympy.simplify(x)
    return str(x) if x.free_symbols else f"{float(x):.2f}"


def summary(kinds: dict) -> str:
    """The collectives of one module and phase, ``{kind: (count, bytes)}``, for a person.

    >>> summary({"all_reduce": (1, 28672), "all_gather": (2, 2**20)})
    '1 all_reduce 28.0 KiB; 2 all_gather 1.0 MiB'
    """
    return "; ".join(f"{n} {k} {fmt_bytes(b)}" for k, (n, b) in kinds.items()) or "-"


def runs(values) -> list:
    """``[(value, first, last)]``: each run of equal values, by position (of ranks, say).

    >>> runs([(3, 4), (3, 4), (1, 4)])
    [((3, 4), 0, 1), ((1, 4), 2, 2)]
    """
    out: list = []
    for i, value in enumerate(values):
        if out and out[-1][0] == value:
            out[-1][2] = i
        else:
            out.append([value, i, i])
    return [tuple(run) for run in out]


def grouped(named: list) -> list:
    """``(name or pattern, count, value)`` of ``(name, value)`` pairs, repeated blocks once.

    >>> grouped([("layers.0.w", 1), ("layers.1.w", 1), ("head", 2)])
    [('layers.*.w', 2, 1), ('head', 1, 2)]
    """
    groups: dict = {}
    for name, value in named:
        groups.setdefault((generalize(name), repr(value)), [name, 0, value])[1] += 1
    return [(generalize(n) if k > 1 else n, k, v) for n, k, v in groups.values()]
