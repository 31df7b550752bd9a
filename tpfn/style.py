"""Styles: frozen values that say how to parallelize one module, composed with ``>>``.

A style is a flat tuple of *stages*; ``>>`` concatenates them, read left to right as data
flow: inputs are prepared, the module computes, outputs are prepared.

>>> colwise() >> prepare_out(Replicate())
colwise() >> prepare_out(Replicate())
>>> prepare_in(Shard(1)) >> colwise() >> prepare_out(Replicate()) == (
...     prepare_in(Shard(1)) >> (colwise() >> prepare_out(Replicate())))
True
>>> identity() >> rowwise() == rowwise() == rowwise() >> identity()
True

Each input or output *slot* carries ``given`` (the layout a tensor arrives in) and
``desired`` (the layout wanted after it). Composition folds a chain of slots into one,
so a chain mounts as at most one redistribution per slot:
``rowwise() >> prepare_out(Shard(1))`` reduce-scatters the partial sums directly.

Stages:

- ``prepare_in(...)`` / ``prepare_out(...)``: slot layouts for inputs / outputs;
- ``colwise()``, ``rowwise()``, ``sequence_parallel()``: the *core*, how the module itself
  is sharded (parameters, the layout its computation takes and gives); ``on_shards(...)``
  states the same for any module;
- ``params(...)``, ``replicate()``: parameter placements for any module.

Inputs come before the core, outputs after it, at most one core; ``params`` go anywhere.
"""

from __future__ import annotations

import attrs

from tpfn.errors import StyleError
from tpfn.layout import Partial, Replicate, Shard, is_placement

__all__ = [
    "Style",
    "Slot",
    "Inputs",
    "Outputs",
    "Core",
    "OnShards",
    "Params",
    "colwise",
    "rowwise",
    "sequence_parallel",
    "on_shards",
    "replicate",
    "params",
    "prepare_in",
    "prepare_out",
    "identity",
]


def _placement_or_none(what: str, value):
    if value is not None and not is_placement(value):
        raise TypeError(
            f"{what} must be a placement (Shard, Replicate, Partial) or None "
            f"(got {value!r} that is a {type(value)!r})."
        )
    return value


def _flag(what: str, value):
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{what} must be True, False or None (got {value!r} that is a {type(value)!r}).")
    return value


def _shard_compatible(a, b) -> bool:
    """Equal, or shards whose dims may coincide once the tensor's ndim is known."""
    if a == b:
        return True
    return (isinstance(a, Shard) and isinstance(b, Shard) and a.parts == b.parts
            and (a.dim < 0) != (b.dim < 0))


@attrs.frozen
class Slot:
    """One input or output: the layout it arrives in (``given``) and the one wanted (``desired``).

    ``given=None`` accepts what arrives: a DTensor brings its own layout, a plain tensor is
    taken to be in ``desired`` already. A slot with neither is left alone.
    """

    given: object = None
    desired: object = None

    def __attrs_post_init__(self):
        if self.desired is not None and self.desired == self.given:
            object.__setattr__(self, "desired", None)

    @property
    def out(self):
        """The layout after this slot (None: untouched)."""
        return self.given if self.desired is None else self.desired

    @property
    def untouched(self) -> bool:
        return self.given is None and self.desired is None

    def then(self, other: "Slot", where: str) -> "Slot":
        """This slot followed by ``other``: one slot, so one redistribution."""
        if self.untouched:
            return other
        if other.untouched:
            return self
        if other.given is not None and not _shard_compatible(self.out, other.given):
            raise StyleError(
                f"{where}: one stage delivers {self.out!r} and the next declares it arrives as "
                f"{other.given!r}; make the declarations agree (or leave given=None)."
            )
        return Slot(self.given, other.out)


def _fold(slots_a: tuple, slots_b: tuple, where: str) -> tuple:
    n = max(len(slots_a), len(slots_b))
    pad = lambda s: s + (Slot(),) * (n - len(s))  # noqa: E731
    out = tuple(a.then(b, f"{where} {i}") for i, (a, b) in enumerate(zip(pad(slots_a), pad(slots_b))))
    while out and out[-1].untouched:
        out = out[:-1]
    return out


def _fold_named(a: tuple, b: tuple, where: str) -> tuple:
    merged = dict(a)
    for name, slot in b:
        merged[name] = merged.get(name, Slot()).then(slot, f"{where} {name!r}")
    return tuple(sorted((k, v) for k, v in merged.items() if not v.untouched))


def _slots_repr(slots: tuple, main: str, other: str) -> list:
    """Constructor arguments for slots: ``main`` layouts positionally, ``other`` by keyword."""
    args = [repr(getattr(s, main)) for s in slots]
    others = [getattr(s, other) for s in slots]
    if any(o is not None for o in others):
        args.append(f"{other}={others[0]!r}" if len(others) == 1 else f"{other}={tuple(others)!r}")
    return args


@attrs.frozen(repr=False)
class Inputs:
    """Stage: prepare positional and keyword inputs (see ``prepare_in``)."""

    slots: tuple = ()
    kwargs: tuple = ()
    local: object = None

    def __repr__(self):
        args = _slots_repr(self.slots, "given", "desired")
        if self.kwargs:
            pairs = {k: (s.given, s.desired) for k, s in self.kwargs}
            args.append(f"kwargs={pairs!r}")
        if self.local is not None:
            args.append(f"local={self.local!r}")
        return f"prepare_in({', '.join(args)})"


@attrs.frozen(repr=False)
class Outputs:
    """Stage: prepare positional or keyed outputs (see ``prepare_out``)."""

    slots: tuple = ()
    keys: tuple = ()
    local: object = None

    def __repr__(self):
        args = _slots_repr(self.slots, "desired", "given")
        if self.keys:
            pairs = {k: (s.given, s.desired) for k, s in self.keys}
            args.append(f"keys={pairs!r}")
        if self.local is not None:
            args.append(f"local={self.local!r}")
        return f"prepare_out({', '.join(args)})"


@attrs.frozen(repr=False)
class Core:
    """Stage: how the module itself is sharded: ``colwise``, ``rowwise`` or ``sequence_parallel``."""

    kind: str
    dim: int = 1
    parts: int = 1
    local: object = None

    def __repr__(self):
        args = [f"dim={self.dim}"] if self.kind == "sequence_parallel" and self.dim != 1 else []
        if self.parts != 1:
            args.append(f"parts={self.parts}")
        if self.local is not None:
            args.append(f"local={self.local!r}")
        return f"{self.kind}({', '.join(args)})"

    @property
    def outputs(self) -> tuple:
        """The layout the core's computation gives (independent of the module kind)."""
        return ({
            "colwise": Slot(Shard(-1, self.parts)),
            "rowwise": Slot(Partial(), Replicate()),
            "sequence_parallel": Slot(Shard(self.dim)),
        }[self.kind],)

    @property
    def default_local(self) -> bool:
        return self.kind != "sequence_parallel"


@attrs.frozen(repr=False)
class OnShards:
    """Stage: the module computes on local tensors in the layouts given (see ``on_shards``)."""

    wants: tuple = ()
    grads: tuple = ()
    output: object = None
    param_grads: tuple = ()
    local: object = None

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


@attrs.frozen(repr=False)
class Params:
    """Stage: parameter placements by name (``rest`` places every other parameter)."""

    rules: tuple = ()
    rest: object = None

    def __repr__(self):
        if not self.rules and self.rest == Replicate():
            return "replicate()"
        rules = dict(self.rules)
        if all(name.isidentifier() for name in rules):
            return f"params({', '.join(f'{k}={v!r}' for k, v in rules.items())})"
        return f"params(**{rules!r})"


def _well_formed(instance, attribute, stages):
    """Inputs before the core, outputs after it, at most one core, slot chains that agree."""
    seen_core = seen_outputs = None
    inputs, outputs, kwargs, keys = (), (), (), ()
    names: dict = {}
    for stage in stages:
        if isinstance(stage, Inputs):
            if seen_core or seen_outputs:
                raise StyleError(
                    f"{stage!r} comes after {seen_core or seen_outputs!r}: inputs are prepared before "
                    f"the module computes; put it first, e.g. {stage!r} >> {seen_core or seen_outputs!r}."
                )
            inputs = _fold(inputs, stage.slots, "input")
            kwargs = _fold_named(kwargs, stage.kwargs, "keyword input")
        elif isinstance(stage, (Core, OnShards)):
            if seen_core:
                raise StyleError(
                    f"{seen_core!r} >> {stage!r}: a style shards its module one way; bind "
                    "each to its own module in a plan."
                )
            if seen_outputs:
                raise StyleError(
                    f"{seen_outputs!r} comes before {stage!r}: outputs are prepared after the "
                    f"module computes; write {stage!r} >> {seen_outputs!r}."
                )
            seen_core = stage
            outputs = _fold(outputs, stage.outputs, "output")
        elif isinstance(stage, Outputs):
            seen_outputs = seen_outputs or stage
            outputs = _fold(outputs, stage.slots, "output")
            keys = _fold_named(keys, stage.keys, "output")
        elif isinstance(stage, Params):
            for name, placement in stage.rules:
                if names.get(name, placement) != placement:
                    raise StyleError(
                        f"parameter {name!r} is placed twice: {names[name]!r} and {placement!r}; "
                        "keep one."
                    )
                names[name] = placement
        else:
            raise TypeError(f"not a style stage: {stage!r}")
    rests = {s.rest for s in stages if isinstance(s, Params) and s.rest is not None}
    if len(rests) > 1:
        raise StyleError(f"every other parameter is placed twice: {sorted(map(repr, rests))}; keep one.")


@attrs.frozen(repr=False)
class Style:
    """How to parallelize one module: stages composed left to right with ``>>``.

    Equal by structure, hashable, and printed as the code that builds it.
    """

    stages: tuple = attrs.field(default=(), validator=_well_formed)

    def then(self, other: "Style") -> "Style":
        """This style followed by ``other`` in data flow (``self >> other``)."""
        if not isinstance(other, Style):
            raise TypeError(
                f"`>>` composes styles (colwise(), prepare_in(...), ...); got {other!r} that is "
                f"a {type(other)!r}."
            )
        return Style(self.stages + other.stages)

    def __rshift__(self, other: "Style") -> "Style":
        return self.then(other)

    def __rrshift__(self, other):
        raise TypeError(
            f"`>>` composes styles (colwise(), prepare_in(...), ...); got {other!r} that is "
            f"a {type(other)!r} on its left."
        )

    def __repr__(self):
        return " >> ".join(map(repr, self.stages)) or "identity()"

    @property
    def core(self):
        """The core stage (``Core`` or ``OnShards``), or None."""
        return next((s for s in self.stages if isinstance(s, (Core, OnShards))), None)


def _local(local):
    return _flag("'local'", local)


def _parts(parts):
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise TypeError(f"'parts' must be a positive int (got {parts!r} that is a {type(parts)!r}).")
    return parts


def colwise(*, parts: int = 1, local: bool | None = None) -> Style:
    """Shard an ``nn.Linear`` or ``nn.Embedding`` column-wise (its output features).

    - ``nn.Linear``: ``weight`` and ``bias`` become ``Shard(0)`` (output features).
    - ``nn.Embedding``: ``weight`` becomes ``Shard(1)`` (the embedding dim).
    - Input 0 is wanted ``Replicate()``; a plain tensor is taken to be replicated, a DTensor
      is redistributed. The backward all-reduces the input's gradient.
    - Output 0 is ``Shard(-1)``, handed on as a local tensor (``local=False``: a DTensor).
    - ``parts=k``: the output features pack ``k`` equal parts (a fused gate and up
      projection): each rank gets its slice of every part, ``Shard(0, parts=k)``, and its
      local output still ``chunk(k)``-s into the parts.

    Same as PyTorch's ``ColwiseParallel()``.

    >>> colwise()
    colwise()
    >>> prepare_in(Shard(1)) >> colwise() >> prepare_out(Replicate())
    prepare_in(Shard(dim=1)) >> colwise() >> prepare_out(Replicate())
    """
    return Style((Core("colwise", parts=_parts(parts), local=_local(local)),))


def rowwise(*, parts: int = 1, local: bool | None = None) -> Style:
    """Shard an ``nn.Linear`` or ``nn.Embedding`` row-wise (its input features / vocabulary).

    - ``nn.Linear``: ``weight`` becomes ``Shard(1)`` (input features), ``bias`` ``Replicate()``.
      Input 0 is wanted ``Shard(-1)``; a plain tensor is taken to be sharded so.
    - ``nn.Embedding``: ``weight`` becomes ``Shard(0)`` (vocabulary). Input 0, the token ids,
      is wanted ``Replicate()`` (PyTorch assumes ``Shard(-1)`` here unless told otherwise).
    - The computation leaves partial sums, ``Partial()``, reduced to output 0 as
      ``Replicate()`` by an all-reduce (``>> prepare_out(Shard(1))``: one reduce-scatter),
      handed on as a local tensor (``local=False``: a DTensor).
    - ``parts=k``: the input features pack ``k`` equal parts; ``weight`` becomes
      ``Shard(1, parts=k)`` and input 0 is wanted ``Shard(-1, parts=k)``.

    Same as PyTorch's ``RowwiseParallel()`` (with replicated ids for embeddings).

    >>> rowwise() >> prepare_out(Shard(1))
    rowwise() >> prepare_out(Shard(dim=1))
    """
    return Style((Core("rowwise", parts=_parts(parts), local=_local(local)),))


def sequence_parallel(dim: int = 1, *, local: bool | None = None) -> Style:
    """Run a module that acts on each position independently on a shard of the sequence.

    For norms and dropout (modules whose parameters, if any, are 1-D): every parameter
    becomes ``Replicate()`` (broadcast from ``src_rank``, so any initialization survives);
    input 0 is wanted ``Shard(dim)`` (a plain tensor is taken to be sharded so, a DTensor
    is redistributed); output 0 is ``Shard(dim)``, a DTensor (``local=True``: a local tensor).
    The parameters' gradients are partial sums over the slices; at the end of backward, those
    of all such parameters are summed in one all-reduce (``tpfn.grads``).

    Same as PyTorch's ``SequenceParallel(sequence_dim=dim)``.

    >>> sequence_parallel()
    sequence_parallel()
    >>> sequence_parallel(dim=0, local=True)
    sequence_parallel(dim=0, local=True)
    """
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"'dim' must be {int!r} (got {dim!r} that is a {type(dim)!r}).")
    return Style((Core("sequence_parallel", dim=dim, local=_local(local)),))


def on_shards(*wants, grads=None, output=None, param_grads=None, local: bool | None = None) -> Style:
    """The module computes on local tensors: its parameters' local shards, its inputs in ``wants``.

    For any module whose layouts you know (a mixture of experts, a per-head norm): tpfn then
    runs it like a built-in core, without DTensor's per-op dispatch.

    - ``wants``: per positional input, the layout the module computes with (``None``:
      untouched); the input is moved there once.
    - ``grads``: per input (or one for all), the layout of the gradient the module computes
      for it (default: ``wants``; an input replicated into a computation sharded on its
      output features gets ``Partial()`` gradients).
    - ``output``: the layout of the module's local output (``None``: handed on untouched).
    - ``param_grads``: parameter name -> layout of its local gradient where it differs from
      the parameter's own (a replicated parameter used on a shard gets ``Partial()``).

    ``colwise()`` on an ``nn.Linear`` is ``params(weight=Shard(0), bias=Shard(0)) >>
    on_shards(Replicate(), grads=Partial(), output=Shard(-1))``.

    >>> params(w=Shard(0)) >> on_shards(Replicate(), grads=Partial(), output=Partial())
    params(w=Shard(dim=0)) >> on_shards(Replicate(), grads=Partial(), output=Partial())
    >>> replicate() >> on_shards(param_grads={"weight": Partial()})
    replicate() >> on_shards(param_grads={'weight': Partial()})
    """
    wants = tuple(_placement_or_none(f"on_shards: input {i}", w) for i, w in enumerate(wants))
    if is_placement(grads):  # one layout for every input the module computes with
        grads = tuple(None if w is None else grads for w in wants)
    grads = wants if grads is None else _per_slot("on_shards: 'grads'", grads, len(wants),
                                                   "on_shards(Replicate(), grads=Partial())")
    output = _placement_or_none("on_shards: 'output'", output)
    rules = []
    for name, placement in (param_grads or {}).items():
        if not isinstance(name, str) or not is_placement(placement):
            raise TypeError(f"on_shards: 'param_grads' maps parameter names to placements "
                            f"(got {name!r}: {placement!r}).")
        rules.append((name, placement))
    return Style((OnShards(wants, grads, output, tuple(sorted(rules)), _local(local)),))


def replicate() -> Style:
    """Make the module's own parameters ``Replicate()`` DTensors; inputs and outputs untouched.

    Submodules keep theirs: give them a rule of their own (``"block.*": replicate()``) or
    name their parameters with ``params(**{"sub.weight": Replicate()})``.

    >>> replicate()
    replicate()
    """
    return Style((Params(rest=Replicate()),))


def params(**rules) -> Style:
    """Place the named parameters (dotted names reach into submodules); nothing else changes.

    For modules no built-in style knows: the module then computes on DTensors, so give it
    DTensor inputs (``prepare_in(..., local=False)``, the default) and prepare its outputs.

    >>> params(w1=Shard(0), w2=Shard(1))
    params(w1=Shard(dim=0), w2=Shard(dim=1))
    >>> params(**{"experts.w1": Shard(0)})
    params(**{'experts.w1': Shard(dim=0)})
    """
    for name, placement in rules.items():
        if not isinstance(placement, (Shard, Replicate)):
            raise TypeError(
                f"params: {name!r} must be Shard(dim) or Replicate() (got {placement!r} that is a "
                f"{type(placement)!r}); a parameter holds values, never pending partial sums."
            )
    return Style((Params(tuple(sorted(rules.items()))),))


def _per_slot(what: str, value, n: int, example: str) -> tuple:
    """One layout (or None) per slot from a layout, or a tuple of them."""
    if value is None:
        return (None,) * n
    if n == 0 and value != ():  # on_shards(grads=Partial()) with no inputs says nothing
        raise TypeError(f"{what} has no slots to apply to: give one positional layout per slot "
                        f"first (None: as it comes), e.g. {example}.")
    if is_placement(value):
        if n != 1:
            raise TypeError(f"{what} has one layout for {n} slots: give a tuple of {n} (None: untouched).")
        return (value,)
    if isinstance(value, tuple) and len(value) == n:
        return tuple(_placement_or_none(f"{what}[{i}]", v) for i, v in enumerate(value))
    raise TypeError(
        f"{what} must be a placement or a tuple of {n} placements/None "
        f"(got {value!r} that is a {type(value)!r})."
    )


def _named_slots(what: str, mapping, lone: str) -> tuple:
    """``name -> layout or (given, desired)``; a lone layout is the ``lone`` one of the pair,
    as the positional layouts are (inputs' given, outputs' desired)."""
    if mapping is None:
        return ()
    if not isinstance(mapping, dict):
        raise TypeError(f"{what} must be a dict of name -> (given, desired) (got {mapping!r}).")
    out = []
    for name, value in mapping.items():
        if not isinstance(name, str):
            raise TypeError(f"{what} keys must be strings (got {name!r} that is a {type(name)!r}).")
        if is_placement(value) or value is None:
            value = (value, None) if lone == "given" else (None, value)
        if not (isinstance(value, tuple) and len(value) == 2):
            raise TypeError(
                f"{what}[{name!r}] must be a placement or a (given, desired) pair (got {value!r})."
            )
        given, desired = (_placement_or_none(f"{what}[{name!r}]", v) for v in value)
        out.append((name, Slot(given, desired)))
    return tuple(sorted((n, s) for n, s in out if not s.untouched))


def prepare_in(*given, desired=None, kwargs=None, local: bool | None = None) -> Style:
    """Annotate and redistribute the module's inputs before it runs.

    - ``given``: one layout per positional input, the layout its local tensor is in
      (``None``: leave that input alone). A DTensor input must already have it.
    - ``desired``: the layout (or a tuple, one per input) to redistribute to; default: given.
    - ``kwargs``: keyword input name -> given layout or ``(given, desired)``.
    - ``local``: hand the module local tensors (default: DTensors).

    ``prepare_in(Shard(1), desired=Replicate())`` is PyTorch's
    ``PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())``.

    >>> prepare_in(Shard(1), None, desired=(Replicate(), None), kwargs={"mask": Replicate()})
    prepare_in(Shard(dim=1), desired=Replicate(), kwargs={'mask': (Replicate(), None)})
    """
    given = tuple(_placement_or_none(f"prepare_in: input {i}", g) for i, g in enumerate(given))
    wanted = _per_slot("prepare_in: 'desired'", desired, len(given),
                       "prepare_in(None, desired=Replicate())")
    slots = tuple(Slot(g, d) for g, d in zip(given, wanted))
    slots = _fold(slots, (), "input")
    named = _named_slots("prepare_in: 'kwargs'", kwargs, "given")
    return Style((Inputs(slots, named, _local(local)),))


def prepare_out(*desired, given=None, keys=None, local: bool | None = None) -> Style:
    """Annotate and redistribute the module's outputs after it runs.

    - ``desired``: one layout per positional output (a tensor, or the items of a tuple or
      list), ``None`` leaves that output alone.
    - ``given``: the layout (or a tuple, one per output) each local output is in; default:
      a DTensor's own, a plain tensor's taken to be ``desired``.
    - ``keys``: for dict outputs, key -> desired layout or ``(given, desired)``.
    - ``local``: hand on local tensors (default) or DTensors (``local=False``).

    ``prepare_out(Shard(0), given=Replicate())`` is PyTorch's
    ``PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))``.

    >>> prepare_out(Shard(0), given=Replicate())
    prepare_out(Shard(dim=0), given=Replicate())
    """
    desired = tuple(_placement_or_none(f"prepare_out: output {i}", d) for i, d in enumerate(desired))
    givens = _per_slot("prepare_out: 'given'", given, len(desired),
                       "prepare_out(None, given=Partial())")
    slots = _fold(tuple(Slot(g, d) for g, d in zip(givens, desired)), (), "output")
    named = _named_slots("prepare_out: 'keys'", keys, "desired")
    return Style((Outputs(slots, named, _local(local)),))


def identity() -> Style:
    """The style that changes nothing: ``identity() >> s == s == s >> identity()``.

    >>> identity()
    identity()
    """
    return Style()
