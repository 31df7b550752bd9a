"""Gradient clipping across meshes.

With tensor parallelism and FSDP2 together, the parameters tpfn shards live on the 2-D
(data, tensor) mesh while parameters no plan binds live on the data mesh alone (or are
plain tensors); ``torch.nn.utils.clip_grad_norm_`` cannot combine norms across meshes.
``clip_grad_norm_`` here adds up each gradient's local contribution over the mesh dims
that shard it (a replica counts once), which gives the single-device norm whatever the
meshes, and scales every gradient by the same factor.

With ``invariant=True`` the norm has the same bits at every degree: each gradient's contribution
is summed per chunk of its sharded dim (``tpfn.tree``: 8 equal chunks; a whole gradient whose
dim 0 does not split so, as one), each chunk by the rank that holds it, the chunks' sums put in one
vector in the parameters' order (zeros where another rank holds the chunk: summed exactly over
the ranks) and added up alike on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor, Replicate

from tpfn._torch import global_offset, keep_mesh
from tpfn.bounded import all_reduce, collective
from tpfn.tree import chunks_of

__all__ = ["clip_grad_norm_"]


def _reduce(value: torch.Tensor, mesh, dims, op) -> torch.Tensor:
    for dim in dims:  # one mesh dim at a time: sums and maxima are associative
        with collective(f"clip_grad_norm_'s all-reduce of the gradients' norm over mesh dim {dim}",
                        mesh, dim=dim) as bound:
            value = all_reduce(value, op, bound)
    return value


def _norm(grads: list, norm_type: float) -> torch.Tensor:
    """The norm of all the gradients (plain tensors or DTensors on any meshes), on every rank:
    each gradient's local contribution is added to those of its group (same mesh, same sharded
    mesh dims), and each group is reduced once over its sharded dims."""
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
            part = _reduce(part, mesh, dims, "max" if inf else "sum")
        total = combine(total, part.cpu())
    return total if inf else total ** (1 / norm_type)


def _chunk_sums(g, norm_type: float, chunks: int) -> tuple:
    """``((mesh, sharded mesh dims), k, {chunk: its sum of |x| ** p, or its max})`` of one gradient
    cut into ``k`` chunks, for the chunks this rank holds (each a contiguous copy: laid out alike at
    every degree)."""
    inf = math.isinf(norm_type)
    mesh, mesh_dims, dims, local, offset = None, (), set(), g, None
    if isinstance(g, DTensor):
        if any(p.is_partial() for p in g.placements):
            raise ValueError("clip_grad_norm_(invariant=...): a gradient is a partial sum (its ranks' terms), whose "
                             "sum would not be ordered; sum it first (parallelize sums those it makes).")
        mesh_dims = tuple(i for i, p in enumerate(g.placements) if p.is_shard())
        dims = {g.placements[i].dim % g.ndim for i in mesh_dims}
        mesh, local, offset = g.device_mesh, g.to_local(), global_offset(g)
    if len(dims) > 1:
        raise ValueError(f"clip_grad_norm_(invariant=...): a gradient of shape {tuple(g.shape)} is sharded on dims "
                         f"{sorted(dims)}; invariant mode cuts one sharded dim into chunks.")
    d = dims.pop() if dims else 0
    if g.ndim == 0:
        k, d = 1, None
    else:
        k = chunks if g.shape[d] % chunks == 0 else 1
        if k == 1 and mesh_dims:
            raise ValueError(f"clip_grad_norm_(invariant=...): a gradient's {g.shape[d]} rows in its sharded dim "
                             f"{d} do not split into {chunks} equal chunks; give invariant= a power of two that "
                             "divides them.")
    sums = {}
    width = 1 if d is None else g.shape[d] // k
    first = 0 if d is None or offset is None else offset[d] // width
    for i in range(1 if d is None else local.shape[d] // width):
        part = (local if d is None else local.narrow(d, i * width, width)).contiguous()
        sums[first + i] = part.abs().amax().double() if inf else part.double().abs().pow(norm_type).sum()
    return (mesh, mesh_dims), k, sums


def _canonical_norm(grads: list, norm_type: float, chunks: int) -> torch.Tensor:
    """The norm of all the gradients in invariant mode (the module docstring)."""
    inf = math.isinf(norm_type)
    found = [_chunk_sums(g, norm_type, chunks) for g in grads]
    length = sum(k for _, k, _ in found)
    vectors: dict = {}
    start = 0
    for group, k, sums in found:
        vector = vectors.setdefault(group, torch.zeros(length, dtype=torch.float64))
        for c, value in sums.items():
            vector[start + c] = value
        start += k
    whole = torch.zeros(length, dtype=torch.float64)
    for (mesh, dims), vector in vectors.items():  # each chunk's value on one rank of a sharded dim: exact
        if mesh is not None:
            vector = _reduce(vector, mesh, dims, "max" if inf else "sum")
        whole = torch.maximum(whole, vector) if inf else whole + vector
    return whole.max() if inf else whole.sum() ** (1 / norm_type)


def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, *, invariant: bool | int = False) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients on any mix of meshes and plain tensors.

    Returns the total norm (a plain tensor, the same on every rank), the one a single
    device would compute for the whole model. ``invariant``: the same bits at every degree (the
    module docstring; True: 8 chunks, a power of two: that many), as ``parallelize(...,
    invariant=True)``.

    >>> import torch, torch.nn as nn
    >>> layer = nn.Linear(3, 1)
    >>> layer(torch.ones(2, 3)).sum().backward()
    >>> expected = torch.cat([p.grad.flatten() for p in layer.parameters()]).norm()
    >>> torch.allclose(clip_grad_norm_(layer.parameters(), 10.0, invariant=True), expected)  # 4 < 10: kept
    True
    >>> torch.allclose(clip_grad_norm_(layer.parameters(), 1.0), expected)
    True
    """
    chunks = chunks_of(invariant)
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
        raise ValueError(f"clip_grad_norm_: 'norm_type' must be a positive number or inf (got {norm_type!r}); "
                         "the sum of |g| ** p over shards is a p-norm for p > 0 only: use 2.0, 1.0 or inf.")
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    # each gradient on its parameter's own mesh (one an op made may name another mesh over the
    # same ranks: DTensor's caches ignore the process group)
    grads = [keep_mesh(p.grad, p.device_mesh) if isinstance(p.grad, DTensor) and isinstance(p, DTensor)
             else p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    total = (_norm(grads, norm_type) if chunks is None else _canonical_norm(grads, norm_type, chunks)).float()
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is {total.item()}; "
                           "pass error_if_nonfinite=False to clip anyway.")
    scale = min(1.0, max_norm / (total.item() + 1e-6))
    if scale < 1.0:
        for g in grads:
            g.mul_(scale)
    return total
