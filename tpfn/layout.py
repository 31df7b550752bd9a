"""Placements and layouts: where a tensor lives on one mesh dimension, and on all of them.

A *placement* says what one mesh dimension does to a tensor:

- ``Shard(dim)``: each rank holds one ``torch.chunk`` of tensor dimension ``dim`` (with
  ``parts=``, its chunk of each packed part; with ``heads=h``, whole heads, each held by a
  group of ranks on more ranks than heads);
- ``Replicate()``: each rank holds the whole tensor;
- ``Partial(op)``: each rank holds a term; the tensor is their reduction by ``op``.

A *layout* is a tuple of placements, one per mesh dimension. Wherever a layout is
expected, a single placement stands for the 1-D layout ``(placement,)``.

>>> Shard(1)
Shard(dim=1)
>>> eval(repr(Partial("max"))) == Partial("max")
True
>>> as_layout(Shard(0))
(Shard(dim=0),)
>>> normalize(Shard(-1), ndim=3)
(Shard(dim=2),)
>>> Shard(0, parts=(64, 16, 16)), Shard(0, heads=8)
(Shard(dim=0, parts=(64, 16, 16)), Shard(dim=0, heads=8))
"""

from __future__ import annotations

from typing import Union

import attrs
import sympy
from torch.distributed import tensor as _dt

from tpfn._torch import StridedShard

__all__ = ["Shard", "Replicate", "Partial", "Placement", "REDUCE_OPS", "as_layout", "is_placement",
           "exact_in_torch", "normalize", "to_torch", "from_torch", "is_count", "symbolic"]

REDUCE_OPS = ("sum", "avg", "max", "min")


def _of_type(kind: type, attribute, value):
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(f"'{attribute.name}' must be {kind!r} (got {value!r} that is a {type(value)!r}).")


def _int(instance, attribute, value):
    _of_type(int, attribute, value)


def _reduce_op(instance, attribute, value):
    _of_type(str, attribute, value)
    if value not in REDUCE_OPS:
        raise ValueError(f"'{attribute.name}' must be in {REDUCE_OPS!r} (got {value!r}).")


def _positive(instance, attribute, value):
    _int(instance, attribute, value)
    if value < 1:
        raise ValueError(f"'{attribute.name}' must be at least 1 (got {value!r}).")


def is_count(value) -> bool:
    """Whether ``value`` is a positive int (not a bool): a number of parts, heads or ranks."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _parts(instance, attribute, value):
    if not isinstance(value, tuple):
        return _positive(instance, attribute, value)
    if len(value) < 2 or not all(map(is_count, value)):
        raise ValueError(f"'parts' must be a positive int or a tuple of two or more part "
                         f"sizes, each a positive int (got {value!r}).")


def _heads(instance, attribute, value):
    if value is None:
        return
    _positive(instance, attribute, value)
    if instance.parts != 1:
        raise ValueError(f"Shard(dim={instance.dim}, parts={instance.parts!r}, heads={value!r}): "
                         "a dim is either packed parts or heads, not both; shard fused q, k and v "
                         "with parts=(q, k, v), or split them into projections, each heads=...")


@attrs.frozen(slots=True, repr=False)
class Shard:
    """Each rank holds one ``torch.chunk`` of tensor dimension ``dim`` (negative counts from the end).

    With ``parts=k`` the dim packs ``k`` equal parts side by side (a fused gate and up
    projection: ``parts=2``); each rank holds its chunk of every part, concatenated, so a
    local ``chunk(k)`` still separates the parts. DTensor calls this ``_StridedShard``.
    ``parts=(q, k, v)`` gives the sizes of unequal parts (a GQA ``qkv_proj``: q wider than
    k and v): each rank holds its chunk of each, concatenated.

    With ``heads=h`` the dim is ``h`` equal heads (key/value heads): on ``n`` ranks that
    divide ``h`` it is ``Shard(dim)``; on ``n`` a multiple of ``h`` each head is held by a
    group of ``n // h`` consecutive ranks (KV heads replicated, as Megatron and vLLM do).

    DTensor has no placement for unequal parts nor for replicated heads (``exact_in_torch``): a
    parameter so laid out is a DTensor ``Shard(dim)`` of the rank-major concatenation of what the
    ranks hold (unequal parts), or ``(Shard(dim), Replicate())`` on a 2-D view of the mesh, heads by
    replicas (replicated heads); tpfn's checkpoints read and write its true values.

    >>> Shard(0) == Shard(0), hash(Shard(0)) == hash(Shard(0))
    (True, True)
    >>> Shard(0, parts=2), Shard(0, parts=(64, 16, 16)).sizes(96)
    (Shard(dim=0, parts=2), (64, 16, 16))
    >>> Shard(0, parts=(64, 16, 16)).sizes(100)
    Traceback (most recent call last):
    ...
    ValueError: Shard(dim=0, parts=(64, 16, 16)) packs parts of 64 + 16 + 16 = 96 in dim 0, which has 100.
    """

    dim: int = attrs.field(validator=_int)
    parts: int | tuple = attrs.field(default=1, validator=_parts)
    heads: int | None = attrs.field(default=None, validator=_heads, kw_only=True)

    def sizes(self, size) -> tuple:
        """The sizes of the parts packed in a dim of ``size`` (one part: ``(size,)``)."""
        if isinstance(self.parts, tuple):
            if not symbolic(size) and sum(self.parts) != size:
                raise ValueError(f"{self!r} packs parts of {' + '.join(map(str, self.parts))} = "
                                 f"{sum(self.parts)} in dim {self.dim}, which has {size}.")
            return self.parts
        if self.parts > 1 and not symbolic(size) and size % self.parts:
            raise ValueError(f"{self!r} needs dim {self.dim} to hold {self.parts} equal parts; "
                             f"it has {size}.")
        part = size / self.parts if symbolic(size) else size // self.parts
        return (part,) * self.parts

    def copies(self, n: int) -> int:
        """How many of ``n`` ranks hold each piece: ``n // heads`` where there are more ranks
        than heads (each head held by a group of ranks), else 1.

        >>> Shard(0, heads=2).copies(8), Shard(0, heads=2).copies(2), Shard(0).copies(8)
        (4, 1, 1)
        """
        return n // self.heads if self.heads is not None and n > self.heads else 1

    @property
    def count(self) -> int:
        """The number of parts packed in the dim."""
        return len(self.parts) if isinstance(self.parts, tuple) else self.parts

    def __repr__(self):
        extra = "" if self.parts == 1 else f", parts={self.parts!r}"
        extra += "" if self.heads is None else f", heads={self.heads!r}"
        return f"Shard(dim={self.dim}{extra})"


def symbolic(*values) -> bool:
    """Whether any of ``values`` is a symbolic size (a dry run's ``sympy`` expression)."""
    return any(isinstance(v, sympy.Basic) for v in values)


@attrs.frozen(slots=True)
class Replicate:
    """Each rank holds the whole tensor.

    >>> Replicate()
    Replicate()
    """


@attrs.frozen(slots=True, repr=False)
class Partial:
    """Each rank holds a term; the tensor is the reduction of the terms by ``op``.

    ``op`` is one of ``"sum"``, ``"avg"``, ``"max"``, ``"min"``.

    >>> Partial(), Partial("max")
    (Partial(), Partial(op='max'))
    """

    op: str = attrs.field(default="sum", validator=_reduce_op)

    def __repr__(self):
        return "Partial()" if self.op == "sum" else f"Partial(op={self.op!r})"


Placement = Union[Shard, Replicate, Partial]


def is_placement(value) -> bool:
    """Whether ``value`` is a tpfn placement (``Shard``, ``Replicate`` or ``Partial``)."""
    return isinstance(value, (Shard, Replicate, Partial))


def as_layout(layout, *, name: str = "layout") -> tuple:
    """The layout as a tuple of placements; a single placement is the 1-D layout.

    >>> as_layout((Shard(0), Replicate()))
    (Shard(dim=0), Replicate())
    >>> as_layout("S0")
    Traceback (most recent call last):
    ...
    TypeError: 'layout' must be a placement (Shard, Replicate, Partial) or a non-empty tuple of them (got 'S0' that is a <class 'str'>).
    """
    if is_placement(layout):
        return (layout,)
    if isinstance(layout, tuple) and layout and all(map(is_placement, layout)):
        return layout
    raise TypeError(f"'{name}' must be a placement (Shard, Replicate, Partial) or a non-empty tuple of "
                    f"them (got {layout!r} that is a {type(layout)!r}).")


def exact_in_torch(layout) -> bool:
    """Whether DTensor has a placement for every placement of ``layout``: not for unequal
    parts (``Shard(dim, parts=(q, k, v))``) nor for heads (``Shard(dim, heads=h)``).

    >>> exact_in_torch(Shard(0, parts=2)), exact_in_torch(Shard(0, parts=(4, 2, 2)))
    (True, False)
    """
    return not any(isinstance(p, Shard) and (isinstance(p.parts, tuple) or p.heads is not None)
                   for p in as_layout(layout))


def normalize(layout, ndim: int) -> tuple:
    """The layout with every ``Shard`` dim made non-negative for a tensor of ``ndim`` dims.

    >>> normalize((Shard(-2), Partial()), ndim=2)
    (Shard(dim=0), Partial())
    >>> normalize(Shard(2), ndim=2)
    Traceback (most recent call last):
    ...
    ValueError: Shard(dim=2) does not fit a tensor of 2 dims: a shard dim must lie in [-2, 1].
    """
    return tuple(attrs.evolve(p, dim=_dim(p, ndim)) if isinstance(p, Shard) else p for p in as_layout(layout))


def _dim(p: Shard, ndim: int) -> int:
    """``p``'s dim made non-negative for a tensor of ``ndim`` dims (no new ``Shard``: ``to_torch``
    runs inside compiled forwards, which cannot trace building one)."""
    if not -ndim <= p.dim < ndim:
        raise ValueError(f"{p!r} does not fit a tensor of {ndim} dims: a shard dim must lie in "
                         f"[{-ndim}, {ndim - 1}].")
    return p.dim % ndim


def _placement_to_torch(p, ndim):
    if isinstance(p, Shard):
        dim = p.dim if ndim is None else _dim(p, ndim)
        if isinstance(p.parts, int) and p.parts > 1:
            return StridedShard(dim, split_factor=p.parts)
        return _dt.Shard(dim)  # unequal parts, heads: the image of each rank's local tensor
    if isinstance(p, Replicate):
        return _dt.Replicate()
    return _dt.Partial(p.op)


def to_torch(layout: Placement | tuple, ndim: int | None = None) -> tuple:
    """The ``torch.distributed.tensor`` placements of a layout (always a tuple); with ``ndim``,
    shard dims normalized for a tensor of that many dims.

    Unequal parts and heads, which DTensor has no placement for (``exact_in_torch``), map to
    ``Shard(dim)``: what each rank holds, rank after rank on the 1-D mesh, the image tpfn
    gives such parameters (it moves no other tensor so laid out).

    >>> to_torch(Shard(1))
    (Shard(dim=1),)
    >>> to_torch(Shard(-1), ndim=3)
    (Shard(dim=2),)
    >>> to_torch(Shard(0, parts=2)), to_torch(Shard(0, parts=(4, 2, 2)))
    ((_StridedShard(dim=0, sf=2),), (Shard(dim=0),))
    >>> type(to_torch(Replicate())[0]).__module__
    'torch.distributed.tensor.placement_types'
    """
    return tuple(_placement_to_torch(p, ndim) for p in as_layout(layout))


def _placement_from_torch(p):
    if type(p) is _dt.Shard:
        return Shard(p.dim)
    if type(p) is StridedShard:
        return Shard(p.dim, parts=p.split_factor)
    if type(p) is _dt.Replicate:
        return Replicate()
    if isinstance(p, _dt.Partial) and p.reduce_op in REDUCE_OPS:
        return Partial(p.reduce_op)
    raise ValueError(f"{p!r} has no tpfn layout: tpfn knows Shard, Replicate and Partial with op in "
                     f"{REDUCE_OPS}; redistribute the DTensor to one of those first.")


def from_torch(placements) -> tuple:
    """The tpfn layout of ``torch.distributed.tensor`` placements (one or a sequence).

    >>> from torch.distributed.tensor import Shard as TorchShard, Partial as TorchPartial
    >>> from_torch([TorchShard(0), TorchPartial("max")])
    (Shard(dim=0), Partial(op='max'))
    """
    if isinstance(placements, _dt.Placement):
        placements = (placements,)
    return tuple(_placement_from_torch(p) for p in placements)
