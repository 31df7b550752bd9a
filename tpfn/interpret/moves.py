"""Autograd-aware moves of local tensors between layouts, and the local views a kernel uses.

DTensor runs every op inside a parallelized module through its sharding propagation. Where
tpfn knows a module's layouts (a ``Kernel``), that work is known in advance: the module is
handed its parameters' local shards (their gradients flow back to the DTensor parameters),
and each input and output is moved to the wanted layout with one autograd-aware transition
whose backward is the dual transition (Megatron's f and g). The numbers are the ones DTensor
computes. Spec caches belong to their caller (one module on one mesh), never to the process.

>>> from tpfn.layout import Replicate, Shard
>>> placements(Shard(-1), 3)
(Shard(dim=2),)
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import tensor as _dt
from torch.distributed.tensor import DTensor

from tpfn._torch import (
    DTensorSpec, TensorMeta, assert_async, local_tensor, redistribute_local_tensor, spec_of,
)
from tpfn.algebra import chunk_bounds, contiguous_strides, transition
from tpfn.errors import CollectiveError
from tpfn.layout import from_torch, to_torch

__all__ = ["move", "placements", "failed", "collective", "param_slots", "local_params", "vocab_mask",
           "dropout_slice"]


_placements = functools.lru_cache(maxsize=1024)(to_torch)


def placements(layout, ndim: int) -> tuple:
    """The torch placements of a 1-D layout for a tensor of ``ndim`` dims (shard dims
    normalized); remembered, except in compiled code (which traces the conversion once)."""
    if torch.compiler.is_compiling():
        return to_torch(layout, ndim)
    return _placements(layout, ndim)


def failed(what: str, src, dst, error: Exception, mesh) -> CollectiveError:
    """The error for a collective that failed while moving ``what`` from layout src to dst."""
    kinds = " and ".join(s.collective.replace("_", "-") for s in transition(src, dst) if s.collective)
    return _failed(f"the {kinds} that moves {what} ({src[0]!r} -> {dst[0]!r})", error, mesh)


def _failed(what: str, error: Exception, mesh) -> CollectiveError:
    return CollectiveError(
        f"rank {dist.get_rank() if dist.is_initialized() else mesh.get_local_rank()}: {what} "
        f"failed: {error}. Another rank has most likely failed "
        "(its own error says why) or runs another plan; the wait is bounded by the process "
        "group's timeout (init_process_group(timeout=...))."
    )


@contextlib.contextmanager
def collective(what: str, mesh):
    """Inside, a collective that fails raises a ``CollectiveError`` naming ``what`` it served
    (``"the all-reduce of cross_entropy's per-token maxima"``)."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as error:
        raise _failed(what, error, mesh) from error


def _first_order(what: str) -> None:
    """Refuse a backward that builds a graph for a second one (``create_graph=True``): the
    moves' backward collectives are not differentiated again, so its numbers would be wrong."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"a second-order gradient (backward with create_graph=True) runs through {what}, "
            "whose backward tpfn does not differentiate again; compute such a term (a gradient "
            "penalty) on a model that is not parallelized, or leave the module out of the plan.")


def _redistribute(x: torch.Tensor, src_spec, dst_spec, what: str) -> torch.Tensor:
    """``redistribute_local_tensor``, with a failed collective named after the slot it served."""
    try:
        return redistribute_local_tensor(x, src_spec, dst_spec)
    except RuntimeError as error:
        src, dst = from_torch(src_spec.placements), from_torch(dst_spec.placements)
        raise failed(what, src, dst, error, src_spec.mesh) from error


class _Move(torch.autograd.Function):
    """One transition forward, its dual backward, on local tensors."""

    @staticmethod
    def forward(ctx, x, forward_specs, backward_specs, what):
        ctx.backward_specs, ctx.what = backward_specs, what
        if forward_specs is None:
            return x.view_as(x)
        return _redistribute(x, *forward_specs, what)

    @staticmethod
    def backward(ctx, grad):
        _first_order(ctx.what)
        if ctx.backward_specs is None:
            return grad, None, None, None
        moved = _redistribute(grad.contiguous(), *ctx.backward_specs, f"the gradient of {ctx.what}")
        return moved, None, None, None


def _spec(mesh, placement, shape: tuple, dtype) -> DTensorSpec:
    """The spec of a tensor of global ``shape`` laid out by a torch ``placement``."""
    meta = TensorMeta(torch.Size(shape), contiguous_strides(shape), dtype)
    return DTensorSpec(mesh, (placement,), tensor_meta=meta)


def _specs(mesh, src, dst, grad, global_shape: tuple, dtype) -> tuple:
    """(forward specs, backward specs) of a move, each None where nothing moves."""
    if mesh.size() == 1:  # one rank: every layout is the whole tensor
        return None, None
    ndim = len(global_shape)
    src, dst = placements(src, ndim)[0], placements(dst, ndim)[0]
    back = None if grad is None else placements(grad, ndim)[0]
    target = _dt.Replicate() if src.is_partial() else src
    forward = None if src == dst else (
        _spec(mesh, src, global_shape, dtype), _spec(mesh, dst, global_shape, dtype))
    backward = None if back is None or back == target else (
        _spec(mesh, back, global_shape, dtype), _spec(mesh, target, global_shape, dtype))
    return forward, backward


def move(x: torch.Tensor, src, dst, grad, mesh, global_shape: tuple, what: str, cache: dict):
    """Local tensor ``x`` in layout ``src`` -> ``dst``; its gradient arrives in ``grad``
    (None: it needs none) and leaves in ``src``'s cotangent layout. ``what`` names it in
    errors; ``cache`` keeps the specs of moves on ``mesh`` seen before."""
    shape = tuple(global_shape)
    if torch.compiler.is_compiling():
        return _traced_move(x, src, dst, grad, mesh, shape)
    key = (src, dst, grad, shape, x.dtype)
    specs = cache.get(key)
    if specs is None:
        specs = cache[key] = _specs(mesh, src, dst, grad, shape, x.dtype)
    forward_specs, backward_specs = specs
    if not (x.requires_grad and torch.is_grad_enabled()):
        return _redistribute(x, *forward_specs, what) if forward_specs else x
    if forward_specs is None and backward_specs is None:
        return x
    # Always through _Move: functional collectives differentiate themselves otherwise
    # (an all-reduce's gradient would be all-reduced again).
    return _Move.apply(x, forward_specs, backward_specs, what)


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


class _BiasOnce(torch.autograd.Function):
    """A replicated bias as one term of a sum over ``n`` ranks: ``b / n`` forward, and the
    whole gradient backward (DTensor's Replicate -> Partial, so the numbers match)."""

    @staticmethod
    def forward(ctx, bias, n):
        return bias / n

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _View(torch.autograd.Function):
    """A DTensor parameter's local shard; its gradient flows back as a DTensor laid out
    ``spec`` (DTensor's own ``to_local``, without re-deriving the spec every backward)."""

    @staticmethod
    def forward(ctx, param, spec):
        ctx.spec = spec
        return local_tensor(param).view_as(local_tensor(param))

    @staticmethod
    def backward(ctx, grad):
        _first_order("a parameter's local shard")
        return DTensor(grad.contiguous(), ctx.spec, requires_grad=False), None


def param_slots(module: nn.Module, owned: tuple) -> tuple:
    """``(owner, name, full name)`` of every slot holding one of the ``owned`` parameters of
    the module and its submodules, a tied parameter's slots under its first name."""
    names = {id(p): n for n, p in module.named_parameters()}
    owned = set(owned)
    return tuple((owner, name, names[id(p)])
                 for _, owner in module.named_modules(remove_duplicate=False)
                 for name, p in owner._parameters.items()
                 if p is not None and names[id(p)] in owned)


def local_params(slots: tuple, kernel, mesh, cache: dict) -> list:
    """The local views the module computes with: ``(owner, name, view)`` for every DTensor
    parameter in ``slots`` (``param_slots``); a tied parameter gets one view. ``cache``
    keeps the gradient specs seen before."""
    grads = dict(kernel.grads)
    made, views = {}, []
    for owner, name, full in slots:
        param = owner._parameters[name]
        if not isinstance(param, DTensor):
            continue
        view = made.get(id(param))
        if view is None:
            view = _view(param, grads.get(full), cache)
            if kernel.bias_once and full == "bias" and mesh.size() > 1:
                view = _BiasOnce.apply(view, mesh.size())
            made[id(param)] = view
        views.append((owner, name, view))
    return views


def _view(param: DTensor, grad, cache: dict):
    grads = None if grad is None else to_torch(grad)
    if torch.compiler.is_compiling():
        return param.to_local(grad_placements=grads)
    if param.requires_grad and torch.is_grad_enabled():
        key = (spec_of(param), grads)
        spec = cache.get(key)
        if spec is None:
            spec = cache[key] = spec_of(param) if grads is None or grads == param.placements else \
                DTensorSpec(param.device_mesh, grads, tensor_meta=spec_of(param).tensor_meta)
        return _View.apply(param, spec)
    return local_tensor(param)


def vocab_mask(ids: torch.Tensor, module: nn.Embedding, mesh, what: str):
    """(local ids, mask of ids outside this rank's vocabulary slice), as DTensor computes them;
    an id outside the whole vocabulary raises on every rank, as on one device."""
    n = module.num_embeddings
    assert_async(((ids >= 0) & (ids < n)).all(),
                 f"{what}: an id lies outside the vocabulary [0, {n}) (index out of range in self)")
    offset, size = chunk_bounds(module.num_embeddings, mesh.size(), mesh.get_coordinate()[0])
    mask = (ids < offset) | (ids >= offset + size)
    return (ids - offset).masked_fill(mask, 0), mask


def dropout_slice(module: nn.Dropout, local: torch.Tensor, global_shape: tuple, dim: int, mesh):
    """This rank's slice of the dropout noise (mask / (1 - p)) one device draws for the
    whole tensor: the same draws from the default generator, so the ranks stay in step."""
    whole = torch.ones(global_shape, dtype=local.dtype, device=local.device)
    noise = nn.functional.dropout(whole, module.p, training=True)
    start, _ = chunk_bounds(global_shape[dim], mesh.size(), mesh.get_coordinate()[0])
    return noise.narrow(dim, start, local.shape[dim]).clone()  # frees the rest of the noise
