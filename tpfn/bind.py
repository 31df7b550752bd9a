"""Binding: what a style means for one module, folded into a single ``Mount`` value.

``bind(style, module, fqn)`` resolves the core against the module's kind (a column-wise
``nn.Linear`` shards ``weight`` on dim 0, a column-wise ``nn.Embedding`` on dim 1, ...),
merges parameter placements, and folds every chain of slots into one slot, so each input
and output is redistributed at most once. ``problems(style, module, fqn)`` lists what
makes a style unusable on a module, for plans to report all at once.

>>> import torch.nn as nn
>>> from tpfn import Replicate, colwise, prepare_out
>>> m = bind(colwise() >> prepare_out(Replicate()), nn.Linear(4, 8), "w1")
>>> m.params
(('bias', Shard(dim=0)), ('weight', Shard(dim=0)))
>>> m.inputs.slots, m.outputs.slots
((Slot(given=None, desired=Replicate()),), (Slot(given=Shard(dim=-1), desired=Replicate()),))
"""

from __future__ import annotations

import difflib
import functools
import inspect

import attrs
import torch.nn as nn

from tpfn.errors import PlanError
from tpfn.layout import Replicate, Shard
from tpfn.local import kernel_for, on_shards_kernel
from tpfn.style import Core, Inputs, OnShards, Outputs, Params, Slot, Style, _fold, _fold_named

__all__ = ["InputSpec", "OutputSpec", "Mount", "bind", "fold", "problems", "describe"]


@attrs.frozen
class InputSpec:
    """How ``prepare_inputs`` treats a module's inputs.

    ``slots`` by position (``names``: the forward's names for those positions, for inputs
    passed by keyword), ``kwargs`` by keyword, ``local``: hand on local tensors.
    """

    slots: tuple = ()
    kwargs: tuple = ()
    names: tuple = ()
    local: bool = False
    where: str = "module"


@attrs.frozen
class OutputSpec:
    """How ``prepare_outputs`` treats a module's outputs: ``slots`` by position, ``keys`` by key."""

    slots: tuple = ()
    keys: tuple = ()
    local: bool = True
    where: str = "module"


@attrs.frozen
class Mount:
    """A style bound to one module: parameter placements, the two specs, and the kernel
    that computes the core on local tensors (None: the module computes on DTensors)."""

    fqn: str
    style: Style
    params: tuple
    inputs: InputSpec
    outputs: OutputSpec
    kernel: object = None


def describe(module: nn.Module, fqn: str) -> str:
    """``'layers.0.w1' (Linear)``: how errors name a module."""
    return f"{fqn or '<root>'!r} ({type(module).__name__})"


# What a core does per module kind: parameter placements and the layout input 0 is wanted in.
@functools.lru_cache(maxsize=None)
def _kinds(core: Core) -> dict:
    k = core.parts
    return {
        "colwise": {
            nn.Linear: ({"weight": Shard(0, k), "bias": Shard(0, k)}, Replicate()),
            nn.Embedding: ({"weight": Shard(1, k)}, Replicate()),
        },
        "rowwise": {
            nn.Linear: ({"weight": Shard(1, k), "bias": Replicate()}, Shard(-1, k)),
            nn.Embedding: ({"weight": Shard(0, k)}, Replicate()),
        },
    }[core.kind]


def _core(core: Core, module: nn.Module, where: str):
    """(parameter placements, input slots) of ``core`` on ``module``, or a problem string."""
    if core.kind == "sequence_parallel":
        big = [n for n, p in module.named_parameters() if p.dim() > 1]
        if big:
            return (
                f"{core!r} at {where}: sequence parallelism runs a module on each position alone, "
                f"so its parameters must be 1-D (norms, dropout), but {', '.join(big)} "
                "is not; shard it with colwise() or rowwise()."
            )
        placements = {n: Replicate() for n, _ in module.named_parameters()}
        return placements, (Slot(None, Shard(core.dim)),)
    if isinstance(module, nn.Embedding) and (module.max_norm is not None or module.sparse):
        option = "max_norm" if module.max_norm is not None else "sparse"
        why = ("renormalizes whole rows in place" if option == "max_norm"
               else "makes sparse gradients, which DTensor cannot hold")
        return (f"{core!r} at {where}: nn.Embedding({option}=...) {why}, so it cannot be "
                f"sharded; leave it out of the plan (replicated) or build it without {option}.")
    for kind, (placements, wanted) in _kinds(core).items():
        if isinstance(module, kind):
            own = {n: p for n, p in placements.items() if getattr(module, n, None) is not None}
            return own, (Slot(None, wanted),)
    return f"{core!r} at {where}: it shards nn.Linear and nn.Embedding, not {type(module).__name__}."


def _forward_names(module: nn.Module):
    """``forward``'s positional input names, all its input names (None: it takes ``**kwargs``),
    and whether it takes ``*args``."""
    if "forward" in vars(module):  # set on the instance: its parameters are all inputs
        return _signature_names(vars(module)["forward"], 0)
    return _signature_names(type(module).forward, 1)  # the class's function: skip self


@functools.lru_cache(maxsize=1024)
def _signature_names(forward, skip: int):
    try:
        sig = inspect.signature(forward)
    except (TypeError, ValueError):
        return (), None, True
    kinds = inspect.Parameter
    params = list(sig.parameters.values())[skip:]
    positional = tuple(p.name for p in params
                       if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD))
    named = None if any(p.kind is kinds.VAR_KEYWORD for p in params) else tuple(
        p.name for p in params if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY))
    return positional, named, any(p.kind is kinds.VAR_POSITIONAL for p in params)


def _near(name: str, options) -> str:
    close = difflib.get_close_matches(name, list(options), n=3)
    return f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""


def fold(style: Style, module: nn.Module, fqn: str):
    """The ``Mount`` of ``style`` on ``module``, or the list of problems that prevent it."""
    where = describe(module, fqn)
    found: list = []
    placements: dict = {}
    by: dict = {}

    def place(name, placement, source):
        if name in placements and placements[name] != placement:
            found.append(f"parameter {name!r} of {where} is placed {placements[name]!r} by "
                         f"{by[name]} and {placement!r} by {source}; keep one.")
        placements[name], by[name] = placement, source

    inputs, kwargs, outputs, keys = (), (), (), ()
    in_local, out_local, kernel = None, None, None
    core = style.core
    for stage in style.stages:
        if isinstance(stage, Inputs):
            inputs = _fold(inputs, stage.slots, "input")
            kwargs = _fold_named(kwargs, stage.kwargs, "keyword input")
            in_local = stage.local if stage.local is not None else in_local
        elif isinstance(stage, Core):
            resolved = _core(stage, module, where)
            if isinstance(resolved, str):
                found.append(resolved)
                continue
            core_params, slots = resolved
            for name, placement in core_params.items():
                place(name, placement, repr(stage))
            inputs = _fold(inputs, slots, "input")
            kernel = kernel_for(stage, module)
            in_local = kernel is not None  # else the module computes on DTensors
            outputs = _fold(outputs, stage.outputs, "output")
            out_local = stage.local
        elif isinstance(stage, OnShards):
            for name, _ in stage.param_grads:
                if name not in dict(module.named_parameters()):
                    own = [n for n, _ in module.named_parameters()]
                    found.append(f"{stage!r} at {where}: no parameter {name!r}; it has "
                                 f"{', '.join(own) or 'none'}{_near(name, own)}.")
            inputs = _fold(inputs, tuple(Slot(None, w) for w in stage.wants), "input")
            kernel, in_local = on_shards_kernel(stage), True
            outputs = _fold(outputs, stage.outputs, "output")
            out_local = stage.local
        elif isinstance(stage, Outputs):
            outputs = _fold(outputs, stage.slots, "output")
            keys = _fold_named(keys, stage.keys, "output")
            out_local = stage.local if stage.local is not None else out_local
        elif isinstance(stage, Params):
            for name, placement in stage.rules:
                try:
                    module.get_parameter(name)
                except AttributeError:
                    own = [n for n, _ in module.named_parameters()]
                    found.append(f"{stage!r} at {where}: no parameter {name!r}; it has "
                                 f"{', '.join(own) or 'none'}{_near(name, own)}.")
                    continue
                place(name, placement, repr(stage))
    for stage in style.stages:  # `rest` places what nothing else placed
        if isinstance(stage, Params) and stage.rest is not None:
            for name, _ in module.named_parameters(recurse=False):
                placements.setdefault(name, stage.rest)

    names, named, star = _forward_names(module)
    touched = [i for i, s in enumerate(inputs) if not s.untouched]
    if touched and not star and touched[-1] >= len(names):
        found.append(f"{style!r} at {where} prepares input {touched[-1]} but "
                     f"{type(module).__name__}.forward takes {len(names)} positional "
                     f"input{'s' * (len(names) != 1)} ({', '.join(names) or 'none'}).")
    for name, _ in kwargs:
        if named is not None and name not in named:
            found.append(f"{style!r} at {where} prepares keyword input {name!r} but "
                         f"{type(module).__name__}.forward has no such input{_near(name, named)}.")
    if found:
        return found
    default_out = core.default_local if core is not None else True
    return Mount(
        fqn=fqn,
        style=style,
        params=tuple(sorted(placements.items())),
        inputs=InputSpec(inputs, kwargs, names, bool(in_local), where),
        outputs=OutputSpec(outputs, keys, default_out if out_local is None else out_local, where),
        kernel=kernel,
    )


def problems(style: Style, module: nn.Module, fqn: str = "") -> list:
    """Every reason ``style`` cannot apply to ``module`` (empty when it can)."""
    folded = fold(style, module, fqn)
    return folded if isinstance(folded, list) else []


def bind(style: Style, module: nn.Module, fqn: str = "") -> Mount:
    """The ``Mount`` of ``style`` on ``module``; a ``PlanError`` lists every problem."""
    folded = fold(style, module, fqn)
    if isinstance(folded, list):
        raise PlanError(folded)
    return folded

