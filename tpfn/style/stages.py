"""The stages a style is made of, each validated when it is built.

- ``Inputs`` / ``Outputs``: slot layouts for a module's inputs / outputs (``prepare_in``,
  ``prepare_out``);
- ``Core``: a built-in way to shard the module itself (``colwise``, ``rowwise``,
  ``sequence_parallel``), whose meaning per module kind is a row of ``tpfn.plans.kinds``;
- ``OnShards``: the module computes on local tensors in the layouts given (``on_shards``);
- ``Params``: parameter placements by name (``params``, ``replicate``);
- ``PerRank``: attributes that hold their per-rank values inside the module's forward, and
  inputs laid out per head (``per_rank``).

>>> Core("colwise", parts=2), Core("colwise", parts=(64, 16, 16)), Core("colwise", heads=8)
(colwise(parts=2), colwise(parts=(64, 16, 16)), colwise(heads=8))
>>> Core("bogus")
Traceback (most recent call last):
...
ValueError: 'kind' must be one of 'colwise', 'rowwise', 'sequence_parallel' (got 'bogus').
"""

from __future__ import annotations

import attrs

from tpfn.layout import Partial, Replicate, Shard, is_count, is_placement
from tpfn.style.slot import Slot

__all__ = ["Inputs", "Outputs", "Core", "OnShards", "Params", "PerRank", "CORES", "placement_or_none", "flag"]

CORES = ("colwise", "rowwise", "sequence_parallel")


def _checked(what: str, value, ok: bool, expected: str):
    """``value`` if ``ok``, else a TypeError saying that ``what`` must be ``expected``."""
    if not ok:
        raise TypeError(f"{what} must be {expected} (got {value!r} that is a {type(value)!r}).")
    return value


def placement_or_none(what: str, value):
    """``value`` if it is a layout (Shard, Replicate, Partial) or None, else a TypeError."""
    return _checked(what, value, value is None or is_placement(value),
                    "a placement (Shard, Replicate, Partial) or None")


def flag(what: str, value):
    """``value`` if it is True, False or None, else a TypeError."""
    return _checked(what, value, value is None or isinstance(value, bool), "True, False or None")


def _valid(check, expected: str):
    """An attrs validator: ``check(value)`` or a TypeError naming the field."""
    return lambda instance, attribute, value: _checked(f"'{attribute.name}'", value, check(value), expected)


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
_parts = _valid(lambda v: is_count(v) or (isinstance(v, tuple) and len(v) > 1 and all(map(is_count, v))),
                "a positive int or a tuple of two or more positive ints")
_heads = _valid(lambda v: v is None or is_count(v), "None or a positive int")


def _kind(instance, attribute, value):
    if value not in CORES:
        raise ValueError(f"'kind' must be one of {', '.join(map(repr, CORES))} (got {value!r}).")


def _constructor_repr(name: str, args: list, **options) -> str:
    """The constructor call ``name(*args, key=value, ...)``, leaving out the options that are None."""
    args = [*args, *(f"{k}={v!r}" for k, v in options.items() if v is not None)]
    return f"{name}({', '.join(args)})"


def _one_or_tuple(values):
    """One value per slot as one keyword argument: the lone value, else the tuple (None: all None)."""
    values = tuple(values)
    return None if all(v is None for v in values) else values[0] if len(values) == 1 else values


def _arity(instance, attribute, value):
    if value is None:
        return
    _checked("'arity'", value, isinstance(value, int) and not isinstance(value, bool) and value >= 0,
             "None or an int >= 0")
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
        return _constructor_repr("prepare_in", [repr(s.given) for s in self.slots],
                                 desired=_one_or_tuple(s.desired for s in self.slots),
                                 grads=_one_or_tuple(s.grad for s in self.slots),
                                 kwargs={k: (s.given, s.desired) for k, s in self.kwargs} or None,
                                 local=self.local, arity=self.arity)


@attrs.frozen(repr=False, cache_hash=True)
class Outputs:
    """Stage: prepare positional or keyed outputs (see ``prepare_out``)."""

    slots: tuple = attrs.field(default=(), validator=_slots)
    keys: tuple = attrs.field(default=(), validator=_named)
    local: object = attrs.field(default=None, validator=_local)

    def __repr__(self):
        return _constructor_repr("prepare_out", [repr(s.desired) for s in self.slots],
                                 given=_one_or_tuple(s.given for s in self.slots),
                                 keys={k: (s.given, s.desired) for k, s in self.keys} or None,
                                 local=self.local)


@attrs.frozen(repr=False, cache_hash=True)
class Core:
    """Stage: a built-in way to shard the module itself: ``colwise``, ``rowwise`` or ``sequence_parallel``."""

    kind: str = attrs.field(validator=_kind)
    dim: int = attrs.field(default=1, validator=_int)
    parts: int | tuple = attrs.field(default=1, validator=_parts)
    local: object = attrs.field(default=None, validator=_local)
    heads: int | None = attrs.field(default=None, validator=_heads)

    def __repr__(self):
        args = [f"dim={self.dim}"] if self.kind == "sequence_parallel" and self.dim != 1 else []
        return _constructor_repr(self.kind, args, parts=None if self.parts == 1 else self.parts,
                                 heads=self.heads, local=self.local)

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

    desired: tuple = attrs.field(default=(), validator=_layouts)
    grads: tuple = attrs.field(default=(), validator=_layouts)
    output: object = attrs.field(default=None, validator=_layout)
    param_grads: tuple = attrs.field(default=(), validator=_rules)
    local: object = attrs.field(default=None, validator=_local)

    def __attrs_post_init__(self):
        if len(self.grads) != len(self.desired):
            raise TypeError(f"'grads' must have one layout per input ({len(self.desired)}), "
                            f"got {self.grads!r}.")

    def __repr__(self):
        grads = None
        if self.grads != self.desired:  # one layout for every input computed with, or one each
            uniform = {g for w, g in zip(self.desired, self.grads) if w is not None}
            broadcast = len(uniform) == 1 and uniform != {None} and self.grads == tuple(
                None if w is None else next(iter(uniform)) for w in self.desired)
            grads = next(iter(uniform)) if broadcast else self.grads
        return _constructor_repr("on_shards", [repr(w) for w in self.desired], grads=grads,
                                 output=self.output, param_grads=dict(self.param_grads) or None,
                                 local=self.local)

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


def _path(name) -> bool:
    return isinstance(name, str) and all(part.isidentifier() for part in name.split("."))


_paths = _valid(lambda v: isinstance(v, tuple) and v == tuple(sorted(set(v))) and all(map(_path, v)),
                "a sorted tuple of attribute paths ('num_heads', 'config.num_attention_heads')")
_per_head = _valid(_pairs(is_count), "a tuple of (input name, number of heads) pairs")


@attrs.frozen(repr=False, cache_hash=True)
class PerRank:
    """Stage: inside the module's forward, the attributes ``names`` hold their per-rank values
    and the ``inputs`` their heads' rows (see ``per_rank``): each attribute divided by the mesh
    size, or as ``heads`` key/value heads are held (``colwise(heads=h)``), or, with
    ``per_head``, by the ranks that share one of that many heads.

    >>> PerRank(("num_heads",)).divisor(4), PerRank(("n_kv",), heads=2).divisor(4)
    (4, 2)
    >>> PerRank(("num_key_value_groups",), per_head=2).divisor(4), PerRank(("n",), heads=2).divisor(3)
    (2, None)
    """

    names: tuple = attrs.field(default=(), validator=_paths)
    heads: int | None = attrs.field(default=None, validator=_heads)
    per_head: int | None = attrs.field(default=None, validator=_heads)
    inputs: tuple = attrs.field(default=(), validator=_per_head)

    def __attrs_post_init__(self):
        if self.heads is not None and self.per_head is not None:
            raise TypeError(f"per_rank(heads={self.heads!r}, per_head={self.per_head!r}): an attribute "
                            "counts heads or things per head, not both; give each its own per_rank(...) "
                            "and compose them with >>.")

    def __repr__(self):
        return _constructor_repr("per_rank", [repr(n) for n in self.names], heads=self.heads,
                                 per_head=self.per_head, inputs=dict(self.inputs) or None)

    def divisor(self, n: int) -> int | None:
        """What the named attributes are divided by on ``n`` ranks (None: ``n`` neither divides
        nor is a multiple of the heads, so no rank holds whole heads)."""
        h = self.heads or self.per_head
        if h is None:
            return n
        if h % n and n % h:
            return None
        return min(n, h) if self.heads else n // min(n, h)

    def rules(self) -> tuple:
        """``((kind, name, rule), ...)``: each attribute and input with the stage that says it alone."""
        return (*(("attribute", n, attrs.evolve(self, names=(n,), inputs=())) for n in self.names),
                *(("input", n, PerRank(inputs=((n, h),))) for n, h in self.inputs))
