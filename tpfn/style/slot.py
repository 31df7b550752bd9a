"""Slots: one input or output of a module, and folding a chain of them into one.

>>> from tpfn.layout import Partial, Replicate, Shard
>>> Slot(Partial(), Replicate()).then(Slot(None, Shard(1)), "output 0")
Slot(given=Partial(), desired=Shard(dim=1))
"""

from __future__ import annotations

import itertools

import attrs

from tpfn.errors import LayoutError, StyleError
from tpfn.layout import Shard

__all__ = ["Slot", "fold", "fold_named"]


def _shard_compatible(a, b) -> bool:
    """Equal, or shards whose dims may coincide once the tensor's ndim is known."""
    return a == b or (isinstance(a, Shard) and isinstance(b, Shard) and a.parts == b.parts
                      and a.heads == b.heads and (a.dim < 0) != (b.dim < 0))


@attrs.frozen(cache_hash=True, repr=False)
class Slot:
    """One input or output: the layout it arrives in (``given``) and the one desired (``desired``).

    ``given=None`` accepts what arrives: a DTensor brings its own layout, a plain tensor is
    taken to be in ``desired`` already. A slot with neither is left alone. ``grad``: the
    layout the input's gradient is handed back in (None: ``given``'s cotangent)."""

    given: object = None
    desired: object = None
    grad: object = None

    def __attrs_post_init__(self):
        if self.desired is not None and self.desired == self.given:
            object.__setattr__(self, "desired", None)

    def __repr__(self):
        grad = "" if self.grad is None else f", grad={self.grad!r}"
        return f"Slot(given={self.given!r}, desired={self.desired!r}{grad})"

    @property
    def source(self):
        """The layout a plain tensor arriving here is taken to be in (``given``, else ``desired``)."""
        return self.given if self.given is not None else self.desired

    @property
    def out(self):
        """The layout after this slot (None: untouched)."""
        return self.given if self.desired is None else self.desired

    def fit(self, x, what: str) -> None:
        """Refuse, by the slot's name ``what``, a layout whose shard dim the tensor ``x`` lacks."""
        for layout in (self.given, self.desired):
            if isinstance(layout, Shard) and not -x.ndim <= layout.dim < x.ndim:
                raise LayoutError(f"{what} has {x.ndim} dim{'s' * (x.ndim != 1)} (shape {tuple(x.shape)}), so "
                                  f"it cannot be {layout!r}; lay it out on a dim in [{-x.ndim}, {x.ndim - 1}] "
                                  "(sequence_parallel(dim=...), Shard(...)), or hand it on with that many dims.")

    @property
    def untouched(self) -> bool:
        return self.given is None and self.desired is None

    def then(self, other: "Slot", where: str) -> "Slot":
        """This slot followed by ``other``: one slot, so one redistribution."""
        if self.untouched:
            return other
        if other.untouched:
            return self
        if other.grad is not None:
            raise StyleError(f"{where}: a later stage declares the gradient's layout (grads={other.grad!r}), "
                             "but the gradient is handed back from the first stage's given layout; declare "
                             "grads= on the first prepare_in of the chain.")
        if other.given is not None and not _shard_compatible(self.out, other.given):
            raise StyleError(f"{where}: one stage delivers {self.out!r} and the next declares it arrives "
                             f"as {other.given!r}; make the declarations agree (or leave given=None).")
        return Slot(self.given, other.out, self.grad)


def fold(slots_a: tuple, slots_b: tuple, where: str) -> tuple:
    """Positional slots ``slots_a`` followed by ``slots_b``, slot by slot."""
    pairs = itertools.zip_longest(slots_a, slots_b, fillvalue=Slot())
    out = tuple(a.then(b, f"{where} {i}") for i, (a, b) in enumerate(pairs))
    while out and out[-1].untouched:
        out = out[:-1]
    return out


def fold_named(a: tuple, b: tuple, where: str) -> tuple:
    """Named slots ``a`` followed by ``b`` (``((name, slot), ...)``, sorted by name)."""
    merged = dict(a)
    for name, slot in b:
        merged[name] = merged.get(name, Slot()).then(slot, f"{where} {name!r}")
    return tuple(sorted((k, v) for k, v in merged.items() if not v.untouched))
