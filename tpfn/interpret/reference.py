"""The reference route: what a bound module computes, written plainly.

A call of a bound module (a ``Call``: its runtime and its inputs as they arrive) is computed in
three steps; a fast kernel (``tpfn.kernels``) may compute it instead, with the same numbers and
what every observer sees, or leave it to this route (``parallelize(..., kernels=False)``: always).

1. Each input through its slot (``inputs``, ``convert``): a local tensor moved once to the layout
   its module computes with, by the algebra's steps in one autograd node (``tpfn.interpret.moves``);
   a DTensor checked and redistributed by DTensor; for a module on DTensors, annotated as one.
2. The module's computation: on local shards (``Mount.shards``), its own forward or the one its
   row supplies (a vocabulary's mask, dropout's slice of one device's noise, a random stream of
   each rank's, attention on each rank's heads: ``tpfn.plans.kinds``), its parameters local views
   of their shards (``_views``; put back whatever happens); else its own forward on DTensors. In
   invariant mode a sequence-parallel module with partial parameter gradients computes once per
   chunk of the sequence (``tpfn.interpret.invariant.by_tokens``).
3. Each output through its slot (``Call.finish``).

A sharded local tensor's global shape (seven positions are 4 and 3 on two ranks) comes from the
model's shape memory, or from the ranks' local shapes (``tpfn.interpret.state``).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.distributed.tensor import DTensor

from tpfn._torch import HookIdentity, buffers_of, hooked, parameters_of
from tpfn.algebra import contiguous_strides, cotangent
from tpfn.errors import LayoutError
from tpfn.interpret.invariant import by_tokens
from tpfn.interpret.moves import move, placements, unhooked, view
from tpfn.interpret.state import Guess
from tpfn.layout import Partial, Replicate, Shard, exact_in_torch, from_torch

__all__ = ["Call", "reference", "inputs", "outputs", "convert", "param_slots"]

_WHOLE, _PARTIAL = Replicate(), Partial()
_cotangents = functools.lru_cache(maxsize=256)(lambda layout: cotangent(layout)[0])  # (values alone)


def _cotangent(layout):
    """The layout of the gradient of a tensor laid out ``layout`` (remembered but in compiled code)."""
    return cotangent(layout)[0] if torch.compiler.is_compiling() else _cotangents(layout)


class Call:
    """One call of a bound module: its runtime ``rt`` and its inputs as they arrive."""

    __slots__ = ("rt", "args", "kwargs", "_shape")

    def __init__(self, rt, args: tuple, kwargs: dict):
        self.rt, self.args, self.kwargs, self._shape = rt, args, kwargs, None

    @property
    def first(self):
        """Input 0, passed by position or by its name (None: not passed)."""
        names = self.rt.mount.names
        return self.args[0] if self.args else self.kwargs.get(names[0]) if names else None

    def shape(self, exact: bool = False):
        """Input 0's global shape where its slot lays it out (None: it leaves input 0 alone):
        exact where the slot moves it or ``exact`` asks, else perhaps a ``Guess``."""
        found = self._shape
        if found is None or exact and isinstance(found, Guess):
            rt, x = self.rt, self.first
            slots = rt.mount.inputs.slots
            if not slots or slots[0].untouched:
                return None
            if x is None:
                raise TypeError(f"input 0 of {rt.mount.where} is None, but {rt.mount.style!r} computes on it "
                                f"({slots[0].out!r}); pass it a tensor.")
            if not isinstance(x, torch.Tensor):  # (its slot names it)
                return None
            found = self._shape = global_shape(x, slots[0], rt, f"input 0 of {rt.mount.where}", exact)
        return found

    def own(self, *args, **kwargs):
        """The module's own forward, on what the route hands it."""
        return self.rt.forward(*args, **kwargs)

    def finish(self, output, shape=None):
        """The module's ``output`` through its output slots (``shape``: input 0's global shape)."""
        rt, mount, observer = self.rt, self.rt.mount, self.rt.state.observer
        if observer is not None:
            observer.outputs(rt, output)
        shards = mount.shards
        if shards is None or shards.output is None or mount.outputs.keys:  # (keys: only a dict has them)
            return outputs(output, mount.outputs, rt, mount.where)
        slot = mount.outputs.slots[0]
        if not isinstance(output, torch.Tensor):
            raise TypeError(
                f"the output of {mount.where} is {type(output).__name__}, not a tensor, but "
                f"{mount.style!r} declares one output laid out {slot.given!r}; return one "
                "tensor, or leave out output= and lay out the items with prepare_out(..., given=...).")
        shape = None if shape is None else mount.out_shape(rt.module, shape)
        return convert(output, slot, rt, local=mount.outputs.local, grad=_cotangent(slot.out),
                       what=f"the output of {mount.where}", shape=shape, own=True)


def reference(call: Call):
    """The module's output for ``call``, by the reference route (the module docstring)."""
    rt, mount = call.rt, call.rt.mount
    shape = None if mount.shards is None else call.shape()
    args, kwargs = inputs(call.args, call.kwargs, mount.inputs, rt, mount.where, shape)
    if rt.state.observer is not None:
        rt.state.observer.computes(rt, args, kwargs)
    if mount.shards is None:  # on DTensors: moved by DTensor, whose collectives wait with the bound
        with contextlib.nullcontext() if torch.compiler.is_compiling() else rt.state.bound.issuing():
            return call.finish(rt.forward(*args, **kwargs))
    forward, saved = mount.row.forward, []
    try:  # on local views of its parameters' shards, the DTensor parameters put back whatever happens
        _views(rt, saved)
        if rt.tokens:  # invariant mode: per chunk of the sequence (tpfn.interpret.invariant)
            output = by_tokens(call, args, kwargs, saved, forward, rt.tree)
        else:
            output = rt.forward(*args, **kwargs) if forward is None else forward(call, *args, **kwargs)
    finally:
        for table, name, param in reversed(saved):
            table[name] = param
    return call.finish(output, shape)


def param_slots(module: torch.nn.Module, mount) -> tuple:
    """``(table, name, full name, gradient layout, added once)`` of every slot holding one of the
    parameters (or placed buffers) ``mount`` hands ``module`` as local shards (``Mount.owned``),
    ``table`` the owner's ``_parameters`` or ``_buffers``; a tied parameter's slots under its
    first name; ``added once``: a replicated bias added once to partial sums (``Meaning.once``)."""
    names = {id(p): n for n, p in (*module.named_parameters(), *module.named_buffers())}
    owned, grads = set(mount.owned), dict(mount.shards.param_grads)
    return tuple((table, name, names[id(p)], grads.get(names[id(p)]), names[id(p)] == mount.row.once)
                 for _, owner in module.named_modules(remove_duplicate=False)
                 for table in (parameters_of(owner), buffers_of(owner))
                 for name, p in table.items()
                 if p is not None and id(p) in names and names[id(p)] in owned)


def _views(rt, saved: list) -> None:
    """Put local views of the module's DTensor parameters (and placed buffers) in their slots
    (a tied one, one view), noting in ``saved`` what to put back; a replicated bias added once to
    partial sums becomes this rank's term of it."""
    made = {}
    for table, name, full, grad, once in rt.slots:
        param = table[name]
        if not isinstance(param, DTensor):
            continue
        local = made.get(id(param))
        if local is None:
            local = made[id(param)] = view(param, grad, rt.cache)
            if once and rt.mesh.size() > 1:  # one term of a sum over the ranks, its gradient whole
                local = made[id(param)] = move(local, _WHOLE, _PARTIAL, _WHOLE, tuple(param.shape),
                                               f"{full} of {rt.mount.where}", rt, to=_WHOLE)
        saved.append((table, name, param))
        table[name] = local


def global_shape(x, slot, rt, what: str, exact: bool = False) -> tuple:
    """The global shape of a tensor ``x`` (``what``) arriving at ``slot``; that of a sharded local
    tensor exact where the slot moves it or ``exact`` asks (``tpfn.interpret.state``)."""
    if isinstance(x, DTensor):
        return tuple(x.shape)
    slot.fit(x, what)
    given = placements(slot.source, x.ndim)
    return rt.state.shapes.recall(x, given, rt.mesh, what, exact or given != placements(slot.out, x.ndim))


def convert(x, slot, rt, *, local: bool, grad, what: str, shape=None, replica: bool = False, own: bool = False):
    """One input or output ``x`` (``what``) through its ``slot`` on ``rt``'s mesh: a local tensor
    (``local``) or a DTensor in the slot's layout. A local tensor handed on gets its gradient back
    in ``grad`` (None: it needs none); ``shape``: its global shape, where the caller knows it;
    ``replica``: a local replica its module's children may read (their partial gradients handed to it);
    ``own``: an output, which its caller may write in place (so not ``to_local``'s view of a DTensor)."""
    if x is None or slot.untouched:
        return x
    mesh, shapes = rt.mesh, rt.state.shapes
    if not isinstance(x, torch.Tensor):
        layout = " -> ".join(repr(p) for p in (slot.given, slot.desired) if p is not None)
        raise TypeError(f"{what} is declared {layout} but is {type(x).__name__}, not a tensor; "
                        "mark it None to leave it alone.")
    slot.fit(x, what)
    if isinstance(x, DTensor):
        dt = _checked(x, slot, mesh, what)
    else:
        given, out = placements(slot.source, x.ndim), placements(slot.out, x.ndim)
        if shape is None or isinstance(shape, Guess):  # exact where a move or a DTensor needs it
            exact = not local or given != out or (grad is not None and placements(grad, x.ndim) != given)
            if shape is None or exact:
                shape = shapes.recall(x, given, mesh, what, exact)
        if local and torch.compiler.is_compiling() and shape is not None:
            _even(shape, slot.out, mesh, what)
        if local:  # local tensors all the way
            moved = move(x, slot.source, slot.out, grad, shape, what, rt, to=slot.grad,
                         node=replica and slot.out == _WHOLE)
            shapes.remember(moved, out, shape, mesh)
            return moved
        dt = DTensor.from_local(x, mesh, given, run_check=False, shape=tuple(shape),
                                stride=contiguous_strides(shape))
    if slot.desired is not None:
        desired = placements(slot.desired, x.ndim)
        if desired != dt.placements:  # (a no-op redistribute would reduce partial gradients)
            with rt.state.bound.issuing():
                dt = dt.redistribute(mesh, desired)
    if not local:
        return dt
    out = dt.to_local(grad_placements=None if grad is None else placements(grad, x.ndim))
    out = out.clone() if own and out.requires_grad else out
    shapes.remember(out, dt.placements, dt.shape, mesh)
    return out


def _even(shape, layout, mesh, what: str) -> None:
    """Refuse (compiled code) to hand on a local shard of a dim the mesh does not split evenly:
    compiled code takes a sharded local tensor it did not make for an even split."""
    if isinstance(layout, Shard) and shape[layout.dim % len(shape)] % mesh.size():
        _uneven(shape[layout.dim % len(shape)], layout.dim % len(shape), mesh.size(), what)


@torch.compiler.disable  # raised as it is, not traced
def _uneven(size: int, dim: int, n: int, what: str) -> None:
    raise LayoutError(f"{what}: compiled code takes a sharded local tensor for an even split of its "
                      f"dim, but the {size} in dim {dim} do not split evenly over {n} ranks; use a "
                      "length the mesh size divides (pad the sequence), or run this length eagerly, "
                      "which keeps uneven shards (docs/training.md).")


def _checked(x: DTensor, slot, mesh, what: str) -> DTensor:
    """``x``, after checking it lives on ``mesh`` in the layout ``slot`` declares."""
    if x.device_mesh != mesh:
        raise LayoutError(f"{what} is a DTensor on {x.device_mesh}, not on the plan's {mesh}; "
                          "parallelize the producing and the consuming module over one mesh.")
    odd = next((p for p in (slot.given, slot.desired) if p is not None and not exact_in_torch(p)), None)
    if odd is not None:
        raise LayoutError(f"{what} is a DTensor, but the plan lays it out {odd!r}, which DTensor "
                          "has no placement for; hand it the local shards the projection makes.")
    want = None if slot.given is None else placements(slot.given, x.ndim)
    if want is not None and not all(h == w or h.is_partial() and w.is_partial() and h.reduce_op == w.reduce_op
                                    for h, w in zip(x.placements, want)):  # (an embedding's masked partial)
        current = from_torch(x.placements)[0]
        raise LayoutError(f"{what} arrives laid out {current!r} but the plan declares {slot.given!r}; "
                          f"declare {current!r} there, or redistribute it before the call.")
    return x


def _source(x) -> tuple:
    """The tensor ``x`` is, seen through module hooks' identity wrappers (each input its own):
    the autograd node and output it wraps, else ``(x, None)``."""
    node = None if torch.compiler.is_compiling() else getattr(x, "grad_fn", None)
    return unhooked(node, x.output_nr) if isinstance(node, HookIdentity) else (x, None)


def inputs(args: tuple, kwargs: dict, spec, rt, where: str, first_shape=None) -> tuple:
    """``(args, kwargs)`` with every input that ``spec`` (an ``Inputs``) lays out converted (new
    containers) for the module ``where`` on ``rt``; ``first_shape``: input 0's global shape."""
    names, grads = rt.mount.names, rt.grads
    if spec.arity is not None and len(args) != spec.arity:
        raise LayoutError(f"{where} is called with {len(args)} positional input{'s' * (len(args) != 1)}, "
                          f"but its plan takes exactly {spec.arity} (prepare_in(..., arity={spec.arity}): "
                          "PyTorch's PrepareModuleInput takes one input layout per positional input); give "
                          "one layout per positional input (None leaves that input alone), or pass the "
                          "other inputs by keyword.")
    args, kwargs, done = list(args), dict(kwargs), []  # an input at several positions moves once
    # a parent's replica, whose children's kernels hand it their partial sums unless a hook of the user's sees them
    replica = bool(rt.readers) and not any(map(hooked, rt.readers))

    def one(x, slot, grad, what, shape=None):
        source, index = _source(x)
        for seen, i, at, back, out in done:
            if seen is source and i == index and at == slot and back == grad:
                return out
        out = convert(x, slot, rt, local=bool(spec.local), grad=grad, what=what, shape=shape, replica=replica)
        if isinstance(x, torch.Tensor):
            done.append((source, index, slot, grad, out))
        return out

    for i, slot in enumerate(spec.slots):
        grad = grads[i] if i < len(grads) else None if slot.untouched else _cotangent(slot.out)
        shape = first_shape if i == 0 else None
        if i < len(args):
            args[i] = one(args[i], slot, grad, f"input {i} of {where}", shape)
        elif i < len(names) and names[i] in kwargs:
            kwargs[names[i]] = one(kwargs[names[i]], slot, grad, f"input {i} of {where}", shape)
    for name, slot in spec.kwargs:
        i = names.index(name) if name in names else len(args)
        if name in kwargs:
            kwargs[name] = one(kwargs[name], slot, _cotangent(slot.out), f"keyword input {name!r} of {where}")
        elif i < len(args) and (i >= len(spec.slots) or spec.slots[i].untouched):  # passed by position
            args[i] = one(args[i], slot, _cotangent(slot.out),
                          f"keyword input {name!r} of {where} (passed as input {i})")
    for name, heads in rt.mount.per_head:  # the rows of its heads, whole on every rank
        i = names.index(name) if name in names else len(args)
        table, key = (args, i) if i < len(args) else (kwargs, name)
        if i < len(args) or kwargs.get(name) is not None:
            table[key] = _per_head(table[key], heads, rt, f"input {name!r} of {where}")
    return tuple(args), kwargs


def _per_head(x, heads: int, rt, what: str):
    """This rank's heads' rows of ``x``, replicated and laid out per head, ``(batch * heads, ...)``
    in dim 0 (``per_rank(inputs=...)``); its gradient is gathered back whole."""
    if not isinstance(x, torch.Tensor) or isinstance(x, DTensor) or x.ndim == 0 or x.shape[0] % heads:
        shape = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise LayoutError(f"{what} is laid out per head, (batch * {heads}, ...) in dim 0, on every rank alike "
                          f"(per_rank(inputs=...)), but it is {'a DTensor' if isinstance(x, DTensor) else shape}; "
                          "hand it the whole tensor, or give per_rank its number of heads.")
    v = x.unflatten(0, (-1, heads))
    grad = Shard(1) if x.requires_grad else None
    return move(v, _WHOLE, Shard(1), grad, tuple(v.shape), what, rt).flatten(0, 1)


def outputs(output, spec, rt, where: str):
    """``output`` with every output that ``spec`` (an ``Outputs``) lays out converted (a new
    container): a tensor, the items of a tuple or list, the values of a dict."""
    local = True if spec.local is None else spec.local

    def one(x, slot, what):
        return convert(x, slot, rt, local=local, grad=_cotangent(slot.out), what=what, own=True)

    def check(n):
        if len(spec.slots) > n:
            raise LayoutError(f"{where} returned {n} outputs; the plan prepares "
                              f"{len(spec.slots)}: give prepare_out one layout (or None) per output.")

    if spec.keys and not isinstance(output, dict):
        raise LayoutError(f"{where} returned a {type(output).__name__}, but the plan lays out outputs by "
                          f"key ({', '.join(repr(k) for k, _ in spec.keys)}), which only a dict has; give "
                          "prepare_out one layout per position instead.")
    if isinstance(output, dict):
        out = type(output)(output)
        keys = list(out)
        check(len(keys))
        for i, slot in enumerate(spec.slots):
            out[keys[i]] = one(out[keys[i]], slot, f"output {i} of {where}")
        for key, slot in spec.keys:
            if key in out:
                out[key] = one(out[key], slot, f"output {key!r} of {where}")
        return out
    if isinstance(output, (tuple, list)):
        check(len(output))
        items = list(output)
        for i, slot in enumerate(spec.slots):
            items[i] = one(items[i], slot, f"output {i} of {where}")
        if isinstance(output, list):
            return items
        return type(output)(*items) if hasattr(output, "_fields") else type(output)(items)
    if len(spec.slots) > 1:
        raise LayoutError(f"{where} returned one output; the plan prepares {len(spec.slots)}: "
                          "give prepare_out one layout.")
    return one(output, spec.slots[0], f"the output of {where}") if spec.slots else output
