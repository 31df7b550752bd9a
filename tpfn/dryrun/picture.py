"""A picture of which rank holds which block of a tensor, in the spirit of JAX's
``visualize_array_sharding``: an inline SVG of the tensor, each block coloured by its rank.

- ``Shard(d)``: dim ``d`` cut into one block per rank, to scale (``torch.chunk``'s sizes,
  so uneven shards show); ``Shard(d, parts=k)`` (or ``parts=(q, k, v)``): each packed part
  cut so, the parts marked off; ``Shard(d, heads=h)`` over more ranks than heads: a block
  per head, labelled with the group of ranks that holds it;
- ``Replicate()``: one block every rank holds; a plain tensor (None) alike, dashed;
- ``Partial()``: a stack of whole-sized terms, one per rank, the tensor their sum.

Two dims are drawn: columns the last, rows the sharded one (else the one before the last);
the caption names them and the dims the picture stands for each index of.

>>> svg = picture((8, 4), Shard(0), 2)
>>> svg.startswith("<figure") and svg.count('class="block"') == 2
True
>>> "rank 1: rows 4-7 of 8" in svg and "ranks 0-1: (4, 4)" in svg
True
"""

from __future__ import annotations

from html import escape

import sympy

from tpfn.algebra import shard_ranges
from tpfn.dryrun.figures import local
from tpfn.dryrun.units import fmt_ranks, fmt_shape, runs
from tpfn.layout import Partial, Replicate, Shard

__all__ = ["picture", "colour", "PALETTE"]

# (fill, text) of each rank, round the palette past eight ranks
PALETTE = (("#4e79a7", "#fff"), ("#f28e2b", "#fff"), ("#59a14f", "#fff"), ("#e15759", "#fff"),
           ("#76b7b2", "#10302e"), ("#edc948", "#3a2f00"), ("#b07aa1", "#fff"), ("#9c755f", "#fff"))
_W, _H, _THIN = 168, 104, 18  # the largest box, and the height of a one-dim tensor
_STACK = 5  # the offset of each term of a partial sum behind the one in front


def colour(rank: int) -> tuple:
    """``(fill, text)`` colours of ``rank``."""
    return PALETTE[rank % len(PALETTE)]


def _number(x):
    x = sympy.sympify(x)
    return None if x.free_symbols else int(x)


def _axes(shape: tuple, layout) -> tuple:
    """(row dim or None, column dim or None) of the picture."""
    nd = len(shape)
    if nd < 2:
        return None, (0 if nd else None)
    if isinstance(layout, Shard) and layout.dim % nd != nd - 1:
        return layout.dim % nd, nd - 1
    return nd - 2, nd - 1


def _box(shape: tuple, row, col) -> tuple:
    """(width, height) in pixels: to scale within the largest box, thin bars for one dim."""
    if row is None:
        return _W, _THIN
    rows, cols = _number(shape[row]), _number(shape[col])
    ratio = 1.0 if rows is None or cols is None or cols == 0 else rows / cols
    if ratio * _W <= _H:
        return _W, max(_THIN, round(ratio * _W))
    return max(40, round(_H / ratio)), _H


def _cuts(size, layout: Shard, n) -> list:
    """``(start, stop, ranks, part)`` of each block along the sharded dim: its ends as
    fractions of the dim, the ranks holding it (several for a head held by a group; None for
    the ranks between the first and the last of a symbolic count, -1 for the last) and the
    packed part it is in. A symbolic size or count: even blocks."""
    whole, count = _number(size), _number(n)
    parts = 1 if layout.heads is not None else layout.count
    if whole is not None and count is not None:
        held: dict = {}
        for r in range(count):
            for p, (start, length) in enumerate(shard_ranges(whole, layout, count, r)):
                held.setdefault((start, length, p), []).append(r)
        return [(s / whole, (s + length) / whole, tuple(rs), p)
                for (s, length, p), rs in sorted(held.items()) if whole]
    ranks = [(r,) for r in range(count)] if count is not None else [(0,), (1,), None, (-1,)]
    return [((p + i / len(ranks)) / parts, (p + (i + 1) / len(ranks)) / parts, rs, p)
            for p in range(parts) for i, rs in enumerate(ranks)]


def _borders(size, layout: Shard) -> list:
    """Where the packed parts meet, as fractions of the dim."""
    if layout.heads is not None or layout.count == 1:
        return []
    whole = _number(size)
    if whole is None:
        return [p / layout.count for p in range(1, layout.count)]
    sizes = layout.sizes(whole)
    return [sum(sizes[:p]) / whole for p in range(1, len(sizes))]


def _who(ranks, n) -> str:
    """``'3'``, ``'2-3'``, ``'…'``, ``'t - 1'``: the ranks of a block."""
    if ranks is None:
        return "…"
    if ranks == (-1,):
        return str(n - 1)
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def _range(start: float, stop: float, size) -> str:
    whole = _number(size)
    if whole is None:
        return f"its share of {size}"
    a, b = round(start * whole), round(stop * whole)
    return "none" if a == b else f"{a}-{b - 1} of {whole}"


def _sharded(shape, layout: Shard, n, col, w: int, h: int) -> str:
    dim = layout.dim % len(shape)
    across = dim == col  # the dim runs along the columns
    axis = "columns" if across else "rows"
    packed = layout.heads is None and layout.count > 1
    out = []
    for start, stop, ranks, p in _cuts(shape[dim], layout, n):
        fill, ink = ("#d5dae1", "#333") if ranks is None else colour(ranks[0] if ranks[0] >= 0 else 3)
        x, y = (start * w, 0) if across else (0, start * h)
        bw, bh = ((stop - start) * w, h) if across else (w, (stop - start) * h)
        label = _who(ranks, n)
        who = "the ranks between" if ranks is None else f"rank{'s' if len(ranks) > 1 else ''} {label}"
        tip = f"{who}: {axis} {_range(start, stop, shape[dim])}" + (f" (part {p})" if packed else "")
        out.append(f'<rect class="block" x="{x:.1f}" y="{y:.1f}" width="{bw:.1f}" height="{bh:.1f}" '
                   f'fill="{fill}" stroke="#fff" stroke-width="1"><title>{escape(tip)}</title></rect>')
        if (bw if across else bh) >= 7 * len(label) + 6 and (bh if across else bw) >= 12:
            out.append(f'<text x="{x + bw / 2:.1f}" y="{y + bh / 2 + 4:.1f}" fill="{ink}">'
                       f"{escape(label)}</text>")
    for at in _borders(shape[dim], layout):
        x1, y1, x2, y2 = (at * w, 0, at * w, h) if across else (0, at * h, w, at * h)
        out.append(f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" '
                   'stroke="#1d2430" stroke-width="2.5"/>')
    return "".join(out)


def _whole(n, w: int, h: int, plain: bool) -> str:
    label = "every rank, plain" if plain else "every rank"
    tip = ("a plain tensor: every rank holds all of it" if plain
           else f"Replicate(): each of the {n} ranks holds all of it")
    dash = ' stroke-dasharray="4 3"' if plain else ""
    out = [f'<rect class="block" x="0.5" y="0.5" width="{w - 1}" height="{h - 1}" fill="#eef1f5" '
           f'stroke="#8792a2"{dash}><title>{escape(tip)}</title></rect>']
    count = _number(n)
    dots = list(range(min(count, 8))) if count is not None else [0, 1, 2, 3]
    if h >= 30:
        out.append(f'<text x="{w / 2:.1f}" y="{h / 2:.1f}" fill="#333">{label}</text>')
        y = h / 2 + 6
    else:
        y = (h - 8) / 2
    x = w / 2 - len(dots) * 5
    for i, r in enumerate(dots):
        out.append(f'<rect x="{x + 10 * i:.1f}" y="{y:.1f}" width="8" height="8" rx="2" '
                   f'fill="{colour(r)[0]}"/>')
    return "".join(out)


def _partial(n, w: int, h: int) -> str:
    count = _number(n)
    layers = min(count, 4) if count is not None else 4
    out = []
    for i in reversed(range(layers)):
        fill, ink = colour(i)
        tip = (f"rank {i}: a whole-sized term; the tensor is the sum of the {n} ranks' terms"
               + (" (the first 4 shown)" if i == 3 and (count is None or count > 4) else ""))
        out.append(f'<rect class="block" x="{i * _STACK + .5:.1f}" y="{i * _STACK + .5:.1f}" '
                   f'width="{w - 1}" height="{h - 1}" fill="{fill}" stroke="#fff" rx="2">'
                   f'<title>{escape(tip)}</title></rect>')
        if i == 0:
            out.append(f'<text x="{w / 2:.1f}" y="{h / 2 + 4:.1f}" fill="{ink}">sum of {n} terms</text>')
    return "".join(out)


def _caption(shape: tuple, row, col) -> str:
    parts = [f"rows: dim {row} ({shape[row]})"] if row is not None else []
    parts += [f"columns: dim {col} ({shape[col]})"] if col is not None else []
    rest = [d for d in range(len(shape)) if d not in (row, col)]
    if rest:
        parts.append("for each index of " + ", ".join(f"dim {d} ({shape[d]})" for d in rest))
    return " · ".join(parts)


def _locals(shape: tuple, layout, n) -> str:
    """``'ranks 0-2: (3, 4), rank 3: (1, 4)'``: each run of ranks holding one shape."""
    count = _number(n)
    if count is None:
        return f"each rank: {fmt_shape(local(shape, layout, n, 0))}"
    return ", ".join(f"{fmt_ranks(a, b)}: {fmt_shape(s)}"
                     for s, a, b in runs([local(shape, layout, n, r) for r in range(count)]))


def picture(shape: tuple, layout, n, *, name: str = "") -> str:
    """A ``<figure>``: the SVG of a tensor of global ``shape`` laid out ``layout`` (a
    placement, or None for a plain tensor) on ``n`` ranks, and a caption of its axes and of
    the shape each rank holds; ``name`` (the tensor's) goes in its ``data-tensor``."""
    row, col = _axes(shape, layout)
    w, h = _box(shape, row, col)
    if isinstance(layout, Shard):
        body = _sharded(shape, layout, n, col, w, h)
    elif isinstance(layout, Partial):
        body = _partial(n, w, h)
    else:
        body = _whole(n, w, h, layout is None or not isinstance(layout, Replicate))
    extra = (min(_number(n) or 4, 4) - 1) * _STACK if isinstance(layout, Partial) else 0
    label = f"{name} {layout!r}" if name else repr(layout)
    return (f'<figure class="pic" data-tensor="{escape(name)}"><svg width="{w + extra}" '
            f'height="{h + extra}" viewBox="0 0 {w + extra} {h + extra}" role="img" '
            f'aria-label="{escape(label)}">{body}</svg><figcaption><span>'
            f'{escape(_caption(shape, row, col))}</span><span>'
            f'{escape(_locals(shape, layout, n))}</span></figcaption></figure>')
