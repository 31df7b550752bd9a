"""Gradients: reduced once and in bulk where they come out partial; clipped across meshes.

A replicated parameter used on sharded activations (a sequence-parallel norm, a per-head
norm) gets a partial gradient: each rank holds its slice's contribution. Left so, every
optimizer op on it would all-reduce it again (Adam: three times per parameter per step).
``parallelize`` registers such parameters with ``reduce_partial_grads``: at the end of each
backward, all of their gradients on a mesh are summed in one all-reduce of one flat buffer,
and the optimizer sees replicated gradients.

With tensor parallelism and FSDP2 together, the parameters tpfn shards live on the 2-D
(data, tensor) mesh while parameters no plan binds live on the data mesh alone (or are
plain tensors); ``torch.nn.utils.clip_grad_norm_`` cannot combine norms across meshes.
``clip_grad_norm_`` here adds up each gradient's local contribution over the mesh dims
that shard it (a replica counts once), which gives the single-device norm whatever the
meshes, and scales every gradient by the same factor.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["clip_grad_norm_", "reduce_partial_grads"]


class _PartialGrads:
    """Collects the partial gradients of one backward and reduces them when it ends."""

    def __init__(self):
        self.pending: list = []
        self.reduced: dict = {}  # id(param) -> the placements its gradient was reduced from

    def watch(self, param) -> None:
        """Reduce ``param``'s partial gradients in bulk at the end of each backward."""
        param.register_hook(lambda grad: self._accumulating(param, grad))
        param.register_post_accumulate_grad_hook(self._accumulated)

    def _accumulating(self, param, grad):
        """Before a second backward adds its partial gradient to a reduced one, hand the
        reduced one back as a partial sum (kept on the first rank, zeros elsewhere: no
        communication), so the two add up locally and are reduced once more, in bulk."""
        old, placements = param.grad, self.reduced.pop(id(param), None)
        if isinstance(old, DTensor) and placements is not None:
            coordinate = old.device_mesh.get_coordinate()
            first = all(coordinate[i] == 0 for i, p in enumerate(placements) if p.is_partial())
            local = old.to_local() if first else torch.zeros_like(old.to_local())
            param.grad = DTensor.from_local(local, old.device_mesh, placements, run_check=False,
                                            shape=old.shape, stride=old.stride())
        return grad

    def _accumulated(self, param) -> None:
        grad = param.grad
        if any(p is param for p in self.pending):
            return
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            if not self.pending:
                torch.autograd.Variable._execution_engine.queue_callback(self.flush)
            self.pending.append(param)

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        groups: dict = {}
        for param in pending:
            groups.setdefault((param.grad.device_mesh, param.grad.placements, param.grad.dtype),
                              []).append(param)
        for (mesh, placements, _), params in groups.items():
            grads = [p.grad for p in params]
            flat = torch.cat([g.to_local().reshape(-1) for g in grads])
            for dim, placement in enumerate(placements):
                if placement.is_partial() and mesh.size(dim) > 1:
                    flat = funcol.wait_tensor(funcol.all_reduce(flat, "sum", (mesh, dim)))
            replicated = [Replicate() if p.is_partial() else p for p in placements]
            for param, grad, piece in zip(params, grads, flat.split([g.to_local().numel() for g in grads])):
                param.grad = DTensor.from_local(piece.view_as(grad.to_local()), mesh, replicated,
                                                run_check=False, shape=grad.shape, stride=grad.stride())
                self.reduced[id(param)] = placements


reduce_partial_grads = _PartialGrads()
"""Bulk-reduces the partial gradients of the parameters it ``watch``-es, once per backward."""


def _reduce(value: torch.Tensor, mesh, dims, op) -> torch.Tensor:
    for dim in dims:  # one mesh dim at a time: sums and maxima are associative
        dist.all_reduce(value, op=op, group=mesh.get_group(dim))
    return value


def _norm(grads: list, norm_type: float) -> torch.Tensor:
    """The norm of all the gradients (plain tensors or DTensors on any meshes), on every rank.

    Each gradient's local contribution is added to those of its group (same mesh, same
    sharded mesh dims); each group is reduced once over its sharded dims.
    """
    inf = math.isinf(norm_type)
    combine = torch.maximum if inf else torch.add
    groups: dict = {}
    for g in grads:
        mesh, dims = None, ()
        if isinstance(g, DTensor):
            if any(p.is_partial() for p in g.placements):  # terms of a sum: add them up first
                g = g.redistribute(g.device_mesh, [Replicate() if p.is_partial() else p
                                                   for p in g.placements])
            mesh, dims = g.device_mesh, tuple(i for i, p in enumerate(g.placements) if not p.is_replicate())
            g = g.to_local()
        part = torch.linalg.vector_norm(g, norm_type).double()
        part = part if inf else part ** norm_type
        key = (mesh, dims)
        groups[key] = part if key not in groups else combine(groups[key], part)
    total = torch.zeros((), dtype=torch.float64)
    for (mesh, dims), part in groups.items():
        if mesh is not None:
            part = _reduce(part, mesh, dims, dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
        total = combine(total, part.cpu())
    return total if inf else total ** (1 / norm_type)


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients on any mix of meshes and plain tensors.

    Returns the total norm (a plain tensor, the same on every rank), the one a single
    device would compute for the whole model.

    >>> import torch, torch.nn as nn
    >>> layer = nn.Linear(3, 1)
    >>> layer(torch.ones(2, 3)).sum().backward()
    >>> expected = torch.cat([p.grad.flatten() for p in layer.parameters()]).norm()
    >>> torch.allclose(clip_grad_norm_(layer.parameters(), 1.0), expected)
    True
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    total = _norm(grads, norm_type).float()
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is {total.item()}; "
                           "pass error_if_nonfinite=False to clip anyway.")
    scale = min(1.0, max_norm / (total.item() + 1e-6))
    if scale < 1.0:
        for g in grads:
            g.mul_(scale)
    return total
