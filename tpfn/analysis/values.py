"""What a value is on the ranks: its layout as dims of factors, a partial sum, or a DTensor.

``Value(dims)`` is a local tensor laid out as ``dims`` (``tpfn.analysis.factors``: each dim a
tuple of factors, a factor tagged with a space where the ranks hold ``1/n`` of it, whole
where untagged); ``partial`` marks a partial sum (every rank holds the global shape, and the
value is their sum); ``dtensor`` a DTensor, whose ops DTensor computes by their global
meaning. ``grads`` names what a replicated value's gradient reaches: the parameters and the
module inputs and outputs it was computed from, whose gradients must stay whole on every rank.
Past a finding a value is not ``known``: the check follows it no further.

``value_of(layout, shape, spaces, where)`` is the ``Value`` of a local tensor a plan lays out
as ``layout`` (a new space for a shard); ``layout_of(value)`` the layout a value is in, where
one layout says it.

>>> from tpfn.analysis.spaces import Spaces
>>> from tpfn.layout import Shard
>>> spaces = Spaces()
>>> heads = value_of(Shard(-1, parts=3), (2, 5, 96), spaces, "'qkv' output")
>>> heads.dims
(((2, None),), ((5, None),), ((3, None), (32, 0)))
>>> layout_of(heads), layout_of(value_of(Shard(1), (2, 5, 96), spaces, "x"))
(Shard(dim=2, parts=3), Shard(dim=1))
"""

from __future__ import annotations

import attrs

from tpfn.analysis.factors import form, plain, spaces as held_spaces, tag
from tpfn.layout import Partial, Replicate, Shard

__all__ = ["Value", "value_of", "layout_of", "sharded"]


@attrs.frozen
class Value:
    """One tensor's layout on the ranks (see the module docstring)."""

    dims: tuple
    partial: bool = False
    dtensor: bool = False
    grads: frozenset = frozenset()
    since: str = ""  # where a partial sum was made (for the sentences that name it)
    known: bool = True  # False past a finding: what the ranks hold there is not followed further

    @property
    def replicated(self) -> bool:
        return self.known and not self.partial and not self.dtensor and not held_spaces(self.dims)



def sharded(value: Value | None) -> bool:
    """Whether ``value`` holds a shard of some dim (a local tensor)."""
    return value is not None and value.known and not value.dtensor and bool(held_spaces(value.dims))


def value_of(layout, shape: tuple, spaces, where: str, dtensor: bool = False, grads=frozenset()) -> Value:
    """The ``Value`` of a local tensor of global ``shape`` that a plan lays out as ``layout``
    (``Shard``: a new space of ``spaces``, made by ``where``; ``heads=h``: ``h`` heads, one per
    group of ranks; ``parts``: equal parts, each sharded, or unequal ones the space records)."""
    dims = plain(shape)
    if dtensor:
        return Value(dims, dtensor=True)
    if isinstance(layout, Partial):
        return Value(dims, partial=True, since=where)
    if not isinstance(layout, Shard) or not shape:
        return Value(dims, grads=frozenset(grads))
    d = layout.dim % len(shape)
    size = shape[d]
    space = spaces.new(f"{where} #{len(spaces.spaces)}", size)
    if isinstance(layout.parts, tuple):  # unequal parts: a split by them gives a space each
        spaces.spaces[space].parts = tuple(layout.parts)
        return Value(tag(dims, d, space))
    if layout.parts > 1 and size % layout.parts == 0:
        inner = size // layout.parts
        return Value(dims[:d] + (((layout.parts, None), (inner, space)),) + dims[d + 1:])
    if layout.heads is not None:
        spaces.units.setdefault(space, set()).add(layout.heads)
    return Value(tag(dims, d, space))


def layout_of(value: Value | None):
    """The layout ``value`` is in (``Replicate()``, ``Partial()``, ``Shard(d)`` with its parts and
    heads), or None where no one layout says it (a shard strided across a dim, two sharded dims,
    a DTensor's own)."""
    if value is None or value.dtensor or not value.known:
        return None
    if value.partial:
        return Partial()
    found = [(d, form(dim)) for d, dim in enumerate(value.dims) if form(dim) is not None]
    if not found:
        return Replicate()
    if len(found) > 1 or len(held_spaces(value.dims)) > 1:
        return None
    d, (outer, _, _, _) = found[0]
    factors = value.dims[d]
    if outer == 1:
        return Shard(d)
    if len(factors) == 2 and factors[0][1] is None:  # equal parts, each sharded
        return Shard(d, parts=outer)
    return None
