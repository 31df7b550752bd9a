"""Placements and layouts: where a tensor lives on one mesh dimension, and on all of them.

A *placement* says what one mesh dimension does to a tensor:

- ``Shard(dim)``: each rank holds one ``torch.chunk`` of tensor dimension ``dim``
  (``Shard(dim, parts=k)``: the dim packs ``k`` equal parts, e.g. a fused gate and up
  projection, and each rank holds its chunk of every part);
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
"""

from __future__ import annotations

from typing import Union

import attrs
from torch.distributed import tensor as _dt
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = [
    "Shard",
    "Replicate",
    "Partial",
    "Placement",
    "REDUCE_OPS",
    "as_layout",
    "is_placement",
    "normalize",
    "to_torch",
    "from_torch",
]

REDUCE_OPS = ("sum", "avg", "max", "min")


def _int(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"'{attribute.name}' must be {int!r} (got {value!r} that is a {type(value)!r})."
        )


def _reduce_op(instance, attribute, value):
    if not isinstance(value, str):
        raise TypeError(
            f"'{attribute.name}' must be {str!r} (got {value!r} that is a {type(value)!r})."
        )
    if value not in REDUCE_OPS:
        raise ValueError(f"'{attribute.name}' must be in {REDUCE_OPS!r} (got {value!r}).")


def _positive(instance, attribute, value):
    _int(instance, attribute, value)
    if value < 1:
        raise ValueError(f"'{attribute.name}' must be at least 1 (got {value!r}).")


@attrs.frozen(slots=True, repr=False)
class Shard:
    """Each rank holds one ``torch.chunk`` of tensor dimension ``dim`` (negative counts from the end).

    With ``parts=k`` the dim packs ``k`` equal parts side by side (a fused gate and up
    projection: ``parts=2``); each rank holds its chunk of every part, concatenated, so a
    local ``chunk(k)`` still separates the parts. DTensor calls this ``_StridedShard``.

    >>> Shard(0) == Shard(0), hash(Shard(0)) == hash(Shard(0))
    (True, True)
    >>> Shard(0, parts=2)
    Shard(dim=0, parts=2)
    """

    dim: int = attrs.field(validator=_int)
    parts: int = attrs.field(default=1, validator=_positive)

    def __repr__(self):
        return f"Shard(dim={self.dim})" if self.parts == 1 else f"Shard(dim={self.dim}, parts={self.parts})"


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
    raise TypeError(
        f"'{name}' must be a placement (Shard, Replicate, Partial) or a non-empty tuple of them "
        f"(got {layout!r} that is a {type(layout)!r})."
    )


def normalize(layout, ndim: int) -> tuple:
    """The layout with every ``Shard`` dim made non-negative for a tensor of ``ndim`` dims.

    >>> normalize((Shard(-2), Partial()), ndim=2)
    (Shard(dim=0), Partial())
    >>> normalize(Shard(2), ndim=2)
    Traceback (most recent call last):
    ...
    ValueError: Shard(dim=2) does not fit a tensor of 2 dims: a shard dim must lie in [-2, 1].
    """
    out = []
    for p in as_layout(layout):
        if isinstance(p, Shard):
            if not -ndim <= p.dim < ndim:
                raise ValueError(
                    f"{p!r} does not fit a tensor of {ndim} dims: "
                    f"a shard dim must lie in [{-ndim}, {ndim - 1}]."
                )
            p = Shard(p.dim % ndim, p.parts)
        out.append(p)
    return tuple(out)


def _placement_to_torch(p, ndim):
    if isinstance(p, Shard):
        if ndim is not None and not -ndim <= p.dim < ndim:
            raise ValueError(f"{p!r} does not fit a tensor of {ndim} dims: a shard dim must lie in "
                             f"[{-ndim}, {ndim - 1}].")
        dim = p.dim if ndim is None else p.dim % ndim
        return _StridedShard(dim, split_factor=p.parts) if p.parts > 1 else _dt.Shard(dim)
    if isinstance(p, Replicate):
        return _dt.Replicate()
    return _dt.Partial(p.op)


def to_torch(layout: Placement | tuple, ndim: int | None = None) -> tuple:
    """The ``torch.distributed.tensor`` placements of a layout (always a tuple); with ``ndim``,
    shard dims normalized for a tensor of that many dims.

    >>> to_torch(Shard(1))
    (Shard(dim=1),)
    >>> to_torch(Shard(-1), ndim=3)
    (Shard(dim=2),)
    >>> to_torch(Shard(0, parts=2))
    (_StridedShard(dim=0, sf=2),)
    >>> type(to_torch(Replicate())[0]).__module__
    'torch.distributed.tensor.placement_types'
    """
    return tuple(_placement_to_torch(p, ndim) for p in as_layout(layout))


def _placement_from_torch(p):
    if type(p) is _dt.Shard:
        return Shard(p.dim)
    if type(p) is _StridedShard:
        return Shard(p.dim, parts=p.split_factor)
    if type(p) is _dt.Replicate:
        return Replicate()
    if isinstance(p, _dt.Partial) and p.reduce_op in REDUCE_OPS:
        return Partial(p.reduce_op)
    raise ValueError(
        f"{p!r} has no tpfn layout: tpfn knows Shard, Replicate and Partial with op in "
        f"{REDUCE_OPS}; redistribute the DTensor to one of those first."
    )


def from_torch(placements) -> tuple:
    """The tpfn layout of ``torch.distributed.tensor`` placements (one or a sequence).

    >>> from torch.distributed.tensor import Shard as TorchShard, Partial as TorchPartial
    >>> from_torch([TorchShard(0), TorchPartial("max")])
    (Shard(dim=0), Partial(op='max'))
    """
    if isinstance(placements, _dt.Placement):
        placements = (placements,)
    return tuple(_placement_from_torch(p) for p in placements)
