"""Local execution: built-in cores compute on local tensors, collectives only at the slots.

DTensor runs every op inside a parallelized module through its sharding propagation.
For the modules whose layout rules tpfn knows (column-/row-wise ``nn.Linear`` and
``nn.Embedding``, sequence-parallel norms and dropout), that work is known in advance:
a *kernel* states the layout of the module's local output and of its input's gradient.
So the hooks hand the module its parameters' local shards (their gradients flow back to
the DTensor parameters), move the input to the wanted layout with one autograd-aware
transition (its backward is the dual transition: Megatron's f and g), and move the local
output to the wanted layout the same way. Parameters stay DTensors for optimizers,
FSDP2 and checkpoints; the numbers are the ones DTensor computes.

>>> from tpfn import colwise, rowwise
>>> kernel_for(colwise().core, nn.Linear(4, 8)).output
Shard(dim=-1)
>>> kernel_for(rowwise().core, nn.Linear(4, 8)).inputs
((Shard(dim=-1), Shard(dim=-1)),)
"""

from __future__ import annotations

import functools

import attrs
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import tensor as _dt
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._redistribute import redistribute_local_tensor

from tpfn.shapes import contiguous_strides
from tpfn.algebra import chunk_bounds, transition
from tpfn.errors import CollectiveError
from tpfn.layout import Partial, Replicate, Shard, from_torch, to_torch

__all__ = [
    "Kernel", "kernel_for", "on_shards_kernel", "move", "placements", "failed", "local_params",
    "param_slots",
    "vocab_mask", "dropout_slice",
]


@attrs.frozen
class Kernel:
    """What a module computes on local tensors, in layouts.

    ``output``: the layout of its local output (``Partial()`` before a row-wise reduction;
    None: handed on untouched); ``inputs``: per positional input, ``(wanted, grad)``, the
    layout it computes with and the layout of the gradient it computes for it (None: no
    gradient, e.g. token ids); ``grads``: parameter name -> layout of its local gradient
    where that differs from the parameter's own; ``partial_bias``: a bias added once to
    partial sums; ``vocab``: an embedding sharded over its vocabulary (ids outside the
    rank's slice masked); ``random``: how its random draws are made on shards, ``"fork"``
    (each rank its own stream, ``tpfn.rng.sharded``) or ``"slice"`` (an ``nn.Dropout``
    applies its slice of the whole tensor's mask, as one device draws it).
    """

    output: object
    inputs: tuple = ()
    grads: tuple = ()
    partial_bias: bool = False
    vocab: bool = False
    random: object = None

    def out_shape(self, module: nn.Module, in_shape):
        """The global shape of the output for input 0 of global shape ``in_shape`` (None:
        unknown to the kernel)."""
        if in_shape is None:
            return None
        if isinstance(module, nn.Linear):
            return (*in_shape[:-1], module.out_features)
        if isinstance(module, nn.Embedding):
            return (*in_shape, module.embedding_dim)
        if self.inputs and self.inputs[0][0] == self.output:  # per position: shape kept
            return in_shape
        return None


def kernel_for(core, module: nn.Module):
    """The kernel of a built-in core on a module, or None where only DTensor knows the layouts."""
    kind = type(module)
    if core.kind == "sequence_parallel":
        replicated = tuple((n, Partial()) for n, _ in module.named_parameters())
        seq = Shard(core.dim)
        random = ("slice" if kind.forward is nn.Dropout.forward
                  else "fork" if isinstance(module, nn.modules.dropout._DropoutNd) else None)
        return Kernel(seq, ((seq, seq),), grads=replicated, random=random)
    if kind.forward is nn.Linear.forward:
        if core.kind == "colwise":
            return Kernel(Shard(-1, core.parts), ((Replicate(), Partial()),))
        features = Shard(-1, core.parts)
        return Kernel(Partial(), ((features, features),), partial_bias=module.bias is not None)
    if kind.forward is nn.Embedding.forward:
        if core.kind == "colwise":
            return Kernel(Shard(-1, core.parts), ((Replicate(), None),))
        if module.padding_idx is None and not module.scale_grad_by_freq:  # masked ids count
            return Kernel(Partial(), ((Replicate(), None),), vocab=True)
    return None


def on_shards_kernel(stage) -> Kernel:
    """The kernel an ``on_shards(...)`` stage states."""
    return Kernel(stage.output, tuple(zip(stage.wants, stage.grads)), grads=stage.param_grads,
                  random="fork")


def _spec(mesh, placement, shape: tuple, dtype) -> DTensorSpec:
    """The spec of a tensor of global ``shape`` laid out by a torch ``placement``."""
    meta = TensorMeta(torch.Size(shape), contiguous_strides(shape), dtype)
    return DTensorSpec(mesh, (placement,), tensor_meta=meta)


def failed(what: str, src, dst, error: Exception) -> CollectiveError:
    """The error for a collective that failed while moving ``what`` from layout src to dst."""
    kinds = " and ".join(s.collective.replace("_", "-") for s in transition(src, dst) if s.collective)
    return CollectiveError(
        f"rank {dist.get_rank()}: the {kinds} that moves {what} ({src[0]!r} -> {dst[0]!r}) "
        f"failed: {error}. Another rank has most likely failed (its own error says why) or runs "
        "another plan; the wait is bounded by the process group's timeout "
        "(init_process_group(timeout=...))."
    )


def redistribute(x: torch.Tensor, src_spec, dst_spec, what: str) -> torch.Tensor:
    """``redistribute_local_tensor``, with a failed collective named after the slot it served."""
    try:
        return redistribute_local_tensor(x, src_spec, dst_spec)
    except RuntimeError as error:
        src, dst = from_torch(src_spec.placements), from_torch(dst_spec.placements)
        raise failed(what, src, dst, error) from error


class _Move(torch.autograd.Function):
    """One transition forward, its dual backward, on local tensors."""

    @staticmethod
    def forward(ctx, x, forward_specs, backward_specs, what):
        ctx.backward_specs, ctx.what = backward_specs, what
        if forward_specs is None:
            return x.view_as(x)
        return redistribute(x, *forward_specs, what)

    @staticmethod
    def backward(ctx, grad):
        if ctx.backward_specs is None:
            return grad, None, None, None
        moved = redistribute(grad.contiguous(), *ctx.backward_specs, f"the gradient of {ctx.what}")
        return moved, None, None, None


@functools.lru_cache(maxsize=4096)
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


@functools.lru_cache(maxsize=1024)
def placements(layout, ndim: int) -> tuple:
    """The torch placements of a 1-D layout for a tensor of ``ndim`` dims (shard dims
    normalized)."""
    return to_torch(layout, ndim)


def move(x: torch.Tensor, src, dst, grad, mesh, global_shape: tuple, what: str = "a tensor"):
    """Local tensor ``x`` in layout ``src`` -> ``dst``; its gradient arrives in ``grad``
    (None: it needs none) and leaves in ``src``'s cotangent layout. ``what`` names it in
    errors."""
    shape = tuple(global_shape)
    if torch.compiler.is_compiling():
        return _traced_move(x, src, dst, grad, mesh, shape)
    forward_specs, backward_specs = _specs(mesh, src, dst, grad, shape, x.dtype)
    if not (x.requires_grad and torch.is_grad_enabled()):
        return redistribute(x, *forward_specs, what) if forward_specs else x
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


class _PartialBias(torch.autograd.Function):
    """A replicated bias as one term of a sum over ``n`` ranks: ``b / n`` forward, and the
    whole gradient backward (DTensor's Replicate -> Partial, so the numbers match)."""

    @staticmethod
    def forward(ctx, bias, n):
        return bias / n

    @staticmethod
    def backward(ctx, grad):
        return grad, None


@functools.lru_cache(maxsize=4096)
def _grad_spec(spec: DTensorSpec, grads) -> DTensorSpec:
    if grads is None or grads == spec.placements:
        return spec
    return DTensorSpec(spec.mesh, grads, tensor_meta=spec.tensor_meta)


class _View(torch.autograd.Function):
    """A DTensor parameter's local shard; its gradient flows back as a DTensor laid out
    ``spec`` (DTensor's own ``to_local``, without re-deriving the spec every backward)."""

    @staticmethod
    def forward(ctx, param, spec):
        ctx.spec = spec
        return param._local_tensor.view_as(param._local_tensor)

    @staticmethod
    def backward(ctx, grad):
        return DTensor(grad.contiguous(), ctx.spec, requires_grad=False), None


def param_slots(module: nn.Module) -> tuple:
    """``(owner, name, full name)`` of every parameter of the module and its submodules, a
    tied parameter's slots under its first name."""
    names = {id(p): n for n, p in module.named_parameters()}
    return tuple((owner, name, names[id(p)])
                 for _, owner in module.named_modules(remove_duplicate=False)
                 for name, p in owner._parameters.items() if p is not None)


def local_params(slots: tuple, kernel: Kernel, mesh) -> list:
    """The local views the module computes with: ``(owner, name, view)`` for every DTensor
    parameter in ``slots`` (``param_slots``); a tied parameter gets one view."""
    grads = dict(kernel.grads)
    made, views = {}, []
    for owner, name, full in slots:
        param = owner._parameters[name]
        if not isinstance(param, DTensor):
            continue
        view = made.get(id(param))
        if view is None:
            view = _view(param, grads.get(full))
            if kernel.partial_bias and full == "bias" and mesh.size() > 1:
                view = _PartialBias.apply(view, mesh.size())
            made[id(param)] = view
        views.append((owner, name, view))
    return views


def _view(param: DTensor, grad):
    grads = None if grad is None else to_torch(grad)
    if torch.compiler.is_compiling():
        return param.to_local(grad_placements=grads)
    if param.requires_grad and torch.is_grad_enabled():
        return _View.apply(param, _grad_spec(param._spec, grads))
    return param._local_tensor


def vocab_mask(ids: torch.Tensor, module: nn.Embedding, mesh):
    """(local ids, mask of ids outside this rank's vocabulary slice), as DTensor computes them."""
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
