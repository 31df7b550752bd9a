"""PyTorch's tensor-parallel styles and plans as tpfn styles and plans.

``from_torch`` takes what ``torch.distributed.tensor.parallel.parallelize_module`` takes, a
style object or a dict of module FQN -> style object, and returns the tpfn style or plan
that does the same (the same parameter placements, the same layouts at every input and
output, so the same numbers): moving over is a one-line change. It also takes DTensor
placements, as before, and returns their tpfn layout.

>>> from torch.distributed.tensor import Replicate as TReplicate, Shard as TShard
>>> from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
>>> from_torch(ColwiseParallel(output_layouts=TReplicate()))
colwise() >> prepare_out(Replicate())
>>> from_torch({"w1": ColwiseParallel(), "w2": RowwiseParallel(output_layouts=TShard(1))})
plan({'w1': colwise(), 'w2': prepare_in(Shard(dim=-1)) >> rowwise() >> prepare_out(Shard(dim=1))})
>>> from_torch([TShard(0)])
(Shard(dim=0),)

A ``PrepareModuleInput`` with ``input_layouts`` takes exactly one positional input per
layout, in PyTorch and once converted (``arity``; a call with another number raises):

>>> from torch.distributed.tensor.parallel import PrepareModuleInput
>>> from_torch(PrepareModuleInput(input_layouts=(TShard(1), None),
...                               desired_input_layouts=(TReplicate(), None)))
prepare_in(Shard(dim=1), desired=Replicate(), arity=2)

``RowwiseParallel`` annotates its input as given (``Shard(-1)`` unless told otherwise) for
an ``nn.Embedding`` too, and the conversion keeps that: ``prepare_in(Shard(dim=-1)) >>
rowwise()`` all-gathers token ids on an embedding, exactly as PyTorch does (give
``input_layouts=Replicate()``, or write ``rowwise()``, for replicated ids).
"""

from __future__ import annotations

import warnings

from torch.distributed.tensor import Placement
from torch.distributed.tensor.parallel import (
    ColwiseParallel, ParallelStyle, PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput,
    RowwiseParallel, SequenceParallel,
)

from tpfn import layout
from tpfn.errors import PlanError
from tpfn.layout import Replicate, Shard
from tpfn.plans.plan import Plan, plan
from tpfn.style.style import Style
from tpfn.style.constructors import colwise, identity, prepare_in, prepare_out, rowwise, sequence_parallel

__all__ = ["from_torch", "style_from_torch", "plan_from_torch"]


def _one(placement):
    """The tpfn placement of a torch placement (None stays None)."""
    return None if placement is None else layout.from_torch(placement)[0]


def _local(use_local: bool, default: bool):
    """tpfn's ``local=`` for a PyTorch ``use_local_*`` flag (None where it is the default)."""
    return None if use_local == default else use_local


def _colwise(s: ColwiseParallel) -> Style:
    given, out = _one(s.input_layouts[0]), _one(s.output_layouts[0])
    inputs = identity() if given == Replicate() else prepare_in(given)
    local = _local(s.use_local_output, True)
    if out == Shard(-1):
        return inputs >> colwise(local=local)
    return inputs >> colwise() >> prepare_out(out, local=local)


def _rowwise(s: RowwiseParallel) -> Style:
    # Annotated as given whatever the module: an embedding's ids too (Shard(-1) by default).
    inputs = prepare_in(_one(s.input_layouts[0]))
    out, local = _one(s.output_layouts[0]), _local(s.use_local_output, True)
    if out == Replicate():
        return inputs >> rowwise(local=local)
    return inputs >> rowwise() >> prepare_out(out, local=local)


def _sequence_parallel(s: SequenceParallel) -> Style:
    return sequence_parallel(s.sequence_sharding[0].dim, local=_local(s.use_local_output, False))


def _prepare_input(s: PrepareModuleInput) -> Style:
    # A slot without a given layout is left alone, whatever it desires (as in PyTorch).
    pairs = list(zip(s.input_layouts or (), s.desired_input_layouts or ()))
    given = [_one(g) for g, _ in pairs]
    desired = tuple(None if g is None else _one(d) for g, d in pairs)
    kwargs = {name: (_one(g), _one(s.desired_input_kwarg_layouts.get(name)))
              for name, g in s.input_kwarg_layouts.items() if g is not None}
    # PyTorch takes exactly one positional input per input layout, where it is given any.
    arity = None if s.input_layouts is None else len(s.input_layouts)
    return prepare_in(*given, desired=desired if any(desired) else None, kwargs=kwargs or None,
                      local=_local(s.use_local_output, False), arity=arity)


def _prepare_output(s: PrepareModuleOutput) -> Style:
    pairs = list(zip(s.output_layouts, s.desired_output_layouts))
    desired = [None if o is None else _one(d) for o, d in pairs]
    given = tuple(_one(o) for o, _ in pairs)
    return prepare_out(*desired, given=given, local=_local(s.use_local_output, True))


def _prepare_input_output(s: PrepareModuleInputOutput) -> Style:
    return _prepare_input(s.prepare_module_input) >> _prepare_output(s.prepare_module_output)


_CONVERT = {ColwiseParallel: _colwise, RowwiseParallel: _rowwise, SequenceParallel: _sequence_parallel,
            PrepareModuleInput: _prepare_input, PrepareModuleOutput: _prepare_output,
            PrepareModuleInputOutput: _prepare_input_output}


def _unknown(what: str, value) -> str:
    kind = type(value)
    return (f"{what} is a {kind.__module__}.{kind.__qualname__}, which tpfn cannot convert; it "
            f"converts {', '.join(c.__name__ for c in _CONVERT)}. Write its tpfn style instead "
            "(docs/migration.md).")


def style_from_torch(style: ParallelStyle) -> Style:
    """The tpfn style of one PyTorch style object (its exact class, not a subclass).

    >>> from torch.distributed.tensor.parallel import SequenceParallel
    >>> style_from_torch(SequenceParallel(sequence_dim=0, use_local_output=True))
    sequence_parallel(dim=0, local=True)
    """
    convert = _CONVERT.get(type(style))
    if convert is None:
        raise TypeError(_unknown("the style", style))
    return convert(style)


def plan_from_torch(torch_plan: dict) -> Plan:
    """The tpfn plan of a ``parallelize_module`` plan (module FQN pattern -> PyTorch style);
    one ``PlanError`` names every entry tpfn cannot convert.

    >>> from torch.distributed.tensor.parallel import ColwiseParallel
    >>> plan_from_torch({"layers.*.w1": ColwiseParallel()})
    plan({'layers.*.w1': colwise()})
    """
    found, rules = [], {}
    for fqn, style in torch_plan.items():
        convert = _CONVERT.get(type(style))
        if convert is None:
            found.append(_unknown(f"plan[{fqn!r}]", style))
        else:
            rules[fqn] = convert(style)
    if found:
        raise PlanError(found)
    return plan(rules)


def from_torch(value: ParallelStyle | dict | Placement | list | tuple | None) -> Style | Plan | tuple:
    """tpfn's value for a PyTorch one: a style object -> style, a ``parallelize_module``
    plan (dict) -> plan, DTensor placements (one or a sequence) -> layout; no plan (None) ->
    the empty plan, with the warning ``parallelize_module`` gives.

    >>> from torch.distributed.tensor import Partial as TPartial
    >>> from_torch(TPartial("max"))
    (Partial(op='max'),)
    """
    if value is None:  # parallelize_module(module, mesh) with no plan does nothing, and warns
        warnings.warn("from_torch(None): no parallelize_plan, so the plan is empty and parallelize "
                      "leaves the module as it is (as parallelize_module does).", stacklevel=2)
        return plan({})
    if isinstance(value, ParallelStyle):
        return style_from_torch(value)
    if isinstance(value, dict):
        return plan_from_torch(value)
    if isinstance(value, (Placement, list, tuple)):
        return layout.from_torch(value)
    raise TypeError(f"from_torch takes a PyTorch ParallelStyle, a parallelize_module plan (dict) or "
                    f"DTensor placements (got {value!r} that is a {type(value)!r}).")
