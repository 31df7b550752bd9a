"""One traced forward on meta tensors: where each linear's output features go.

``follow(model, args, kwargs)`` runs ``model`` (a ``hybrid_copy``: parameters on meta) under a
dispatch mode that follows every ATen op (``tpfn.analysis.rules``) and module hooks that see
each linear and embedding as one step (their inner ops are theirs). A linear or embedding
computing from a replicated input makes a space of its output features; a linear whose
input's last dim is a space contracts it (an exit). Everything else an op does with a space
either carries it, joins it with another, or breaks it with the reason. ``excluded`` names
producers whose outputs are replicated (their spaces broke before, or were not chosen).

>>> import torch.nn as nn
>>> mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
>>> flow = follow(hybrid_copy(mlp), (torch.ones(2, 8),), {})
>>> [(c.fqn, c.role) for c in flow.calls]
[('0', 'entry'), ('2', 'exit')]
"""

from __future__ import annotations

import inspect

import attrs
import torch
import torch.nn as nn

from tpfn._torch import TorchDispatchMode
from tpfn.plans.kinds import TABLE, colwise_conv1d, colwise_linear
from tpfn.analysis.hybrid import Hybrid, hybrid_copy  # noqa: F401  (hybrid_copy: the doctest's)
from tpfn.analysis.factors import REPEAT, Broken, form, plain, spaces as held_spaces, tag
from tpfn.analysis.rules import Input, carry, filled, step, tensors
from tpfn.analysis.spaces import Spaces
from tpfn.analysis.where import failing_module

__all__ = ["follow", "Flow", "Call", "Logged", "kind_of"]

_LINEAR_ROWS = (colwise_linear, colwise_conv1d)  # the rows whose colwise() shards a linear's output features
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_CHANNELS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.GroupNorm)


def kind_of(module: nn.Module) -> str | None:
    """``"embedding"``, ``"linear"`` (a module whose ``colwise()`` row shards its output
    features, nn.Linear and kinds like it), ``"attention"`` (``nn.MultiheadAttention``, whose
    forward reads its weights directly: one step, replicated in and out, that ``colwise()``
    shards on its heads whole), ``"conv"`` (a convolution: its output channels, dim 1, as a
    linear's output features), ``"channels"`` (a module that computes each channel, or group of
    channels, on its own, whose ``colwise()`` row shards them: a BatchNorm, a GroupNorm, a
    grouped or depthwise convolution), or None: a module the trace looks into."""
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, nn.MultiheadAttention):
        return "attention"
    if isinstance(module, _CONVS):
        return "conv" if module.groups == 1 else "channels"
    if isinstance(module, _CHANNELS):
        return "channels"
    for kind, row in TABLE["colwise"]:
        if row in _LINEAR_ROWS and isinstance(module, kind):
            return "linear"
    return None


@attrs.define
class Call:
    """One call of a linear or embedding: ``role`` is ``"entry"`` (it makes ``space``),
    ``"exit"`` (it contracts ``space``) or ``"whole"`` (replicated in, replicated out)."""

    fqn: str
    kind: str
    role: str
    space: int | None
    input: int
    in_shape: tuple
    out_shape: tuple
    itemsize: int
    out_dims: tuple = ()


@attrs.define
class Logged:
    """An op on sharded features, as the global run saw it: the op, the module it ran in,
    and each output's shape and dims."""

    op: str
    where: str
    outputs: tuple


@attrs.define
class Flow:
    spaces: Spaces
    calls: list
    ops: list
    named: dict     # module fqn -> {id of an input: its name}
    firsts: dict    # module fqn -> the name of its forward's first input
    output: list    # the model's output tensors (shape, itemsize)


def _named(module: nn.Module, args: tuple, kwargs: dict) -> dict:
    """A module call's inputs by the names its forward gives them (``*args`` as ``args.i``)."""
    try:
        signature = inspect.signature(module.forward)
        bound = signature.bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return dict(kwargs)
    out = {}
    params = signature.parameters
    for name, value in bound.items():
        kind = params[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            out.update({f"{name}.{i}": v for i, v in enumerate(value)})
        elif kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[name] = value
    return out


def _nones(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """The inputs of a module call that are None, given so or by default."""
    try:
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return ()
    bound.apply_defaults()
    return tuple(name for name, value in bound.arguments.items() if value is None)


def _first_name(module: nn.Module) -> str | None:
    try:
        return next(iter(inspect.signature(module.forward).parameters))
    except (StopIteration, TypeError, ValueError):
        return None


def _first_input(module: nn.Module, args: tuple, kwargs: dict):
    return args[0] if args else kwargs.get(_first_name(module))


class _Tracer(TorchDispatchMode):
    def __init__(self, model: nn.Module, excluded):
        super().__init__()
        self.module = model.get_submodule
        self.spaces = Spaces()
        self.excluded = set(excluded)
        self.held: dict = {}     # id -> (tensor, dims)
        self.params = {id(p): name for name, p in model.named_parameters()}
        self.depends = {id(p): (p, {name}) for name, p in model.named_parameters()}
        self.stack: list = []
        self.inside = 0          # depth inside a linear or embedding
        self.calls: list = []
        self.ops: list = []
        self.firsts: dict = {}
        self.pending: list = []
        self.uniforms: dict = {}  # id -> a tensor holding one value everywhere
        self.sources: dict = {}   # id -> (tensor, Input): a module's input (or a view of one)
        self.named: dict = {}     # module fqn -> {id of an input: its name}
        self.nones: dict = {}     # module fqn -> the inputs its last call was given as None
    # -- what the rules ask ------------------------------------------------------------
    def dims(self, t: torch.Tensor) -> tuple:
        found = self.held.get(id(t))
        if found is None or found[0] is not t:
            return plain(t.shape)
        return tuple(tuple((f, None if isinstance(s, int) and self.spaces.broken(s) else s) for f, s in d)
                     for d in found[1])

    def param(self, t: torch.Tensor):
        return self.params.get(id(t))

    def deps(self, t: torch.Tensor) -> set:
        """The parameters a replicated tensor was computed from."""
        found = self.depends.get(id(t))
        return found[1] if found is not None and found[0] is t else set()

    def input(self, t: torch.Tensor):
        found = self.sources.get(id(t))
        return found[1] if found is not None and found[0] is t else None

    def uniform(self, t: torch.Tensor) -> bool:
        found = self.uniforms.get(id(t))
        return found is not None and found is t

    def set(self, t: torch.Tensor, dims: tuple) -> None:
        if held_spaces(dims):
            self.held[id(t)] = (t, dims)
        else:
            self.held.pop(id(t), None)

    @property
    def where(self) -> str:
        return self.stack[-1] if self.stack else ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.inside:
            return out
        ins = tensors(args) + tensors(list(kwargs.values()))
        touched = any(held_spaces(self.dims(t)) for t in ins)
        try:
            found, derived = carry(func, args, kwargs, out, self, self.spaces)
        except Broken as e:
            self.spaces.fail(e.spaces, f"{e.why} in {self.where or '<root>'!r}")
            found, derived = [(o, plain(o.shape)) for o in tensors(out)], []
        for t, dims in found:
            self.set(t, dims)
        deps = set().union(*(self.deps(t) for t in ins if not held_spaces(self.dims(t))))
        for t in tensors(out):
            if deps and not held_spaces(self.dims(t)):
                self.depends[id(t)] = (t, deps)
        for t, source in derived:
            if isinstance(source, Input):
                self.sources[id(t)] = (t, source)
            else:
                self.params[id(t)] = source
                self.pending.append(t)  # keep it alive while its id names a parameter
        if filled(func, bool(ins) and all(self.uniform(t) for t in ins[:1])):
            self.uniforms.update((id(t), t) for t in tensors(out))
        if touched and torch.Tag.nondeterministic_seeded in func.tags:
            for space in set().union(*(held_spaces(self.dims(t)) for t in ins)):
                self.spaces.random.setdefault(self.spaces.find(space), set()).add(self.where)
        if touched and step(func) is not None:
            self.ops.append(Logged(step(func), self.where, tuple(
                (tuple(t.shape), self.dims(t)) for t in tensors(out))))
        return out

    # -- modules -------------------------------------------------------------------------
    def pre(self, fqn: str, module: nn.Module, args, kwargs):
        if not self.inside:
            if fqn not in self.firsts:
                self.firsts[fqn] = _first_name(module)
            self.nones[fqn] = _nones(module, args, kwargs)
            for name, value in _named(module, args, kwargs).items():
                if isinstance(value, torch.Tensor) and self.param(value) is None:
                    self.sources[id(value)] = (value, Input(fqn, name))
                    self.named.setdefault(fqn, {})[id(value)] = name
        self.stack.append(fqn)
        if kind_of(module) is not None:
            self.inside += 1

    def post(self, fqn: str, module: nn.Module, args, kwargs, out):
        self.stack.pop()
        kind = kind_of(module)
        if kind is None:
            return
        self.inside -= 1
        if kind == "attention" and isinstance(out, tuple) and out:  # (output, weights)
            out = out[0]
        if self.inside or not isinstance(out, torch.Tensor):
            return
        x = _first_input(module, args, kwargs)
        if not isinstance(x, torch.Tensor):
            return
        self._call(fqn, kind, x, out)

    def _call(self, fqn: str, kind: str, x: torch.Tensor, out: torch.Tensor) -> None:
        if kind in ("conv", "channels"):
            return self._channels(fqn, kind, x, out)
        dims = self.dims(x)
        held = held_spaces(dims)
        role, space = "whole", None
        if held and kind == "attention":
            self.spaces.fail(held, f"{fqn!r} (nn.MultiheadAttention) takes sharded features as its input")
        elif held:
            last = form(dims[-1]) if kind == "linear" else None
            bad = (last is None or last[0] != 1 or held_spaces(dims[:-1])
                   or any(t == REPEAT for _, t in dims[-1]))
            if bad:
                what = ("ids" if kind == "embedding" else "input's other dims" if last else
                        "input in a layout it cannot contract")
                self.spaces.fail(held, f"{fqn!r} takes sharded features as its {what}")
            else:
                role, space = "exit", last[2]
                self.spaces.exits.setdefault(space, set()).add(fqn)
        elif fqn not in self.excluded and kind != "attention":
            role, space = "entry", self.spaces.new(fqn, out.shape[-1])
        out_dims = tag(plain(out.shape), out.dim() - 1, space) if role == "entry" else plain(out.shape)
        self.set(out, out_dims)
        if role == "whole":  # a replicated module: its output depends on its parameters
            owned = {f"{fqn}.{n}" for n, _ in self.module(fqn).named_parameters()}
            self.depends[id(out)] = (out, self.deps(x) | owned)
        self.calls.append(Call(fqn, kind, role, space, id(x), tuple(x.shape), tuple(out.shape),
                               out.element_size(), out_dims))

    def _channels(self, fqn: str, kind: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """A convolution or a module on channels: its channels are dim 1 of a batch. A convolution
        from a replicated input makes a space of its output channels, and contracts one that its
        input holds on its channels (an exit); a module on channels (``"channels"``) carries them,
        each rank computing its whole groups. An unbatched convolution computes whole."""
        module, dims = self.module(fqn), self.dims(x)
        held = held_spaces(dims)
        unbatched = isinstance(module, _CONVS) and x.dim() == len(module.kernel_size) + 1
        c, role, space, out_dims = 1, "whole", None, plain(out.shape)
        if held and unbatched:
            self.spaces.fail(held, f"{fqn!r} ({type(module).__name__}) takes an unbatched input, its channels in dim 0")
        elif held:
            whole = form(dims[c])
            rest = held_spaces(dims[:c] + dims[c + 1:])
            if whole is None or whole[0] != 1 or whole[3] != 1 or rest:
                self.spaces.fail(held, f"{fqn!r} ({type(module).__name__}) takes sharded features in "
                                 "other dims than its channels")
            elif kind == "conv":
                role, space = "exit", whole[2]
                self.spaces.exits.setdefault(space, set()).add(fqn)
            elif out.shape[c] != x.shape[c]:
                self.spaces.fail(held, f"{fqn!r} ({type(module).__name__}) makes {out.shape[c]} channels of "
                                 f"{x.shape[c]}")
            else:
                role, space = "channels", whole[2]
                groups = module.groups if isinstance(module, _CONVS) else getattr(module, "num_groups", None)
                self.spaces.channels.setdefault(self.spaces.find(space), set()).add((fqn, groups))
                out_dims = tag(plain(out.shape), c, space)
        elif kind == "conv" and fqn not in self.excluded and not unbatched:
            role, space = "entry", self.spaces.new(fqn, out.shape[c])
            out_dims = tag(plain(out.shape), c, space)
        self.set(out, out_dims)
        if role == "whole":
            owned = {f"{fqn}.{n}" for n, _ in module.named_parameters()}
            self.depends[id(out)] = (out, self.deps(x) | owned)
        self.calls.append(Call(fqn, kind, role, space, id(x), tuple(x.shape), tuple(out.shape),
                               out.element_size(), out_dims))


def follow(model: nn.Module, args: tuple, kwargs: dict, excluded=()) -> Flow:
    """The ``Flow`` of one forward of ``model`` (a ``hybrid_copy`` it may hook) on ``args`` and
    ``kwargs``; the producers in ``excluded`` make no spaces."""
    tracer = _Tracer(model, excluded)
    handles = []
    for fqn, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(
            lambda m, a, k, fqn=fqn: tracer.pre(fqn, m, a, k), with_kwargs=True))
        handles.append(module.register_forward_hook(
            lambda m, a, k, o, fqn=fqn: tracer.post(fqn, m, a, k, o), with_kwargs=True, always_call=True))
    try:
        with Hybrid(), tracer:
            out = model(*args, **kwargs)
    except Exception as e:
        where = failing_module(e, model) or ""
        raise RuntimeError(
            f"suggest runs one forward of {type(model).__name__} with its parameters on the meta "
            f"device, and it fails in {where or '<root>'!r}: {type(e).__name__}: "
            f"{(str(e).splitlines() or [''])[0]} ({_hint(e, where, tracer.nones.get(where, ()))})") from e
    finally:
        for h in handles:
            h.remove()
    results = _outputs(out)
    for t in results:
        held = held_spaces(tracer.dims(t))
        if held:
            tracer.spaces.fail(held, "they reach the model's output")
    return Flow(tracer.spaces, tracer.calls, tracer.ops, tracer.named, tracer.firsts,
                [(tuple(t.shape), t.element_size()) for t in results])


def _hint(e: Exception, where: str, nones: tuple) -> str:
    """What to do about a traced forward that failed in ``where`` with ``e``; ``nones``: the
    inputs ``where`` was called with as None."""
    if nones and "NoneType" in str(e):
        names = ", ".join(map(repr, nones))
        return (f"{repr(where) if where else 'the model'} was given None for {names}: an input the forward "
                "needs is missing; give example_inputs= with every input it needs, as a dict by name")
    if isinstance(e, NotImplementedError) or any(w in str(e) for w in ("meta", "storage", "data-dependent")):
        return ("a forward that reads its weights' values, such as routing that loops over the experts "
                "it hits, cannot run without them; give example_inputs= it runs on, or write the plan by hand")
    return "give example_inputs= it runs on, or write the plan by hand"


def _outputs(out) -> list:
    """The tensors of a model's output (tensors, tuples, lists, dicts and their subclasses)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _outputs(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in _outputs(v)]
    return []
