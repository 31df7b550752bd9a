"""``Style``: stages composed left to right with ``>>``, and its normal form, folded once.

A style is a flat tuple of stages; ``>>`` concatenates them, read as data flow: inputs are
prepared, the module computes, outputs are prepared. When a style is built its stages are
checked and folded into one ``Normal`` value (a chain of slots becomes one slot, so each input
and output is redistributed at most once); everything that needs the style reads that.

>>> from tpfn.style.constructors import colwise, prepare_in, prepare_out
>>> from tpfn.layout import Replicate, Shard
>>> s = prepare_in(Shard(1)) >> colwise() >> prepare_out(Replicate())
>>> s.normal.inputs.slots, s.normal.outputs.slots
((Slot(given=Shard(dim=1), desired=None),), (Slot(given=Shard(dim=-1), desired=Replicate()),))
"""

from __future__ import annotations

import functools

import attrs

from tpfn.errors import StyleError
from tpfn.style.slot import fold, fold_named
from tpfn.style.stages import Core, Inputs, OnShards, Outputs, Params, PerRank

__all__ = ["Style", "Normal"]


@attrs.frozen
class Normal:
    """A style folded: one ``Inputs`` (the stages before the core), the core (None, a
    ``Core`` or an ``OnShards``), one ``Outputs`` (the core's output, then the output
    stages), the named parameter placements and the placement of every other direct one, the
    attributes that hold per-rank values (``(name, PerRank)``, sorted) and the inputs laid out
    per head (``(name, heads)``, sorted)."""

    inputs: Inputs = Inputs()
    core: object = None
    outputs: Outputs = Outputs()
    params: tuple = ()
    rest: object = None
    sizes: tuple = ()
    per_head: tuple = ()


def _last(a, b):
    return a if b is None else b


@functools.lru_cache(maxsize=4096)
def normal_form(stages: tuple) -> Normal:
    """The ``Normal`` of ``stages``, or a ``StyleError`` saying what cannot mean anything."""
    core = outputs_seen = None
    inputs, outputs = Inputs(), Outputs()
    names, rests, held = {}, set(), {}
    for stage in stages:
        if isinstance(stage, Inputs):
            if core or outputs_seen:
                first = core or outputs_seen
                raise StyleError(f"{stage!r} comes after {first!r}: inputs are prepared before "
                                 f"the module computes; put it first, e.g. {stage!r} >> {first!r}.")
            inputs = Inputs(fold(inputs.slots, stage.slots, "input"),
                            fold_named(inputs.kwargs, stage.kwargs, "keyword input"),
                            _last(inputs.local, stage.local), _last(inputs.arity, stage.arity))
        elif isinstance(stage, (Core, OnShards)):
            if core:
                raise StyleError(f"{core!r} >> {stage!r}: a style shards its module one way; bind "
                                 "each to its own module in a plan.")
            if outputs_seen:
                raise StyleError(f"{outputs_seen!r} comes before {stage!r}: outputs are prepared after "
                                 f"the module computes; write {stage!r} >> {outputs_seen!r}.")
            core = stage
            outputs = Outputs(fold(outputs.slots, stage.outputs, "output"), outputs.keys, stage.local)
        elif isinstance(stage, Outputs):
            outputs_seen = outputs_seen or stage
            outputs = Outputs(fold(outputs.slots, stage.slots, "output"),
                              fold_named(outputs.keys, stage.keys, "output"),
                              _last(outputs.local, stage.local))
        elif isinstance(stage, Params):
            for name, placement in stage.rules:
                if names.get(name, placement) != placement:
                    raise StyleError(f"parameter {name!r} is placed twice: {names[name]!r} and "
                                     f"{placement!r}; keep one.")
                names[name] = placement
            if stage.rest is not None:
                rests.add(stage.rest)
        elif isinstance(stage, PerRank):
            for what, name, rule in stage.rules():
                if held.setdefault((what, name), rule) != rule:
                    raise StyleError(f"{what} {name!r} is held per rank two ways, {held[what, name]!r} "
                                     f"and {rule!r}; keep one.")
        else:
            raise TypeError(f"not a style stage: {stage!r}")
    if len(rests) > 1:
        raise StyleError(f"every other parameter is placed twice: {sorted(map(repr, rests))}; keep one.")
    return Normal(inputs, core, outputs, tuple(sorted(names.items())), next(iter(rests), None),
                  tuple((n, r) for (w, n), r in sorted(held.items()) if w == "attribute"),
                  tuple((n, r.inputs[0][1]) for (w, n), r in sorted(held.items()) if w == "input"))


def _stages(instance, attribute, value):
    if not isinstance(value, tuple):
        raise TypeError(f"'stages' must be a tuple of stages (got {value!r}).")


def _not_a_style(other, side: str) -> TypeError:
    return TypeError(f"`>>` composes styles (colwise(), prepare_in(...), ...); got {other!r} that is "
                     f"a {type(other)!r}{side}.")


@attrs.frozen(repr=False, cache_hash=True)
class Style:
    """How to parallelize one module: stages composed left to right with ``>>``; equal by
    structure, hashable, and printed as the code that builds it; ``normal`` is its folded form."""

    stages: tuple = attrs.field(default=(), validator=_stages)
    normal: Normal = attrs.field(init=False, eq=False, hash=False, repr=False)

    def __attrs_post_init__(self):
        object.__setattr__(self, "normal", normal_form(self.stages))

    def then(self, other: "Style") -> "Style":
        """This style followed by ``other`` in data flow (``self >> other``)."""
        if not isinstance(other, Style):
            raise _not_a_style(other, "")
        return Style(self.stages + other.stages)

    __rshift__ = then

    def __rrshift__(self, other):
        raise _not_a_style(other, " on its left")

    def __repr__(self):
        return " >> ".join(map(repr, self.stages)) or "identity()"

    @property
    def core(self):
        """The core stage (``Core`` or ``OnShards``), or None."""
        return self.normal.core
