"""The three functions that do the work, none of which mutates its arguments (``parallelize``
mounts them on modules):

- ``shard_params(module, mesh, rule)``: ``{name: nn.Parameter(DTensor)}``, laid out as ``rule`` says;
- ``prepare_inputs(args, kwargs, spec, mesh)``: the inputs annotated with their given layout,
  redistributed to the desired one, as local tensors or DTensors (``spec``: ``prepare_in(...)``);
- ``prepare_outputs(outputs, spec, mesh)``: the same for a module's outputs (a tensor, the
  items of a tuple or list, the values of a dict; ``spec``: ``prepare_out(...)``).

Every slot of every mounted module goes through one function, ``convert``: a DTensor is
checked and redistributed by DTensor; a local tensor is moved by ``tpfn.interpret.moves``
when a local tensor is handed on (the fast path), else annotated and redistributed by
DTensor. A local tensor that leaves a slot sharded remembers its global shape
(``tpfn.interpret.state``), so a sequence the mesh does not divide keeps its length when the
next module annotates it again (PyTorch infers an even split there, torchtitan#1306).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed import tensor as _dt
from torch.distributed.tensor import DTensor, distribute_tensor

from tpfn._torch import HookIdentity, heads_mesh, keep_mesh, meta_dtensor, parameters_of, per_rank
from tpfn.algebra import contiguous_strides, cotangent, shard_ranges, unpackable
from tpfn.errors import LayoutError
from tpfn.bounded import collective
from tpfn.interpret.moves import bound_of, failed, move, placements, unhooked
from tpfn.interpret.state import Guess, Shapes
from tpfn.interpret.terms import terms
from tpfn.layout import Replicate, Shard, exact_in_torch, from_torch, to_torch
from tpfn.style.stages import Inputs, Outputs
from tpfn.style.style import Style

__all__ = ["shard_params", "placed_tensor", "local_value", "prepare_inputs", "prepare_outputs", "Context",
           "inputs", "outputs_of", "convert", "checked", "not_a_tensor", "per_head"]


def shard_params(module: nn.Module, mesh: DeviceMesh, rule: dict, *, src_rank: int | None = 0,
                 timeout: float | None = None) -> dict:
    """``{name: nn.Parameter(DTensor)}`` for each parameter named in ``rule`` (a name -> layout
    map), ``{name: DTensor}`` for each buffer. Dotted names reach into submodules. ``src_rank``
    is the rank whose values every rank receives (``None``: each rank keeps its own values, no
    communication), each transfer waiting ``timeout`` seconds at most (``tpfn.bounded``). A
    parameter already a DTensor with that layout on ``mesh`` is returned as is.

    A layout DTensor has no placement for: unequal parts (``Shard(d, parts=(q, k, v))``) become a
    DTensor ``Shard(d)`` of the ranks' chunks of every part, rank after rank; heads replicated over more
    ranks than heads (``Shard(d, heads=h)``), a DTensor ``(Shard(d), Replicate())`` on the view of
    ``mesh`` as ``h`` groups of ranks (``tpfn._torch.heads_mesh``), exact, made once per call."""
    out, views = {}, {}
    for name, layout in rule.items():
        param, is_param = _placed(module, name)
        problem = unpackable(name, param.shape, layout, mesh.size())
        if problem:
            raise LayoutError(problem)
        desired = to_torch(layout)
        if isinstance(param, DTensor):
            if param.device_mesh != mesh or param.placements != desired or not exact_in_torch(layout):
                raise LayoutError(f"parameter {name!r} is already a DTensor laid out "
                                  f"{from_torch(param.placements)} on {param.device_mesh}; it cannot "
                                  f"also be {layout!r} on {mesh}.")
            out[name] = param
            continue
        if param.is_meta and exact_in_torch(layout):  # no values to send: its DTensor at once
            dt, on = meta_dtensor(param, mesh, desired), mesh
        else:
            with collective(f"parallelize's transfer of parameter {name!r} from rank {src_rank}", mesh, timeout):
                dt, on = (distribute_tensor(param, mesh, desired, src_data_rank=src_rank), mesh) \
                    if exact_in_torch(layout) else _beyond_dtensor(param, mesh, layout, src_rank, views)
        if is_param:
            dt = nn.Parameter(dt, requires_grad=param.requires_grad)
        out[name] = keep_mesh(dt, on)
    return out


def placed_tensor(module: nn.Module, name: str) -> torch.Tensor:
    """The parameter, or else the buffer, that ``name`` (dotted) names in ``module``."""
    return _placed(module, name)[0]


def _placed(module: nn.Module, name: str) -> tuple:
    """``(placed_tensor(module, name), whether it is a parameter)``: one in the owner's ``_parameters``
    (not an ``isinstance`` test: one deep-copied under ``LocalTensorMode`` is no ``nn.Parameter``)."""
    owner, _, leaf = name.rpartition(".")
    sub = module.get_submodule(owner)
    params = parameters_of(sub)
    return (params[leaf], True) if leaf in params else (sub.get_buffer(leaf), False)


def local_value(full: torch.Tensor, layout, mesh, rank: int | None = None) -> torch.Tensor:
    """What rank ``rank`` (by default this process's) of the 1-D ``mesh`` holds of the global
    value ``full`` laid out ``layout``: its chunk of every packed part, its group's heads.

    >>> import tpfn
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> mesh = init_device_mesh("cpu", (1,))
    >>> local_value(torch.arange(8), tpfn.Shard(0, parts=(4, 2, 2)), mesh).tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
    """
    if not isinstance(layout, Shard):
        return full
    return _local_value(full, layout, mesh.size(), mesh.get_coordinate()[0] if rank is None else rank)


@per_rank  # LocalTensorMode: each simulated rank its own chunks
def _local_value(full: torch.Tensor, layout: Shard, n: int, rank: int) -> torch.Tensor:
    dim = layout.dim % full.ndim
    return torch.cat([full.narrow(dim, start, size)
                      for start, size in shard_ranges(full.shape[dim], layout, n, rank)], dim)


def _beyond_dtensor(param, mesh, layout: Shard, src_rank, views: dict) -> tuple:
    """(the DTensor, its mesh) of a parameter laid out as DTensor has no placement for."""
    whole = param.detach() if src_rank is None else distribute_tensor(
        param.detach(), mesh, [_dt.Replicate()], src_data_rank=src_rank).to_local()
    local, dim, n = local_value(whole, layout, mesh), layout.dim % param.ndim, mesh.size()
    on, placements = mesh, [_dt.Shard(dim)]
    if layout.copies(n) > 1:
        if layout.heads not in views:
            views[layout.heads] = heads_mesh(mesh, layout.heads)
        on, placements = views[layout.heads], [_dt.Shard(dim), _dt.Replicate()]
    dt = DTensor.from_local(local.contiguous(), on, placements, run_check=False,
                            shape=param.shape, stride=param.stride())
    return dt, on


def checked(x: DTensor, slot, mesh, what: str) -> DTensor:
    """``x``, after checking it lives on ``mesh`` in the layout ``slot`` declares."""
    if x.device_mesh != mesh:
        raise LayoutError(f"{what} is a DTensor on {x.device_mesh}, not on the plan's {mesh}; "
                          "parallelize the producing and the consuming module over one mesh.")
    odd = next((p for p in (slot.given, slot.desired) if p is not None and not exact_in_torch(p)), None)
    if odd is not None:
        raise LayoutError(f"{what} is a DTensor, but the plan lays it out {odd!r}, which DTensor "
                          "has no placement for; hand it the local shards the projection makes.")
    if slot.given is not None and not _agree(x.placements, placements(slot.given, x.ndim)):
        current = from_torch(x.placements)[0]
        raise LayoutError(f"{what} arrives laid out {current!r} but the plan declares {slot.given!r}; "
                          f"declare {current!r} there, or redistribute it before the call.")
    return x


def _agree(have: tuple, want: tuple) -> bool:
    """Equal placements, DTensor's partial kinds (an embedding's masked partial) taken as partial sums."""
    return have == want or all(h == w or (h.is_partial() and w.is_partial() and h.reduce_op == w.reduce_op)
                               for h, w in zip(have, want))


def not_a_tensor(x, slot, what: str) -> TypeError:
    if slot.given is None:
        layout = repr(slot.desired)
    elif slot.desired is None:
        layout = repr(slot.given)
    else:
        layout = f"{slot.given!r} -> {slot.desired!r}"
    return TypeError(f"{what} is declared {layout} but is {type(x).__name__}, not a tensor; "
                     "mark it None to leave it alone.")


def global_shape(x, slot, mesh, shapes: Shapes, what: str, *, exact: bool = False) -> tuple:
    """The global shape of an input or output (``what``) arriving at ``slot``. That of a
    sharded local tensor no slot handed on is a ``Guess`` (rank 0's 4 positions may be 7 or
    8) unless the slot moves it or ``exact`` asks: then it is that of the tensor it was
    computed from (``derived_shape``), else the ranks exchange their local shapes
    (``tpfn.interpret.agree``), or all raise the same ``LayoutError``."""
    if isinstance(x, DTensor):
        return tuple(x.shape)
    slot.fit(x, what)
    given = placements(slot.source, x.ndim)
    exact = exact or given != placements(slot.out, x.ndim)
    return shapes.recall(x, given, mesh, what, exact)


def convert(x, slot, mesh, *, local: bool, grad, what: str, shapes: Shapes, cache: dict,
            shape=None, group=None):
    """One input or output through its slot: a local tensor (``local``) or a DTensor in the
    slot's layout. A local tensor handed on gets its gradient back in ``grad`` (None: it
    needs none); ``shape`` is the global shape where the caller knows it better; ``group``: a
    ``tpfn.kernels.Group`` whose column-wise readers read a local replica handed on as it is."""
    if x is None or slot.untouched:
        return x
    src = slot.source
    if isinstance(x, torch.Tensor):
        slot.fit(x, what)
    if isinstance(x, DTensor):
        dt = checked(x, slot, mesh, what)
        if local and group is not None and placements(slot.out, x.ndim)[0].is_replicate():
            return group.replicate(dt.to_local(), from_torch(dt.placements)[0], mesh, tuple(dt.shape), what, cache)
    elif not isinstance(x, torch.Tensor):
        raise not_a_tensor(x, slot, what)
    else:
        if local and slot.grad is not None:  # its gradient handed back as terms (grads=)
            return terms(x, src, slot.out, grad, slot.grad, mesh, what)
        given, out = placements(src, x.ndim), placements(slot.out, x.ndim)
        if shape is None or isinstance(shape, Guess):
            # a DTensor, a move, a gradient moved back: exact (as global_shape decides)
            exact = not local or given != out or (grad is not None and placements(grad, x.ndim) != given)
            if shape is None or exact:
                shape = shapes.recall(x, given, mesh, what, exact)
        elif not isinstance(shape, tuple):
            shape = tuple(shape)
        if local and group is not None and out[0].is_replicate():
            return group.replicate(x, src, mesh, shape, what, cache)
        if local:  # local tensors all the way
            moved = move(x, src, slot.out, grad, mesh, shape, what, cache)
            shapes.remember(moved, out, shape, mesh)
            return moved
        dt = DTensor.from_local(x, mesh, given, run_check=False, shape=shape,
                                stride=contiguous_strides(shape))
    if slot.desired is not None:
        desired, current = placements(slot.desired, x.ndim), dt.placements
        if desired != current:  # a no-op redistribute would reduce partial gradients
            bound = bound_of(cache, mesh)
            try:
                with bound.issuing():
                    dt = dt.redistribute(mesh, desired)
            except RuntimeError as error:
                raise failed(what, from_torch(current), from_torch(desired), error, bound) from error
    if not local:
        return dt
    out = dt.to_local(grad_placements=None if grad is None else placements(grad, x.ndim))
    shapes.remember(out, dt.placements, dt.shape, mesh)
    return out


def per_head(x, heads: int, mesh, what: str, cache: dict):
    """This rank's heads' rows of ``x``, replicated and laid out per head, ``(batch * heads, ...)``
    in dim 0 (``per_rank(inputs=...)``); its gradient is gathered back whole."""
    if not isinstance(x, torch.Tensor) or isinstance(x, DTensor) or x.ndim == 0 or x.shape[0] % heads:
        shape = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise LayoutError(f"{what} is laid out per head, (batch * {heads}, ...) in dim 0, on every rank alike "
                          f"(per_rank(inputs=...)), but it is {'a DTensor' if isinstance(x, DTensor) else shape}; "
                          "hand it the whole tensor, or give per_rank its number of heads.")
    v = x.unflatten(0, (-1, heads))
    grad = Shard(1) if x.requires_grad else None
    return move(v, Replicate(), Shard(1), grad, mesh, tuple(v.shape), what, cache).flatten(0, 1)


def _spec(spec, kind, name: str, side: str):
    if isinstance(spec, Style) and all(isinstance(s, kind) for s in spec.stages):
        return getattr(spec.normal, side)
    if not isinstance(spec, kind):
        raise TypeError(f"prepare_{side}: 'spec' must be a {name}(...) style or the spec a "
                        f"mounted module holds (got {spec!r}).")
    return spec


def _source(x):
    """The tensor ``x`` is, seen through module hooks' identity wrappers (each input its own):
    the autograd node and output it wraps, else ``(x, None)``."""
    node = None if torch.compiler.is_compiling() else getattr(x, "grad_fn", None)
    return unhooked(node, x.output_nr) if isinstance(node, HookIdentity) else (x, None)


class Context:
    """A mounted module's plumbing for its slots (the interpreter's; the public functions make a
    fresh one): ``names``, its forward's positional input names (for inputs passed by keyword);
    ``where``, its FQN in errors; ``grads``, the layout of each local input's gradient (by default
    its layout's cotangent); ``shapes``, the model's shape memory; ``cache``, its moves' steps;
    ``group``, the ``tpfn.kernels.Group`` whose readers read its local replicas (None: none)."""

    __slots__ = ("names", "where", "grads", "shapes", "cache", "group")

    def __init__(self, where: str, names: tuple = (), grads: tuple = (), shapes: Shapes | None = None,
                 cache: dict | None = None, group=None):
        self.names, self.where, self.grads, self.group = names, where, grads, group
        self.shapes, self.cache = shapes or Shapes(), {} if cache is None else cache


def prepare_inputs(args: tuple, kwargs: dict, spec: Style | Inputs, mesh: DeviceMesh, *, names: tuple = (),
                   where: str = "prepare_inputs") -> tuple:
    """``(args, kwargs)`` with every input that ``spec`` (a ``prepare_in(...)`` style, or the
    ``Inputs`` of a mounted module) names converted (new containers); ``names``: the forward's
    positional input names, for inputs passed by keyword; ``where`` names the caller in errors.

    >>> import torch, tpfn
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> mesh = init_device_mesh("cpu", (1,))
    >>> (x,), _ = prepare_inputs((torch.ones(2, 3),), {}, tpfn.prepare_in(tpfn.Shard(0)), mesh)
    >>> x.placements, x.shape
    ((Shard(dim=0),), torch.Size([2, 3]))
    """
    return inputs(args, kwargs, spec, mesh, Context(where, names))


def inputs(args: tuple, kwargs: dict, spec: Style | Inputs, mesh: DeviceMesh, ctx: Context,
           first_shape: tuple | None = None) -> tuple:
    """``prepare_inputs`` for a mounted module (``ctx``); ``first_shape``: input 0's global shape
    where the caller knows it."""
    spec, where, names, grads = _spec(spec, Inputs, "prepare_in", "inputs"), ctx.where, ctx.names, ctx.grads
    if spec.arity is not None and len(args) != spec.arity:
        raise LayoutError(f"{where} is called with {len(args)} positional input{'s' * (len(args) != 1)}, "
                          f"but its plan takes exactly {spec.arity} (prepare_in(..., arity={spec.arity}): "
                          "PyTorch's PrepareModuleInput takes one input layout per positional input); give "
                          "one layout per positional input (None leaves that input alone), or pass the "
                          "other inputs by keyword.")
    args, kwargs = list(args), dict(kwargs)
    done: list = []  # an input passed at several positions moves once (one gradient back)

    def one(x, slot, grad, what, shape=None):
        source, index = _source(x)
        for seen, i, at, back, out in done:
            if seen is source and i == index and at == slot and back == grad:
                return out
        out = convert(x, slot, mesh, local=bool(spec.local), grad=grad, what=what,
                      shapes=ctx.shapes, cache=ctx.cache, shape=shape, group=ctx.group)
        if isinstance(x, torch.Tensor):
            done.append((source, index, slot, grad, out))
        return out

    for i, slot in enumerate(spec.slots):
        what = f"input {i} of {where}"
        grad = grads[i] if i < len(grads) else (None if slot.untouched else cotangent(slot.out)[0])
        shape = first_shape if i == 0 else None
        if i < len(args):
            args[i] = one(args[i], slot, grad, what, shape)
        elif i < len(names) and names[i] in kwargs:
            kwargs[names[i]] = one(kwargs[names[i]], slot, grad, what, shape)
    for name, slot in spec.kwargs:
        i = names.index(name) if name in names else len(args)
        if name in kwargs:
            kwargs[name] = one(kwargs[name], slot, cotangent(slot.out)[0],
                               f"keyword input {name!r} of {where}")
        elif i < len(args) and (i >= len(spec.slots) or spec.slots[i].untouched):  # passed by position
            args[i] = one(args[i], slot, cotangent(slot.out)[0], f"keyword input {name!r} of {where} "
                          f"(passed as input {i})")
    return tuple(args), kwargs


def prepare_outputs(outputs: object, spec: Style | Outputs, mesh: DeviceMesh, *,
                    where: str = "prepare_outputs") -> object:
    """``outputs`` with every output that ``spec`` (a ``prepare_out(...)`` style, or the
    ``Outputs`` of a mounted module) names converted (a new container).

    >>> import torch, tpfn
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> mesh = init_device_mesh("cpu", (1,))
    >>> out = prepare_outputs(torch.ones(4, 2), tpfn.prepare_out(tpfn.Replicate(),
    ...                       given=tpfn.Partial()), mesh)
    >>> type(out).__name__, out.shape              # a local tensor, the partial sums summed
    ('Tensor', torch.Size([4, 2]))
    """
    return outputs_of(outputs, spec, mesh, Context(where))


def outputs_of(outputs: object, spec: Style | Outputs, mesh: DeviceMesh, ctx: Context) -> object:
    """``prepare_outputs`` for a mounted module (``ctx``)."""
    spec, where, shapes, cache = _spec(spec, Outputs, "prepare_out", "outputs"), ctx.where, ctx.shapes, ctx.cache
    local = True if spec.local is None else spec.local

    def one(x, slot, what):
        return convert(x, slot, mesh, local=local, grad=cotangent(slot.out)[0], what=what,
                       shapes=shapes, cache=cache)

    def check(n):
        if len(spec.slots) > n:
            raise LayoutError(f"{where} returned {n} outputs; the plan prepares "
                              f"{len(spec.slots)}: give prepare_out one layout (or None) per output.")

    if spec.keys and not isinstance(outputs, dict):
        raise LayoutError(f"{where} returned a {type(outputs).__name__}, but the plan lays out outputs by "
                          f"key ({', '.join(repr(k) for k, _ in spec.keys)}), which only a dict has; give "
                          "prepare_out one layout per position instead.")
    if isinstance(outputs, dict):
        out = type(outputs)(outputs)
        names = list(out)
        check(len(names))
        for i, slot in enumerate(spec.slots):
            out[names[i]] = one(out[names[i]], slot, f"output {i} of {where}")
        for key, slot in spec.keys:
            if key in out:
                out[key] = one(out[key], slot, f"output {key!r} of {where}")
        return out
    if isinstance(outputs, (tuple, list)):
        check(len(outputs))
        items = list(outputs)
        for i, slot in enumerate(spec.slots):
            items[i] = one(items[i], slot, f"output {i} of {where}")
        if isinstance(outputs, list):
            return items
        return type(outputs)(*items) if hasattr(outputs, "_fields") else type(outputs)(items)
    if len(spec.slots) > 1:
        raise LayoutError(f"{where} returned one output; the plan prepares {len(spec.slots)}: "
                          "give prepare_out one layout.")
    return one(outputs, spec.slots[0], f"the output of {where}") if spec.slots else outputs
