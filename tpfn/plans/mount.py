"""What a style means on one module: a ``Mount`` value, what ``parallelize`` mounts there.

``mount(style, module, fqn)`` expands a built-in core into its table row
(``tpfn.plans.kinds``), so built-ins and ``on_shards`` take one path; merges parameter
placements; reads the folded slots of the style's normal form; and checks the style
against the module's parameters and ``forward``. ``problems(style, module, fqn)`` lists
what makes a style unusable on a module, for plans to report all at once.

>>> import torch.nn as nn
>>> from tpfn import Replicate, colwise, prepare_out
>>> m = mount(colwise() >> prepare_out(Replicate()), nn.Linear(4, 8), "w1")
>>> m.params
(('bias', Shard(dim=0)), ('weight', Shard(dim=0)))
>>> m.inputs.slots, m.outputs.slots
((Slot(given=None, desired=Replicate()),), (Slot(given=Shard(dim=-1), desired=Replicate()),))
"""

from __future__ import annotations

import functools
import inspect
import weakref

import attrs
import torch.nn as nn

from tpfn._fqn import describe, near
from tpfn.errors import PlanError
from tpfn.layout import exact_in_torch
from tpfn.plans.kinds import Meaning, meaning, own_stream
from tpfn.style.slot import Slot, fold
from tpfn.style.stages import Core, Inputs, OnShards, Outputs
from tpfn.style.style import Style

__all__ = ["Mount", "mount", "try_mount", "problems", "forward_names", "owned", "local_sizes"]


@attrs.frozen
class Mount:
    """A style on one module, all ``parallelize`` mounts there: parameter placements, the folded
    ``inputs`` and ``outputs`` (their ``local`` decided); ``shards``, the layouts the module
    computes with on local shards (the style's ``on_shards`` stage; None: it computes on
    DTensors) and ``row``, what its built-in's row says beyond them (``Meaning``; for an
    ``on_shards`` style, a random stream of each rank's); ``forward``'s positional input
    ``names`` (for inputs passed by keyword) and the ``owned`` parameters whose local shards the
    module computes with: its own and those of submodules no other rule binds, and the buffers
    its style places; ``sizes``: the attributes that hold per-rank values in its forward
    (``(path, PerRank)``), ``per_head``: the inputs laid out per head (``(name, heads)``), see
    ``per_rank``."""

    fqn: str
    style: Style
    params: tuple
    inputs: Inputs
    outputs: Outputs
    shards: OnShards | None = None
    row: Meaning | None = None
    names: tuple = ()
    owned: tuple = ()
    where: str = "module"
    sizes: tuple = ()
    per_head: tuple = ()

    def out_shape(self, module: nn.Module, in_shape):
        """The global shape of its output on shards for input 0 of global shape ``in_shape`` (None: unknown)."""
        if self.row.shape is not None:
            return self.row.shape(module, in_shape)
        return in_shape if self.shards.desired and self.shards.desired[0] == self.shards.output else None

    def __str__(self):
        """One line of what it mounts, for the ``tpfn`` logger."""
        slots = [*(f"input {i} {s.given!r} -> {s.out!r}" for i, s in enumerate(self.inputs.slots) if not s.untouched),
                 *(f"output {i} {s.given!r} -> {s.out!r}" for i, s in enumerate(self.outputs.slots))]
        placed = ", ".join(f"{n} {p!r}" for n, p in self.params) or "no parameters"
        how = "on local shards" if self.shards is not None else "on DTensors"
        return f"{self.where} {self.style!r}: {placed}; {'; '.join(slots) or 'no slots'}; computes {how}"


def forward_names(module: nn.Module):
    """``forward``'s positional input names, all its input names (None: it takes ``**kwargs``),
    and whether it takes ``*args``."""
    if "forward" in vars(module):  # set on the instance: its parameters are all inputs. Not
        # cached: such a forward (a bound method, a partial, a wrapper closure) holds the module.
        return _signature_names(vars(module)["forward"], 0)
    forward = type(module).forward  # the class's function: skip self
    try:  # cached weakly on the class's function, which holds no module
        return _CLASS_NAMES[forward]
    except (KeyError, TypeError):  # not seen yet, or neither hashable nor weakly referable
        names = _signature_names(forward, 1)
    try:
        _CLASS_NAMES[forward] = names
    except TypeError:
        pass
    return names


_CLASS_NAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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


def owned(module: nn.Module, bound=()) -> tuple:
    """The names of the parameters of ``module`` and of its submodules outside the subtrees
    ``bound`` (relative names of submodules with styles of their own), a tied one once."""
    return tuple(n for n, _ in module.named_parameters() if not any(n.startswith(b + ".") for b in bound))


def _on_dtensors(stage: OnShards) -> tuple:
    """An ``on_shards`` stage as stages for a module that computes on DTensors: the same
    layouts at its slots, moved by DTensor."""
    return (Inputs(tuple(Slot(None, w) for w in stage.desired), local=False),
            Outputs(stage.outputs, local=stage.local))


@functools.lru_cache(maxsize=1024)
def _expanded(style: Style, core: Core, primitives: Style, local_shards: bool) -> Style:
    """``style`` with ``core`` replaced by ``primitives`` (on DTensors unless ``local_shards``)."""
    local = core.default_local if core.local is None else core.local
    stages = []
    for stage in primitives.stages:
        if isinstance(stage, OnShards):
            stage = attrs.evolve(stage, local=local)
            stages.extend((stage,) if local_shards else _on_dtensors(stage))
        else:
            stages.append(stage)
    i = style.stages.index(core)
    return Style(style.stages[:i] + tuple(stages) + style.stages[i + 1:])


def try_mount(style: Style, module: nn.Module, fqn: str, bound=(), kinds: tuple = ()):
    """The ``Mount`` of ``style`` on ``module``, or the list of problems that prevent it
    (``kinds``: the plan's own rows per module kind, ``Plan.kinds``)."""
    where, own = describe(module, fqn), owned(module, bound)
    expanded, row = style, Meaning(style, forward=own_stream)  # an on_shards style draws on shards
    if isinstance(style.core, Core):  # a built-in: its row's primitives and what the row says
        row = meaning(style.core, module, where, own, kinds)
        if isinstance(row, str):
            return [row]
        expanded = _expanded(style, style.core, row.style, row.local)
    found: list = []
    n = expanded.normal
    names_here = own if not bound else [name for name, _ in module.named_parameters()]
    buffers = [name for name, _ in module.named_buffers()]
    known = set(names_here) | set(buffers)
    placements: dict = {}
    for name, placement in n.params:
        if name not in known:
            them, what = [*names_here, *buffers], "parameter or buffer" if buffers else "parameter"
            found.append(f"{_stage_with(expanded, name)!r} at {where}: no {what} {name!r}; it has "
                         f"{', '.join(them) or 'none'}{near(name, them)}.")
            continue
        placements[name] = placement
    if n.rest is not None:
        for name, _ in module.named_parameters(recurse=False):
            placements.setdefault(name, n.rest)

    inputs, shards = n.inputs, None
    if isinstance(n.core, OnShards):
        for name, _ in n.core.param_grads:
            if name not in names_here:
                found.append(f"{n.core!r} at {where}: no parameter {name!r}; it has "
                             f"{', '.join(names_here) or 'none'}{near(name, names_here)}.")
            elif name not in placements:  # a plain parameter's gradient: each rank's terms, never summed
                found.append(f"{n.core!r} at {where} declares the gradient of {name!r} laid out "
                             f"{dict(n.core.param_grads)[name]!r}, but the style does not place {name!r}, so "
                             f"tpfn would never sum it; place it: params({name}=Replicate()) >> {n.core!r}.")
        inputs = Inputs(fold(inputs.slots, tuple(Slot(None, w) for w in n.core.desired), "input"),
                        inputs.kwargs, True, inputs.arity)
        shards = n.core
    default_out = n.core.default_local if n.core is not None else True
    outputs = attrs.evolve(n.outputs, local=default_out if n.outputs.local is None else n.outputs.local)
    inputs = attrs.evolve(inputs, local=bool(inputs.local))

    found.extend(_beyond_dtensor(style, where, placements, shards, inputs, outputs))
    names, named, star = forward_names(module)
    touched = [i for i, s in enumerate(inputs.slots) if not s.untouched]
    if touched and not star and touched[-1] >= len(names):
        found.append(f"{style!r} at {where} prepares input {touched[-1]} but "
                     f"{type(module).__name__}.forward takes {len(names)} positional "
                     f"input{'s' * (len(names) != 1)} ({', '.join(names) or 'none'}).")
    for name, _ in (*inputs.kwargs, *n.per_head):
        if named is not None and name not in named:
            found.append(f"{style!r} at {where} prepares keyword input {name!r} but "
                         f"{type(module).__name__}.forward has no such input{near(name, named)}.")
    found.extend(f"{rule!r} at {where}: {why}" for path, rule in n.sizes
                 if isinstance(why := _held(module, path), str))
    if found:
        return found
    placed_buffers = tuple(name for name in placements if name in buffers)
    return Mount(fqn, style, tuple(sorted(placements.items())), inputs, outputs, shards,
                 row if shards is not None else None, names, own + placed_buffers if shards is not None else (),
                 where, n.sizes, n.per_head)


def _held(module: nn.Module, path: str):
    """The int held at attribute ``path`` (dotted) of ``module``, or a sentence saying why there is none."""
    holder, parts = module, path.split(".")
    for i, part in enumerate(parts):
        if not hasattr(holder, part):
            ints = [k for k, v in getattr(holder, "__dict__", {}).items() if type(v) is int]
            return (f"{'.'.join(parts[:i]) or 'the module'} ({type(holder).__name__}) has no attribute "
                    f"{part!r}{near(part, ints)}.")
        holder = getattr(holder, part)
    if type(holder) is not int or holder < 1:
        return (f"{path} is {holder!r}, not a positive int; per_rank divides counts and widths "
                "(num_heads, split_size).")
    return holder


def local_sizes(mount: Mount, module: nn.Module, n: int) -> tuple:
    """``(((path, global value, per-rank value), ...), problems)``: the values ``mount``'s
    attributes hold in ``module``'s forward on ``n`` ranks, read now, and why ``n`` ranks cannot
    hold some (its per-head inputs' heads included)."""
    values, found = [], []
    if mount.row is not None and mount.row.fits is not None and mount.row.fits(module, n):
        return (), []  # the row's own refusal says why (a built-in's groups, say)
    for path, rule in mount.sizes:
        value, d = _held(module, path), rule.divisor(n)
        if d is None:
            found.append(f"{rule!r} at {mount.where}: {n} ranks neither divide the {rule.heads or rule.per_head} "
                         f"heads nor are a multiple of them; choose a mesh size that divides "
                         f"{rule.heads or rule.per_head} or is a multiple of it.")
        elif value % d:
            shares = f"evenly over the {n} ranks" if d == n else f"into the {d} shares {rule!r} makes of it on {n} ranks"
            found.append(f"{rule!r} at {mount.where}: {path} = {value} does not split {shares}; choose a mesh "
                         f"size that divides it, or leave {path!r} out of per_rank.")
        else:
            values.append((path, value, value // d))
    found += [f"per_rank(inputs={{{name!r}: {h}}}) at {mount.where}: the {h} heads of input {name!r} do "
              f"not split evenly over {n} ranks; choose a mesh size that divides {h}."
              for name, h in mount.per_head if h % n]
    return tuple(values), found


def _beyond_dtensor(style: Style, where: str, placements: dict, shards, inputs, outputs) -> list:
    """Where DTensor would meet a layout it has no placement for (unequal parts, replicated
    heads): a module that computes on DTensors, a slot that moves a tensor into or out of
    one, an output handed on as a DTensor."""
    odd = sorted(n for n, p in placements.items() if not exact_in_torch(p))
    found = []
    if odd and shards is None:
        found.append(f"{style!r} at {where}: {', '.join(map(repr, odd))} {'is' if len(odd) == 1 else 'are'} "
                     f"laid out {placements[odd[0]]!r}, which DTensor has no placement for, but the module "
                     "computes on DTensors (its forward is not the kind's own); shard it with "
                     "on_shards(...), which hands it local shards, or split the projection.")
    slots = [*(("input", i, s) for i, s in enumerate(inputs.slots)),
             *(("output", i, s) for i, s in enumerate(outputs.slots))]
    for side, i, slot in slots:
        ends = [p for p in (slot.given, slot.desired) if p is not None]
        bad = next((p for p in ends if not exact_in_torch(p)), None)
        if bad is None:
            continue
        if len(ends) == 2 and slot.given != slot.desired:
            found.append(f"{style!r} at {where} moves {side} {i} from {slot.given!r} to {slot.desired!r}: "
                         f"tpfn moves no tensor into or out of {bad!r}, which DTensor has no placement for; "
                         "hand the local shards on as the projection makes them (a rowwise(parts=...) with "
                         "the same parts takes them).")
        elif side == "output" and not outputs.local:
            found.append(f"{style!r} at {where} hands output {i} on as a DTensor laid out {bad!r}, which "
                         "DTensor has no placement for; hand it on as a local tensor (local=True).")
    return found


def _stage_with(style: Style, name: str):
    """The ``params`` stage of ``style`` that names parameter ``name``."""
    return next(s for s in style.stages if name in dict(getattr(s, "rules", ())))


def problems(style: Style, module: nn.Module, fqn: str = "", *, bound=(), kinds: tuple = ()) -> list:
    """Every reason ``style`` cannot apply to ``module`` (empty when it can)."""
    folded = try_mount(style, module, fqn, bound, kinds)
    return folded if isinstance(folded, list) else []


def mount(style: Style, module: nn.Module, fqn: str = "", *, bound=(), kinds: tuple = ()) -> Mount:
    """The ``Mount`` of ``style`` on ``module`` (``bound``: the relative names of submodules bound to
    styles of their own; ``kinds``: the plan's rows per module kind); a ``PlanError`` lists every problem."""
    folded = try_mount(style, module, fqn, bound, kinds)
    if isinstance(folded, list):
        raise PlanError(folded)
    return folded
