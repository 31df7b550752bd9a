"""The stages a style is made of, each validated when it is built.

- ``Inputs`` / ``Outputs``: slot layouts for a module's inputs / outputs (``prepare_in``,
  ``prepare_out``);
- ``Core``: a built-in way to shard the module itself (``colwise``, ``rowwise``,
  ``sequence_parallel``), whose meaning per module kind is a row of ``tpfn.plans.kinds``;
- ``OnShards``: the module computes on local tensors in the layouts given (``on_shards``);
- ``Params``: parameter placements by name (``params``, ``replicate``).

>>> Core("colwise", parts=2), Core("colwise", parts=(64, 16, 16)), Core("colwise", heads=8)
(colwise(parts=2), colwise(parts=(64, 16, 16)), colwise(heads=8))
>>> Core("bogus")
Traceback (most recent call last):
...
ValueError: 'kind' must be one of 'colwise', 'rowwise', 'sequence_parallel' (got 'bogus').
"""

from __future__ import annotations

import attrs

from tpfn.layout import Partial, Replicate, Shard, is_placement
from tpfn.style.slot import Slot

__all__ = ["Inputs", "Outputs", "Core", "OnShards", "Params", "CORES", "placement_or_none", "flag"]

CORES = ("colwise", "rowwise", "sequence_parallel")


def placement_or_none(what: str, value):
    """``value`` if it is a layout (Shard, Replicate, Partial) or None, else a TypeError."""
    if value is not None and not is_placement(value):
        raise TypeError(
            f"{what} must be a placement (Shard, Replicate, Partial) or None "
            f"(got {value!r} that is a {type(value)!r})."
        )
    return value


def flag(what: str, value):
    """``value`` if it is True, False or None, else a TypeError."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{what} must be True, False or None (got {value!r} that is a {type(value)!r}).")
    return value


def _valid(check, expected: str):
    """An attrs validator: ``check(value)`` or a TypeError naming the field."""
    def validate(instance, attribute, value):
        if not check(value):
            raise TypeError(f"'{attribute.name}' must be {expected} (got {value!r} that is a "
                            f"{type(value)!r}).")
    return validate


def _pairs(second):
    return lambda v: isinstance(v, tuple) and all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and second(p[1]) for p in v)


_local = _valid(lambda v: v is None or isinstance(v, bool), "True, False or None")
_layout = _valid(lambda v: v is None or is_placement(v), "a placement or None")
_layouts = _valid(lambda v: isinstance(v, tuple) and all(x is None or is_placement(x) for x in v),
                  "a tuple of placements or None")
_slots = _valid(lambda v: isinstance(v, tuple) and all(isinstance(x, Slot) for x in v),
                "a tuple of Slot")
_named = _valid(_pairs(lambda x: isinstance(x, Slot)), "a tuple of (name, Slot) pairs")
_rules = _valid(_pairs(is_placement), "a tuple of (name, placement) pairs")
_int = _valid(lambda v: isinstance(v, int) and not isinstance(v, bool), repr(int))
_count = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1  # noqa: E731
_parts = _valid(lambda v: _count(v) or (isinstance(v, tuple) and len(v) > 1 and all(map(_count, v))),
                "a positive int or a tuple of two or more positive ints")
_heads = _valid(lambda v: v is None or _count(v), "None or a positive int")


def _kind(instance, attribute, value):
    if value not in CORES:
        raise ValueError(f"'kind' must be one of {', '.join(map(repr, CORES))} (got {value!r}).")


def _slots_repr(slots: tuple, main: str, other: str) -> list:
    """Constructor arguments for slots: ``main`` layouts positionally, ``other`` by keyword."""
    args = [repr(getattr(s, main)) for s in slots]
    others = [getattr(s, other) for s in slots]
    if any(o is not None for o in others):
        args.append(f"{other}={others[0]!r}" if len(others) == 1 else f"{other}={tuple(others)!r}")
    return args


def _arity(instance, attribute, value):
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TypeError(f"'arity' must be None or an int >= 0 (got {value!r} that is a "
                        f"{type(value)!r}).")
    if value < len(instance.slots):
        raise ValueError(f"'arity' must be at least the number of positional layouts, "
                         f"{len(instance.slots)} (got {value!r}).")


@attrs.frozen(repr=False, cache_hash=True)
class Inputs:
    """Stage: prepare positional and keyword inputs (see ``prepare_in``); ``arity``: the
    number of positional inputs the module must be called with (None: any)."""

    slots: tuple = attrs.field(default=(), validator=_slots)
    kwargs: tuple = attrs.field(default=(), validator=_named)
    local: object = attrs.field(default=None, validator=_local)
    arity: object = attrs.field(default=None, validator=_arity)

    def __repr__(self):
        args = _slots_repr(self.slots, "given", "desired")
        grads = tuple(s.grad for s in self.slots)
        if any(g is not None for g in grads):  # where a gradient is handed back as terms
            args.append(f"grads={grads[0]!r}" if len(grads) == 1 else f"grads={grads!r}")
        if self.kwargs:
            pairs = {k: (s.given, s.desired) for k, s in self.kwargs}
            args.append(f"kwargs={pairs!r}")
        if self.local is not None:
            args.append(f"local={self.local!r}")
        if self.arity is not None:
            args.append(f"arity={self.arity!r}")
        return f"prepare_in({', '.join(args)})"


@attrs.frozen(repr=False, cache_hash=True)
class Outputs:
    """Stage: prepare positional or keyed outputs (see ``prepare_out``)."""

    slots: tuple = attrs.field(default=(), validator=_slots)
    keys: tuple = attrs.field(default=(), validator=_named)
    local: object = attrs.field(default=None, validator=_local)

    def __repr__(self):
        args = _slots_repr(self.slots, "desired", "given")
        if self.keys:
            pairs = {k: (s.given, s.desired) for k, s in self.keys}
            args.append(f"keys={pairs!r}")
        if self.local is not None:
            args.append(f"local={self.local!r}")
        return f"prepare_out({', '.join(args)})"


@attrs.frozen(repr=False, cache_hash=True)
class Core:
    """Stage: a built-in way to shard the module itself: ``colwise``, ``rowwise`` or
    ``sequence_parallel``."""

    kind: str = attrs.field(validator=_kind)
    dim: int = attrs.field(default=1, validator=_int)
    parts: int | tuple = attrs.field(default=1, validator=_parts)
    local: object = attrs.field(default=None, validator=_local)
    heads: int | None = attrs.field(default=None, validator=_heads)

    def __repr__(self):
        args = [f"dim={self.dim}"] if self.kind == "sequence_parallel" and self.dim != 1 else []
        if self.parts != 1:
            args.append(f"parts={self.parts!r}")
        if self.heads is not None:
            args.append(f"heads={self.heads!r}")
        if self.local is not None:
            args.append(f"local={self.local!r}")
        return f"{self.kind}({', '.join(args)})"

    @property
    def outputs(self) -> tuple:
        """The layout the core's computation gives (independent of the module kind)."""
        return ({
            "colwise": Slot(Shard(-1, self.parts, heads=self.heads)),
            "rowwise": Slot(Partial(), Replicate()),
            "sequence_parallel": Slot(Shard(self.dim)),
        }[self.kind],)

    @property
    def default_local(self) -> bool:
        """Whether the output is handed on as a local tensor unless ``local=`` says."""
        return self.kind != "sequence_parallel"


@attrs.frozen(repr=False, cache_hash=True)
class OnShards:
    """Stage: the module computes on local tensors in the layouts given (see ``on_shards``)."""

    wants: tuple = attrs.field(default=(), validator=_layouts)
    grads: tuple = attrs.field(default=(), validator=_layouts)
    output: object = attrs.field(default=None, validator=_layout)
    param_grads: tuple = attrs.field(default=(), validator=_rules)
    local: object = attrs.field(default=None, validator=_local)

    def __attrs_post_init__(self):
        if len(self.grads) != len(self.wants):
            raise TypeError(f"'grads' must have one layout per input ({len(self.wants)}), "
                            f"got {self.grads!r}.")

    def __repr__(self):
        args = [repr(w) for w in self.wants]
        uniform = {g for w, g in zip(self.wants, self.grads) if w is not None}
        if self.grads != self.wants:
            broadcast = len(uniform) == 1 and uniform != {None} and self.grads == tuple(
                None if w is None else next(iter(uniform)) for w in self.wants)
            args.append(f"grads={next(iter(uniform))!r}" if broadcast else f"grads={self.grads!r}")
        if self.output is not None:
            args.append(f"output={self.output!r}")
        if self.param_grads:
            args.append(f"param_grads={dict(self.param_grads)!r}")
        if self.local is not None:
            args.append(f"local={self.local!r}")
        return f"on_shards({', '.join(args)})"

    @property
    def outputs(self) -> tuple:
        return (Slot(self.output),) if self.output is not None else ()

    default_local = True


@attrs.frozen(repr=False, cache_hash=True)
class Params:
    """Stage: parameter placements by name (``rest`` places every other direct parameter)."""

    rules: tuple = attrs.field(default=(), validator=_rules)
    rest: object = attrs.field(default=None, validator=_layout)

    def __repr__(self):
        if not self.rules and self.rest == Replicate():
            return "replicate()"
        rules = dict(self.rules)
        if all(name.isidentifier() for name in rules):
            return f"params({', '.join(f'{k}={v!r}' for k, v in rules.items())})"
        return f"params(**{rules!r})"
