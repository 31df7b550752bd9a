"""The common moves of a 1-D mesh as one plain ``torch.distributed`` collective each.

DTensor's ``redistribute_local_tensor`` plans every move anew and runs it through functional
collectives; for the four moves a tensor-parallel step makes (sum partial sums, gather or
reduce-scatter an even shard, take one's chunk of a replica) that costs about as much time
as gloo's own work. ``step(src, dst, mesh, shape)`` is such a move as a plain function of the
local tensor, the same numbers (each rank's result is what DTensor computes), or None where
DTensor's general path is needed: uneven or packed shards, reductions other than a sum,
shard to shard. Results are new tensors: the input (a user's tensor, or a gradient autograd
may hand to another branch too) is never written.

>>> import torch
>>> from torch.distributed.tensor import Partial, Replicate, Shard
>>> from torch.distributed.device_mesh import init_device_mesh
>>> mesh = init_device_mesh("cpu", (1,))
>>> step(Partial(), Replicate(), mesh, (2, 3))(torch.ones(2, 3))   # one rank: a sum of one term
tensor([[1., 1., 1.],
        [1., 1., 1.]])
>>> step(Shard(0), Shard(1), mesh, (2, 3)) is None                  # shard to shard: DTensor's path
True
"""

from __future__ import annotations

import functools

import torch
from torch.distributed import tensor as _dt

from tpfn._torch import all_gather_into, reduce_scatter_into

__all__ = ["step"]


def _done(out: torch.Tensor, work, wait: bool, then=None):
    """``out`` once ``work`` is done (``then(out)`` where given); ``wait=False``: a function
    that waits and returns it, the collective left running meanwhile."""
    def finish():
        work.wait()
        return out if then is None else then(out)
    return finish() if wait else finish


def _all_reduce(x: torch.Tensor, group, wait: bool = True):
    """The ranks' ``x`` summed."""
    out = x.clone(memory_format=torch.contiguous_format)
    return _done(out, group.allreduce(out), wait)


def _all_gather(x: torch.Tensor, dim: int, n: int, group, wait: bool = True):
    """The ranks' ``x`` concatenated along ``dim``."""
    x = x.contiguous()
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))  # rank-major, as the collective fills it
    then = None
    if dim != 0:
        shape = list(x.shape)
        shape[dim] *= n
        then = lambda out: out.view(n, *x.shape).movedim(0, dim).reshape(shape)  # noqa: E731
    return _done(out, all_gather_into(out, x, group), wait, then)


def _reduce_scatter(x: torch.Tensor, dim: int, n: int, group, wait: bool = True):
    """This rank's chunk along ``dim`` of the sum of the ranks' ``x``."""
    shape = list(x.shape)
    shape[dim] //= n
    if dim != 0:  # the chunks rank-major, as the collective reads them
        x = x.unflatten(dim, (n, shape[dim])).movedim(dim, 0)
    x = x.contiguous()
    out = x.new_empty(shape)
    return _done(out, reduce_scatter_into(out, x.reshape(n * shape[0], *shape[1:]), group), wait)


def _chunk(x: torch.Tensor, dim: int, n: int, rank: int, wait: bool = True):
    out = x.chunk(n, dim)[rank].clone(memory_format=torch.contiguous_format)
    return out if wait else lambda: out


def step(src, dst, mesh, shape: tuple):
    """Local tensor -> local tensor moving torch placement ``src`` to ``dst`` on the 1-D
    ``mesh`` for a tensor of global ``shape``, or None where no plain collective does it.
    Called with ``wait=False``, the function starts the collective and returns a function
    that waits for it and returns the result."""
    n, group = mesh.size(), mesh.get_group()

    def even(p) -> bool:  # a plain shard (not packed) that the mesh divides
        return type(p) is _dt.Shard and shape[p.dim] % n == 0

    if isinstance(src, _dt.Partial) and src.reduce_op == "sum":
        if isinstance(dst, _dt.Replicate):
            return functools.partial(_all_reduce, group=group)
        if even(dst):
            return functools.partial(_reduce_scatter, dim=dst.dim, n=n, group=group)
    if even(src) and isinstance(dst, _dt.Replicate):
        return functools.partial(_all_gather, dim=src.dim, n=n, group=group)
    if isinstance(src, _dt.Replicate) and even(dst):
        return functools.partial(_chunk, dim=dst.dim, n=n, rank=mesh.get_coordinate()[0])
    return None
