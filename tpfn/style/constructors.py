"""The style constructors: each returns a ``Style`` of one stage, composed with ``>>``.

>>> colwise() >> prepare_out(Replicate())
colwise() >> prepare_out(Replicate())
>>> prepare_in(Shard(1)) >> colwise() >> prepare_out(Replicate()) == (
...     prepare_in(Shard(1)) >> (colwise() >> prepare_out(Replicate())))
True
>>> identity() >> rowwise() == rowwise() == rowwise() >> identity()
True

Each input or output *slot* carries ``given`` (the layout a tensor arrives in) and ``desired`` (the
layout desired after it). Composition folds a chain of slots into one, so a chain mounts as at most
one redistribution per slot: ``rowwise() >> prepare_out(Shard(1))`` reduce-scatters the partial sums
directly. Inputs come before the core, outputs after it, at most one core; ``params`` go anywhere.
"""

from __future__ import annotations

from tpfn.layout import Partial, Placement, Replicate, Shard, is_count, is_placement
from tpfn.style.slot import Slot, fold
from tpfn.style.stages import Core, Inputs, OnShards, Outputs, Params, PerRank, flag, placement_or_none
from tpfn.style.style import Style

__all__ = ["colwise", "rowwise", "sequence_parallel", "on_shards", "replicate", "params", "prepare_in",
           "prepare_out", "per_rank", "identity"]


def _local(local):
    return flag("'local'", local)


def _parts(parts):
    if isinstance(parts, list):
        parts = tuple(parts)
    if isinstance(parts, tuple) and not (len(parts) > 1 and all(map(is_count, parts))):
        raise TypeError(f"'parts' must be a positive int (equal parts) or a tuple of two or more "
                        f"positive part sizes, e.g. parts=(64, 16, 16) (got {parts!r}).")
    if not isinstance(parts, tuple) and not is_count(parts):
        raise TypeError(f"'parts' must be a positive int (got {parts!r} that is a {type(parts)!r}).")
    return parts


def _heads(heads, parts):
    if heads is None:
        return None
    if not is_count(heads):
        raise TypeError(f"'heads' must be a positive int, the number of heads the output features "
                        f"are (got {heads!r} that is a {type(heads)!r}).")
    if parts != 1:
        raise TypeError(f"colwise(parts={parts!r}, heads={heads!r}): 'heads' replicates the heads "
                        "of one projection, 'parts' packs several; give one (split a fused q, k, "
                        "v into projections to replicate k and v).")
    return heads


def colwise(*, parts: int | tuple = 1, heads: int | None = None, local: bool | None = None) -> Style:
    """Shard an ``nn.Linear`` or ``nn.Embedding`` column-wise (its output features); a
    convolution on its output channels; a norm between convolutions on its channels.

    - ``nn.Linear``: ``weight`` and ``bias`` become ``Shard(0)`` (output features).
    - ``nn.Embedding``: ``weight`` becomes ``Shard(1)`` (the embedding dim).
    - ``nn.Conv1d/2d/3d``: ``weight`` ``(out, in, *kernel)`` and ``bias`` become ``Shard(0)``,
      output 0 ``Shard(1)`` (channels); ``nn.ConvTranspose*`` alike (its weight is ``(in, out,
      *kernel)``: ``Shard(1)``). A grouped or depthwise one (``groups > 1``) computes on whole
      groups: input 0 ``Shard(1)`` too, ``groups`` per rank.
    - ``nn.BatchNorm1d/2d/3d``, ``nn.GroupNorm``: on each rank's channels, ``Shard(1)`` in and
      out, ``weight``, ``bias`` and the running statistics ``Shard(0)`` (a GroupNorm's
      ``num_groups`` per rank).
    - Input 0 is desired ``Replicate()``; a plain tensor is taken to be replicated, a DTensor
      is redistributed. The backward all-reduces the input's gradient.
    - Output 0 is ``Shard(-1)``, handed on as a local tensor (``local=False``: a DTensor).
    - ``parts=k``: the output features pack ``k`` equal parts (a fused gate and up
      projection): each rank gets its slice of every part, ``Shard(0, parts=k)``, and its
      local output still ``chunk(k)``-s into the parts. ``parts=(q, k, v)``: parts of those
      sizes (a GQA ``qkv_proj``, q wider than k and v): each rank gets its slice of each,
      and its local output splits by the local sizes (``q // n``, ``k // n``, ``v // n``).
    - ``heads=h``: the output features are ``h`` heads (key or value heads). Over ranks
      that divide ``h`` this is ``colwise()``; over a multiple of ``h`` each head is held by
      a group of ``n // h`` consecutive ranks (KV heads replicated, as Megatron and vLLM
      do), ``Shard(0, heads=h)``, and the weight's gradient is summed within each group at
      the end of the backward (each copy sees only its own ranks' query heads).

    Same as PyTorch's ``ColwiseParallel()``.

    >>> colwise()
    colwise()
    >>> colwise(parts=(64, 16, 16)), colwise(heads=8)
    (colwise(parts=(64, 16, 16)), colwise(heads=8))
    >>> prepare_in(Shard(1)) >> colwise() >> prepare_out(Replicate())
    prepare_in(Shard(dim=1)) >> colwise() >> prepare_out(Replicate())
    >>> import torch.nn as nn, tpfn
    >>> conv = tpfn.resolve(colwise(), nn.Conv2d(3, 8, 3))[0]
    >>> conv.params, conv.shards.output
    ((('bias', Shard(dim=0)), ('weight', Shard(dim=0))), Shard(dim=1))
    """
    parts = _parts(parts)
    return Style((Core("colwise", parts=parts, local=_local(local), heads=_heads(heads, parts)),))


def rowwise(*, parts: int | tuple = 1, local: bool | None = None) -> Style:
    """Shard an ``nn.Linear`` or ``nn.Embedding`` row-wise (its input features / vocabulary).

    - ``nn.Linear``: ``weight`` becomes ``Shard(1)`` (input features), ``bias`` ``Replicate()``.
      Input 0 is desired ``Shard(-1)``; a plain tensor is taken to be sharded so.
    - ``nn.Embedding``: ``weight`` becomes ``Shard(0)`` (vocabulary). Input 0, the token ids,
      is desired ``Replicate()`` (PyTorch assumes ``Shard(-1)`` here unless told otherwise).
    - ``nn.Conv1d/2d/3d``: ``weight`` ``(out, in, *kernel)`` becomes ``Shard(1)`` (input
      channels), ``bias`` ``Replicate()``; input 0 is desired ``Shard(1)`` (``nn.ConvTranspose*``:
      its weight ``(in, out, *kernel)`` ``Shard(0)``). A grouped convolution is refused:
      ``colwise()`` shards its groups.
    - The computation leaves partial sums, ``Partial()``, reduced to output 0 as
      ``Replicate()`` by an all-reduce (``>> prepare_out(Shard(1))``: one reduce-scatter),
      handed on as a local tensor (``local=False``: a DTensor).
    - ``parts=k``: the input features pack ``k`` equal parts; ``weight`` becomes
      ``Shard(1, parts=k)`` and input 0 is desired ``Shard(-1, parts=k)``; ``parts=(a, b)``:
      parts of those sizes, as a ``colwise(parts=(a, b))`` before it hands them on.

    Same as PyTorch's ``RowwiseParallel()`` (with replicated ids for embeddings).

    >>> rowwise() >> prepare_out(Shard(1))
    rowwise() >> prepare_out(Shard(dim=1))
    >>> import torch.nn as nn, tpfn
    >>> tpfn.resolve(rowwise(), nn.Conv1d(8, 4, 3))[0].params
    (('bias', Replicate()), ('weight', Shard(dim=1)))
    """
    return Style((Core("rowwise", parts=_parts(parts), local=_local(local)),))


def sequence_parallel(dim: int = 1, *, local: bool | None = None) -> Style:
    """Run a module that acts on each position independently on a shard of the sequence.

    For norms and dropout (modules whose parameters, if any, are 1-D): every parameter
    becomes ``Replicate()`` (broadcast from ``src_rank``, so any initialization survives);
    input 0 is desired ``Shard(dim)`` (a plain tensor is taken to be sharded so, a DTensor
    is redistributed); output 0 is ``Shard(dim)``, a DTensor (``local=True``: a local tensor).
    The parameters' gradients are partial sums over the slices; at the end of backward, those
    of all such parameters are summed in one all-reduce (``tpfn.interpret.state``).

    Same as PyTorch's ``SequenceParallel(sequence_dim=dim)``.

    >>> sequence_parallel()
    sequence_parallel()
    >>> sequence_parallel(dim=0, local=True)
    sequence_parallel(dim=0, local=True)
    """
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"'dim' must be {int!r} (got {dim!r} that is a {type(dim)!r}).")
    return Style((Core("sequence_parallel", dim=dim, local=_local(local)),))


def on_shards(*desired: Placement | None, grads: Placement | tuple | None = None,
              output: Placement | None = None, param_grads: dict | None = None,
              local: bool | None = None) -> Style:
    """The module computes on local tensors: its parameters' local shards, its inputs in ``desired``.

    For any module whose layouts you know (a mixture of experts, a per-head norm): tpfn then
    runs it like a built-in core, without DTensor's per-op dispatch.

    - ``desired``: per positional input, the layout the module computes with (``None``:
      untouched); the input is moved there once.
    - ``grads``: per input (or one for all), the layout of the gradient the module computes
      for it (default: ``desired``; an input replicated into a computation sharded on its
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
    desired = tuple(placement_or_none(f"on_shards: input {i}", w) for i, w in enumerate(desired))
    if is_placement(grads):  # one layout for every input the module computes with
        if not desired:
            raise TypeError(f"on_shards: 'grads' has no inputs to apply to: give one layout per input first "
                            f"(None: untouched), e.g. on_shards(Replicate(), grads={grads!r}).")
        grads = tuple(None if w is None else grads for w in desired)
    grads = desired if grads is None else _per_slot("on_shards: 'grads'", grads, len(desired),
                                                   "on_shards(Replicate(), grads=Partial())")
    output = placement_or_none("on_shards: 'output'", output)
    param_grads = param_grads or {}
    for name, placement in param_grads.items():
        if not isinstance(name, str) or not is_placement(placement):
            raise TypeError(f"on_shards: 'param_grads' maps parameter names to placements "
                            f"(got {name!r}: {placement!r}).")
    return Style((OnShards(desired, grads, output, tuple(sorted(param_grads.items())), _local(local)),))


def replicate() -> Style:
    """Make the module's own parameters ``Replicate()`` DTensors; inputs and outputs untouched.

    Submodules keep theirs: give them a rule of their own (``"block.*": replicate()``) or
    name their parameters with ``params(**{"sub.weight": Replicate()})``.

    >>> replicate()
    replicate()
    """
    return Style((Params(rest=Replicate()),))


def params(**rules: Shard | Replicate) -> Style:
    """Place the named parameters and buffers (dotted names reach into submodules); nothing
    else changes.

    For modules no built-in style knows: the module then computes on DTensors, so give it
    DTensor inputs (``prepare_in(..., local=False)``, the default) and prepare its outputs;
    or, followed by ``on_shards(...)``, on the local shards of both. A placed buffer is a
    DTensor buffer (not a parameter): saved and loaded with its layout, never trained.

    >>> params(w1=Shard(0), w2=Shard(1))
    params(w1=Shard(dim=0), w2=Shard(dim=1))
    >>> params(**{"experts.w1": Shard(0)})
    params(**{'experts.w1': Shard(dim=0)})
    >>> params(weight=Shard(0), scale=Shard(0))      # scale: a buffer of per-row scales
    params(scale=Shard(dim=0), weight=Shard(dim=0))
    """
    for name, placement in rules.items():
        if not isinstance(placement, (Shard, Replicate)):
            raise TypeError(f"params: {name!r} must be Shard(dim) or Replicate() (got {placement!r} that is "
                            f"a {type(placement)!r}); a parameter holds values, never pending partial sums.")
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
        return tuple(placement_or_none(f"{what}[{i}]", v) for i, v in enumerate(value))
    raise TypeError(f"{what} must be a placement or a tuple of {n} placements/None "
                    f"(got {value!r} that is a {type(value)!r}).")


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
            raise TypeError(f"{what}[{name!r}] must be a placement or a (given, desired) pair "
                            f"(got {value!r}).")
        given, desired = (placement_or_none(f"{what}[{name!r}]", v) for v in value)
        out.append((name, Slot(given, desired)))
    return tuple(sorted((n, s) for n, s in out if not s.untouched))


def prepare_in(*given: Placement | None, desired: Placement | tuple | None = None,
               grads: Placement | tuple | None = None, kwargs: dict | None = None,
               local: bool | None = None, arity: int | None = None) -> Style:
    """Annotate and redistribute the module's inputs before it runs.

    - ``given``: one layout per positional input, the layout its local tensor is in
      (``None``: leave that input alone). A DTensor input must already have it.
    - ``desired``: the layout (or a tuple, one per input) to redistribute to; default: given.
      From ``Replicate()`` to ``Partial()`` each rank hands on its term, the value divided by
      the mesh size (DTensor's ``Replicate -> Partial``).
    - ``grads``: the layout (or a tuple) each input's gradient is handed back in; default:
      the whole gradient. ``Partial()`` on a replicated local input (``local=True``) hands it
      back as terms of a sum, for a producer that sums them: a module called inside
      ``on_shards(Replicate(), grads=Partial())``. Replicated there and handed on as
      ``Partial()``, such an input is one of ``n`` equal terms both ways: the value divided
      by ``n`` forward, the gradient divided by ``n`` backward, no communication.
    - ``kwargs``: keyword input name -> given layout or ``(given, desired)``.
    - ``local``: hand the module local tensors (default: DTensors).
    - ``arity``: the number of positional inputs the module must be called with, at least
      one per layout given (default: any; the inputs past the layouts are left alone).

    ``prepare_in(Shard(1), desired=Replicate())`` is PyTorch's
    ``PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())``.

    >>> prepare_in(Shard(1), None, desired=(Replicate(), None), kwargs={"mask": Replicate()})
    prepare_in(Shard(dim=1), desired=Replicate(), kwargs={'mask': (Replicate(), None)})
    >>> prepare_in(Replicate(), desired=Partial(), grads=Partial(), local=True)
    prepare_in(Replicate(), desired=Partial(), grads=Partial(), local=True)
    """
    given = tuple(placement_or_none(f"prepare_in: input {i}", g) for i, g in enumerate(given))
    desired = _per_slot("prepare_in: 'desired'", desired, len(given), "prepare_in(None, desired=Replicate())")
    backs = _per_slot("prepare_in: 'grads'", grads, len(given),
                      "prepare_in(Replicate(), desired=Partial(), grads=Partial(), local=True)")
    for i, (g, back) in enumerate(zip(given, backs)):
        if back is not None and (back != Partial() or g != Replicate() or local is not True):
            raise TypeError(f"prepare_in: 'grads' hands the gradient of a replicated local input back as "
                            f"terms of a sum: grads=Partial() on a given Replicate() with local=True (input "
                            f"{i} is given {g!r}, grads={back!r}, local={local!r}); every other input's "
                            "gradient is handed back whole, as its given layout's cotangent.")
    slots = fold(tuple(Slot(g, d, b) for g, d, b in zip(given, desired, backs)), (), "input")
    named = _named_slots("prepare_in: 'kwargs'", kwargs, "given")
    return Style((Inputs(slots, named, _local(local), arity),))


def prepare_out(*desired: Placement | None, given: Placement | tuple | None = None,
                keys: dict | None = None, local: bool | None = None) -> Style:
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
    desired = tuple(placement_or_none(f"prepare_out: output {i}", d) for i, d in enumerate(desired))
    givens = _per_slot("prepare_out: 'given'", given, len(desired), "prepare_out(None, given=Partial())")
    slots = fold(tuple(Slot(g, d) for g, d in zip(givens, desired)), (), "output")
    named = _named_slots("prepare_out: 'keys'", keys, "desired")
    return Style((Outputs(slots, named, _local(local)),))


def per_rank(*names: str, heads: int | None = None, per_head: int | None = None,
             inputs: dict | None = None) -> Style:
    """Inside the module's forward, the named attributes hold their per-rank values, and the
    named inputs the rows of the rank's heads.

    Attention code often reads global sizes from attributes (``self.num_heads``,
    ``self.split_size``, ``self.config.num_attention_heads``, transformers'
    ``num_key_value_groups``) while its column-wise projections hand it each rank's shard.
    ``per_rank`` says, as part of the plan, that those attributes hold the rank's share:

    - ``names``: attribute paths (dotted ones reach into attributes: ``"config.n_head"``), each
      holding an int, divided by the mesh size ``n``; ``parallelize`` refuses by name a value
      ``n`` does not divide.
    - ``heads=h``: the attributes count (or size) ``h`` key/value heads held as
      ``colwise(heads=h)`` holds them: divided by ``n`` where ``n`` divides ``h``, by ``h`` (one
      head per rank) where ``n`` is a multiple of ``h``.
    - ``per_head=h``: the attributes count things per one of ``h`` key/value heads (the query
      heads per KV head, transformers' ``num_key_value_groups``): kept where ``n`` divides
      ``h``, divided by ``n // h`` where the ranks that share a head split its query heads.
    - ``inputs``: input name -> ``H``, the number of heads of a tensor laid out per head,
      ``(batch * H, ...)`` in dim 0, heads innermost (ALiBi biases, per-head masks): it arrives
      replicated and the module is handed the rows of its rank's ``H // n`` heads (its gradient,
      if any, gathered back whole).

    The values are read when ``parallelize`` runs; the module's forward sets them as it starts
    and restores what was there when it returns, raises or is interrupted, so its hooks, the
    rest of the model and a config shared by many modules see the global values, and nested or
    recursive forwards each see their own.

    >>> per_rank("num_heads", "split_size")
    per_rank('num_heads', 'split_size')
    >>> per_rank("config.num_key_value_heads", heads=2) >> per_rank("num_key_value_groups", per_head=2)
    per_rank('config.num_key_value_heads', heads=2) >> per_rank('num_key_value_groups', per_head=2)
    >>> per_rank("num_heads", inputs={"alibi": 16})
    per_rank('num_heads', inputs={'alibi': 16})
    """
    for name in names:
        if not isinstance(name, str) or not all(part.isidentifier() for part in name.split(".")):
            raise TypeError(f"per_rank: attribute names must be attribute paths such as 'num_heads' or "
                            f"'config.num_attention_heads' (got {name!r}).")
    for what, h in (("heads", heads), ("per_head", per_head)):
        if h is not None and not is_count(h):
            raise TypeError(f"per_rank: {what!r} must be a positive int, the number of key/value heads "
                            f"(got {h!r} that is a {type(h)!r}).")
    inputs = {} if inputs is None else inputs
    if not isinstance(inputs, dict) or not all(isinstance(k, str) and is_count(h) for k, h in inputs.items()):
        raise TypeError(f"per_rank: 'inputs' maps input names to their number of heads, e.g. "
                        f"inputs={{'alibi': 16}} (got {inputs!r}).")
    if not names and not inputs:
        raise TypeError("per_rank needs an attribute name or inputs=..., e.g. per_rank('num_heads').")
    if inputs and (heads or per_head):
        raise TypeError(f"per_rank(inputs={inputs!r}, ...): an input laid out per head is sliced over "
                        "all the ranks; give heads= or per_head= attributes their own per_rank(...).")
    return Style((PerRank(tuple(sorted(set(names))), heads, per_head, tuple(sorted(inputs.items()))),))


def identity() -> Style:
    """The style that changes nothing: ``identity() >> s == s == s >> identity()``.

    >>> identity()
    identity()
    """
    return Style()
