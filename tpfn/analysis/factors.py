"""A tensor's dims as factors: which part of each dim a sharded feature space occupies.

A dim is a tuple of factors ``(size, tag)``, outermost first, whose sizes multiply to the
dim's size (a size-1 dim has none). ``tag`` is ``None`` for a part every rank holds whole,
``REPEAT`` for a broadcast copy (``expand``), or the id of a feature space: the output
features of a column-wise candidate, which each rank would hold a contiguous ``1/n`` of.
Sharding a space chunks its factor, so a dim ``((2, None), (4, s), (8, None))`` (batch 2
times 4 heads of 8, as BLOOM flattens them) holds ``2 * 4/n * 8`` per rank: each rank's rows
are strided, and every op that treats the dim as a batch keeps them apart.

>>> dims = plain((2, 16, 32))
>>> dims = tag(dims, 2, 7)                               # a linear's 32 output features
>>> heads = view(dims, (2, 16, 32), (2, 16, 4, 8))       # its heads: 4 of 8
>>> heads
(((2, None),), ((16, None),), ((4, 7),), ((8, None),))
>>> view(heads, (2, 16, 4, 8), (32, 4, 8))               # batch and positions as one
(((32, None),), ((4, 7),), ((8, None),))
>>> local_shape(heads, 2, {})                             # rank 0 of 2: 2 heads
(2, 16, 2, 8)
"""

from __future__ import annotations

import math

__all__ = ["REPEAT", "Broken", "plain", "tag", "spaces", "view", "expand", "permute", "size", "form",
           "local_shape"]

REPEAT = "repeat"


class Broken(Exception):
    """An op that would mix a sharded space's features (or a shape this model cannot follow):
    its spaces, and why in words."""

    def __init__(self, spaces, why: str):
        super().__init__(why)
        self.spaces, self.why = tuple(spaces), why


def plain(shape) -> tuple:
    """The dims of a tensor of ``shape`` that every rank holds whole."""
    return tuple(((d, None),) if d != 1 else () for d in shape)


def tag(dims: tuple, dim: int, space: int) -> tuple:
    """``dims`` with dim ``dim`` wholly the features of ``space``."""
    n = size(dims[dim])
    return dims[:dim] + (((n, space),) if n != 1 else (),) + dims[dim + 1:]


def size(dim: tuple) -> int:
    return math.prod(f for f, _ in dim)


def spaces(dims) -> set:
    """The spaces a tuple of dims holds."""
    return {t for d in dims for _, t in d if isinstance(t, int)}


def form(dim: tuple):
    """``(outer, units, space, inner)`` of a dim holding one space: the sizes around it (a
    ``REPEAT`` copy counts as inner); None for a dim holding none."""
    found = [i for i, (_, t) in enumerate(dim) if isinstance(t, int)]
    if not found:
        return None
    i = found[0]
    return (math.prod(f for f, _ in dim[:i]), dim[i][0], dim[i][1],
            math.prod(f for f, _ in dim[i + 1:]))


def _merged(factors: list) -> list:
    """Neighbouring factors of one kind (whole, or copies) as one."""
    out: list = []
    for f, t in factors:
        if f == 1:
            continue
        if out and t == out[-1][1] and not isinstance(t, int):
            out[-1] = (out[-1][0] * f, t)
        else:
            out.append((f, t))
    return out


def view(dims: tuple, old: tuple, new: tuple, units: dict | None = None) -> tuple:
    """The dims of ``x.view(new)`` for ``x`` of shape ``old`` held as ``dims``. A space's
    factor split in two keeps its outer part (``units[space]`` records that size: the mesh
    must divide it); a view that cuts a space in another way raises ``Broken``."""
    queue = _merged([f for d in dims for f in d])
    out = []
    for d in new:
        if d == 1:
            out.append(())
            continue
        got, prod = [], 1
        while prod < d:
            if not queue:
                raise Broken(spaces(dims), f"a view from {tuple(old)} to {tuple(new)}")
            f, t = queue.pop(0)
            if prod * f <= d:
                got.append((f, t))
                prod *= f
                continue
            outer = d // prod
            if d % prod or f % outer:
                raise Broken({t} if isinstance(t, int) else spaces(dims),
                             f"a view from {tuple(old)} to {tuple(new)} that cuts across its features")
            if isinstance(t, int) and units is not None:
                units.setdefault(t, set()).add(outer)
            got.append((outer, t))
            queue.insert(0, (f // outer, None if isinstance(t, int) else t))
            prod = d
        if len([t for _, t in got if isinstance(t, int)]) > 1:
            raise Broken(spaces((tuple(got),)), f"a view from {tuple(old)} to {tuple(new)} that "
                         "merges two sharded dims")
        out.append(tuple(got))
    if queue:
        raise Broken(spaces(dims), f"a view from {tuple(old)} to {tuple(new)}")
    return tuple(out)


def expand(dims: tuple, old: tuple, new: tuple) -> tuple:
    """The dims of ``x.expand(new)``: new and size-1 dims become copies."""
    lead = len(new) - len(old)
    out = [((d, REPEAT),) if d != 1 else () for d in new[:lead]]
    for d, o, n in zip(dims, old, new[lead:]):
        out.append(d if o == n else ((n, REPEAT),) if n != 1 else ())
    return tuple(out)


def permute(dims: tuple, order) -> tuple:
    return tuple(dims[i] for i in order)


def local_shape(dims: tuple, n: int, units: dict) -> tuple:
    """A tensor's shape on rank 0 of ``n`` when each space is sharded: ``1/n`` of a space's
    factor where ``n`` divides its units; else one unit (a head held by ``n // units`` ranks),
    and the copies made of it next (``expand`` of a KV head) shrink to ``units / n`` of theirs."""
    out, few = [], None
    for dim in dims:
        size = 1
        for f, t in dim:
            if isinstance(t, int):
                u = min(units.get(t, {f}))
                few = u if u < n else None
                size *= f // u if few else -(-f // n)
                continue
            size *= f * few // n if t == REPEAT and few else f
            few = few if t == REPEAT else None
        out.append(size)
    return tuple(out)
