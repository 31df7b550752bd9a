"""Autograd-aware moves of local tensors between layouts, and the local views a module computes with.

DTensor runs every op inside a parallelized module through its sharding propagation. Where
tpfn knows a module's layouts (a ``Kernel``), that work is known in advance: the module is
handed local views of its parameters' shards (their gradients flow back to the DTensor
parameters as DTensors), and each input and output is moved to the desired layout with one
autograd node whose backward is the dual transition (Megatron's f and g). The numbers are the
ones DTensor computes, and every autograd observer sees ordinary nodes: a view saves its
DTensor parameter, so an in-place step on it between forward and backward raises autograd's
error, as on one device. Spec caches belong to their caller (one module on one mesh), never
to the process.

>>> from tpfn.layout import Replicate, Shard
>>> placements(Shard(-1), 3)
(Shard(dim=2),)
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.distributed import tensor as _dt
from torch.distributed.tensor import DTensor

from tpfn._torch import (DTensorSpec, HookIdentity, TensorMeta, assert_async, buffers_of, local_tensor,
                         parameters_of, per_rank, redistribute_local_tensor, spec_of)
from tpfn.algebra import chunk_bounds, contiguous_strides, transition
from tpfn.bounded import Bound
from tpfn.bounded import failed as named
from tpfn.bounded import step as plain_step
from tpfn.errors import CollectiveError
from tpfn.interpret.terms import scaled
from tpfn.layout import Partial, from_torch, to_torch

__all__ = ["Moves", "bound_of", "move", "steps", "placements", "failed", "first_order", "param_slots",
           "local_params", "grad_spec", "unhooked", "vocab_mask", "dropout_slice"]

_placements = functools.lru_cache(maxsize=1024)(to_torch)


def placements(layout, ndim: int) -> tuple:
    """The torch placements of a 1-D layout for a tensor of ``ndim`` dims (shard dims
    normalized); remembered, except in compiled code (which traces the conversion once)."""
    if torch.compiler.is_compiling():
        return to_torch(layout, ndim)
    return _placements(layout, ndim)


class Moves(dict):
    """A module's moves, by what they move (``steps``' cache), and the ``Bound`` their
    collectives wait with (None: their group's)."""

    __slots__ = ("bound",)

    def __init__(self, bound: Bound | None = None):
        super().__init__()
        self.bound = bound


def bound_of(cache: dict, mesh) -> Bound:
    """The bound the collectives of the moves in ``cache`` on ``mesh`` wait with."""
    bound = getattr(cache, "bound", None)
    return Bound(mesh.get_group(), mesh.device_type) if bound is None else bound


def failed(what: str, src, dst, error: Exception, bound: Bound) -> CollectiveError:
    """The error for a collective that failed while moving ``what`` from layout src to dst."""
    kinds = " and ".join(s.collective.replace("_", "-") for s in transition(src, dst) if s.collective)
    return named(f"the {kinds} that moves {what} ({src[0]!r} -> {dst[0]!r})", error, bound)


def first_order(what: str) -> None:
    """Refuse a backward that builds a graph for a second one (``create_graph=True``): the
    moves' backward collectives are not differentiated again, so its numbers would be wrong."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"a second-order gradient (backward with create_graph=True) runs through {what}, "
            "whose backward tpfn does not differentiate again; compute such a term (a gradient "
            "penalty) on a model that is not parallelized, or leave the module out of the plan.")


class _Step:
    """One move of a local tensor between torch placements: a plain collective where one
    does it (``tpfn.bounded.step``), else DTensor's ``redistribute_local_tensor``; either
    waits at most ``bound``, and a failed collective is named after the slot it served."""

    __slots__ = ("plain", "specs", "bound")

    def __init__(self, mesh, src, dst, shape: tuple, dtype, bound: Bound):
        self.plain, self.bound = plain_step(src, dst, mesh, shape, bound), bound
        self.specs = (_spec(mesh, src, shape, dtype), _spec(mesh, dst, shape, dtype))

    def __call__(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """``x`` moved (a new tensor: ``x`` is never written)."""
        return self.start(x, what)()

    def start(self, x: torch.Tensor, what: str):
        """The move started, its collective left running: a function that waits for it and
        returns the result (a move that DTensor's path makes is done before this returns)."""
        try:
            if self.plain is None or type(x) is not torch.Tensor or x.device.type == "meta":
                with self.bound.issuing():
                    done = redistribute_local_tensor(x.contiguous(), *self.specs)
                return lambda: done
            finish = self.plain(x, wait=False)
        except RuntimeError as error:
            raise self._failed(what, error) from error

        def wait():
            try:
                return finish()
            except RuntimeError as error:
                raise self._failed(what, error) from error
        return wait

    def _failed(self, what: str, error: Exception) -> CollectiveError:
        src, dst = (from_torch(spec.placements) for spec in self.specs)
        return failed(what, src, dst, error, self.bound)


class _Move(torch.autograd.Function):
    """One transition forward, its dual backward, on local tensors. Where nothing moves forward,
    the output is ``x``'s own memory as a tensor autograd takes for a new one, not a view
    (``x.detach()``): an in-place op on it then writes ``x``, as on one device, where autograd
    refuses an in-place op on a view a custom Function made."""

    @staticmethod
    def forward(ctx, x, forward, backward, what):
        ctx.set_materialize_grads(False)
        ctx.backward, ctx.what = backward, what
        return x.detach() if forward is None else forward(x, what)

    @staticmethod
    def backward(ctx, grad):
        first_order(ctx.what)
        if grad is not None and ctx.backward is not None:
            grad = ctx.backward(grad, f"the gradient of {ctx.what}")
        return grad, None, None, None


def _spec(mesh, placement, shape: tuple, dtype) -> DTensorSpec:
    """The spec of a tensor of global ``shape`` laid out by a torch ``placement``."""
    meta = TensorMeta(torch.Size(shape), contiguous_strides(shape), dtype)
    return DTensorSpec(mesh, (placement,), tensor_meta=meta)


def _steps(mesh, src, dst, grad, global_shape: tuple, dtype, bound: Bound) -> tuple:
    if mesh.size() == 1:  # one rank: every layout is the whole tensor
        return None, None
    ndim = len(global_shape)
    src, dst = placements(src, ndim)[0], placements(dst, ndim)[0]
    back = None if grad is None else placements(grad, ndim)[0]
    target = _dt.Replicate() if src.is_partial() else src
    forward = None if src == dst else _Step(mesh, src, dst, global_shape, dtype, bound)
    backward = None if back is None or back == target else _Step(mesh, back, target, global_shape, dtype, bound)
    return forward, backward


def unhooked(node, nr: int) -> tuple:
    """``(node, output number)`` past module hooks' identity wrappers (output i is input i)."""
    while isinstance(node, HookIdentity):
        node, nr = node.next_functions[nr]
    return node, nr


def steps(src, dst, grad, mesh, global_shape: tuple, dtype, cache: dict) -> tuple:
    """(forward step, backward step) of the move of a local tensor of ``global_shape`` from
    layout ``src`` to ``dst``, its gradient arriving in ``grad`` (None: it needs none) and
    leaving in ``src``'s cotangent layout; each a ``_Step`` (``step(x, what)``, or
    ``step.start(x, what)()``), None where nothing moves. ``cache`` keeps them per move
    (a ``Moves``: with the bound of their collectives)."""
    key = (src, dst, grad, global_shape, dtype)
    found = cache.get(key)
    if found is None:
        found = cache[key] = _steps(mesh, src, dst, grad, global_shape, dtype, bound_of(cache, mesh))
    return found


def move(x: torch.Tensor, src, dst, grad, mesh, global_shape: tuple, what: str, cache: dict):
    """Local tensor ``x`` in layout ``src`` -> ``dst`` (see ``steps``); ``what`` names it in
    errors. A new tensor where something moves: ``x`` is never written."""
    shape = tuple(global_shape)
    if torch.compiler.is_compiling():
        return _traced_move(x, src, dst, grad, mesh, shape)
    forward, backward = steps(src, dst, grad, mesh, shape, x.dtype, cache)
    if not (x.requires_grad and torch.is_grad_enabled()):
        return forward(x, what) if forward else x
    if forward is None and backward is None:
        return x
    # Always through _Move: functional collectives differentiate themselves otherwise
    # (an all-reduce's gradient would be all-reduced again).
    return _Move.apply(x, forward, backward, what)


def _traced_move(x, src, dst, grad, mesh, shape: tuple):
    """``move`` as DTensor operations, which torch.compile traces whole (``_Move`` calls
    into DTensor internals that it skips)."""
    if mesh.size() == 1 or (src == dst and grad is None):
        return x
    ndim = len(shape)
    dt = DTensor.from_local(x, mesh, placements(src, ndim), run_check=False, shape=shape,
                            stride=contiguous_strides(shape))
    if src != dst:
        dt = dt.redistribute(mesh, placements(dst, ndim))
    return dt.to_local(grad_placements=None if grad is None else placements(grad, ndim))


class _View(torch.autograd.Function):
    """A DTensor parameter's local shard; its gradient flows back as a DTensor laid out
    ``spec`` (DTensor's own ``to_local``, without re-deriving the spec every backward). It
    saves the parameter: an in-place op on a DTensor counts on the DTensor's version alone,
    and autograd checks it here, as one device checks the parameter itself."""

    @staticmethod
    def forward(ctx, param, spec):
        ctx.spec = spec
        ctx.save_for_backward(param)
        return local_tensor(param).view_as(local_tensor(param))

    @staticmethod
    def backward(ctx, grad):
        first_order("a parameter's local shard")
        ctx.saved_tensors  # (autograd's version check: the parameter unchanged since the forward)
        return DTensor(grad.contiguous(), ctx.spec, requires_grad=False), None


def param_slots(module: nn.Module, owned: tuple) -> tuple:
    """``(table, name, full name)`` of every slot holding one of the ``owned`` parameters (or
    placed buffers) of the module and its submodules, ``table`` the owner's ``_parameters``
    or ``_buffers``; a tied parameter's slots under its first name."""
    names = {id(p): n for n, p in (*module.named_parameters(), *module.named_buffers())}
    owned = set(owned)
    return tuple((table, name, names[id(p)])
                 for _, owner in module.named_modules(remove_duplicate=False)
                 for table in (parameters_of(owner), buffers_of(owner))
                 for name, p in table.items()
                 if p is not None and id(p) in names and names[id(p)] in owned)


def local_params(slots: tuple, kernel, mesh, cache: dict) -> list:
    """The local views the module computes with: ``(table, name, view)`` for every DTensor
    parameter (or buffer) in ``slots`` (``param_slots``); a tied parameter gets one view.
    ``cache`` keeps the gradient specs seen before."""
    grads = dict(kernel.grads)
    made, views = {}, []
    for owner, name, full in slots:
        param = owner[name]
        if not isinstance(param, DTensor):
            continue
        view = made.get(id(param))
        if view is None:
            view = _view(param, grads.get(full), cache)
            if full == kernel.once and mesh.size() > 1:
                # one term of a sum over the ranks, its gradient whole (DTensor's
                # Replicate -> Partial, so the numbers match)
                view = scaled(view, mesh.size(), 1)
            made[id(param)] = view
        views.append((owner, name, view))
    return views


def _grads(param: DTensor, grad):
    """The torch placements of a local gradient laid out ``grad``; ``Partial()`` is partial
    where the parameter is replicated (a head replicated over a group: within the group)."""
    if isinstance(grad, Partial):
        return tuple(_dt.Partial(grad.op) if p.is_replicate() else p for p in param.placements)
    return to_torch(grad)


def grad_spec(param: DTensor, grad, cache: dict) -> DTensorSpec:
    """The spec of ``param``'s gradient laid out ``grad`` (None: as the parameter)."""
    grads = None if grad is None else _grads(param, grad)
    key = (spec_of(param), grads)
    spec = cache.get(key)
    if spec is None:
        spec = cache[key] = spec_of(param) if grads is None or grads == param.placements else \
            DTensorSpec(param.device_mesh, grads, tensor_meta=spec_of(param).tensor_meta)
    return spec


def _view(param: DTensor, grad, cache: dict):
    if torch.compiler.is_compiling():
        return param.to_local(grad_placements=None if grad is None else _grads(param, grad))
    if param.requires_grad and torch.is_grad_enabled():
        return _View.apply(param, grad_spec(param, grad, cache))
    return local_tensor(param)


def vocab_mask(ids: torch.Tensor, module: nn.Embedding, mesh, what: str):
    """(local ids, mask of ids outside this rank's vocabulary slice), as DTensor computes them;
    an id outside the whole vocabulary raises on every rank, as on one device."""
    n = module.num_embeddings
    assert_async(((ids >= 0) & (ids < n)).all(),
                 f"{what}: an id lies outside the vocabulary [0, {n}) (index out of range in self)")
    return _vocab_slice(ids, n, mesh.size(), mesh.get_coordinate()[0])


@per_rank  # LocalTensorMode: each simulated rank its own slice
def _vocab_slice(ids: torch.Tensor, n: int, k: int, rank: int):
    offset, size = chunk_bounds(n, k, rank)
    mask = (ids < offset) | (ids >= offset + size)
    return (ids - offset).masked_fill(mask, 0), mask


def dropout_slice(module: nn.Dropout, local: torch.Tensor, global_shape: tuple, dim: int, mesh):
    """This rank's slice of the dropout noise (mask / (1 - p)) one device draws for the
    whole tensor: the same draws from the default generator, so the ranks stay in step."""
    whole = torch.ones(global_shape, dtype=local.dtype, device=local.device)
    noise = nn.functional.dropout(whole, module.p, training=True)
    return _noise_slice(noise, dim, local.shape[dim], mesh.size(), mesh.get_coordinate()[0])


@per_rank  # LocalTensorMode: each simulated rank its own slice
def _noise_slice(noise: torch.Tensor, dim: int, size: int, k: int, rank: int) -> torch.Tensor:
    start, _ = chunk_bounds(noise.shape[dim], k, rank)
    return noise.narrow(dim, start, size).clone()  # frees the rest of the noise
