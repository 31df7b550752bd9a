"""What a parallelized model's tensors are laid out as, and their true global values.

DTensor describes most of tpfn's layouts itself, but has no placement for unequal packed
parts (``Shard(d, parts=(q, k, v))``: a DTensor ``Shard(d)`` of the ranks' chunks of every
part, rank after rank), and describes replicated heads (``Shard(d, heads=h)``) on a 2-D
view of the mesh. The ``Mount`` of each module knows the tpfn layout of what it placed:

- ``layouts(model)``: the tpfn layout of every parameter and buffer a plan placed, by each of its names;
- ``full_value(t, layout)``: the global value of a DTensor laid out ``layout`` (gathered, the
  parts put back in place), what ``full_tensor()`` is for the layouts DTensor describes;
- ``assemble(locals, layout, shape)``: the global values the ranks' local tensors make, one
  per copy (replicated heads: one per replica), no communication;
- ``local_value(full, layout, mesh)`` (``tpfn.interpret.prepare``): what a rank holds of a global value.

>>> import torch
>>> from tpfn.layout import Shard
>>> order((8,), Shard(0, parts=(4, 2, 2)), 2, dim=0).tolist()   # rank 0: q[0:2] k[0] v[0]
[0, 1, 4, 6, 2, 3, 5, 7]
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from tpfn._fqn import join
from tpfn._torch import buffers_of, parameters_of
from tpfn.algebra import shard_ranges
from tpfn.interpret.parallelize import mounted
from tpfn.layout import Shard, exact_in_torch

__all__ = ["layouts", "full_value", "assemble", "order"]


def layouts(model: nn.Module) -> dict:
    """``{name: tpfn layout}`` of every parameter and buffer a mount placed, under each of
    its names (a tied tensor under all of them)."""
    placed: dict = {}
    for fqn, module in model.named_modules():
        mount = mounted(module)
        for name, placement in (mount.params if mount is not None else ()):
            owner, _, leaf = join(fqn, name).rpartition(".")
            sub = model.get_submodule(owner)
            placed[id(parameters_of(sub).get(leaf, buffers_of(sub).get(leaf)))] = placement
    return {join(prefix, name): placed[id(t)]
            for prefix, module in model.named_modules(remove_duplicate=False)
            for table in (parameters_of(module), buffers_of(module))
            for name, t in table.items() if t is not None and id(t) in placed}


def order(shape: tuple, layout: Shard, n: int, *, dim: int) -> torch.Tensor:
    """The index along ``dim`` of each element of the ranks' local tensors, rank after rank:
    where each of them lies in the global tensor."""
    return torch.cat([torch.arange(start, start + size)
                      for rank in range(n) for start, size in shard_ranges(shape[dim], layout, n, rank)])


def full_value(t: torch.Tensor, layout) -> torch.Tensor:
    """The global value of ``t``: a DTensor (or its gradient) laid out ``layout`` (a tpfn
    placement; None: as its own placements say). A plain tensor is its own value."""
    if not isinstance(t, DTensor):
        return t
    gathered = t.full_tensor()
    if layout is None or exact_in_torch(layout) or layout.heads is not None:
        return gathered  # replicated heads: a DTensor on a view of the mesh, exact
    dim = layout.dim % t.ndim
    out = torch.empty_like(gathered)
    return out.index_copy_(dim, order(tuple(t.shape), layout, t.device_mesh.size(), dim=dim), gathered)


def assemble(pieces: list, layout: Shard, shape: tuple) -> list:
    """The global tensors of ``shape`` that the ranks' local ``pieces`` (in rank order) laid
    out ``layout`` make: one, or one per replica where heads are replicated over groups of
    ranks (each replica's ranks hold every head once).

    >>> from tpfn.layout import Shard
    >>> [t.tolist() for t in assemble([torch.tensor([0, 2, 3]), torch.tensor([1, 4, 5])],
    ...                               Shard(0, parts=(2, 4)), (6,))]
    [[0, 1, 2, 3, 4, 5]]
    """
    n, dim = len(pieces), layout.dim % len(shape)
    copies = layout.copies(n)
    out = []
    for copy in range(copies):
        whole = pieces[0].new_zeros(shape)
        for rank in range(copy, n, copies):
            ranges = shard_ranges(shape[dim], layout, n, rank)
            for (start, size), piece in zip(ranges, pieces[rank].split([s for _, s in ranges], dim)):
                whole.narrow(dim, start, size).copy_(piece)
        out.append(whole)
    return out
