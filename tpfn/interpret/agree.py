"""The global shape of a sharded local tensor, from every rank's local shape.

Seven positions on two ranks are 4 and 3: from its local 4 alone rank 0 cannot tell 7 from
8, and ranks that take a tensor for different global shapes hang in their next collective
or compute wrong numbers. So where tpfn does not know a sharded local tensor's global shape
(it did not hand that tensor on itself: a user's own piece of a sequence, a residual sum),
the ranks exchange their local shapes, a few ints in one all-gather, and all of them learn
the global shape, or all raise the same ``LayoutError`` when the shapes are no
``torch.chunk`` split of one tensor. Whether a tensor is one tpfn handed on is the same on
every rank (the same program made it), so every rank issues the exchange at the same points.

>>> import torch, tpfn
>>> from torch.distributed.device_mesh import init_device_mesh
>>> mesh = init_device_mesh("cpu", (1,))
>>> agreed_shape(torch.ones(2, 7), tpfn.layout.to_torch(tpfn.Shard(1)), mesh, "input 0 of 'x'")
(2, 7)
"""

from __future__ import annotations

import torch
from torch.distributed import tensor as _dt

from tpfn._torch import fake_ranks, simulated_shapes
from tpfn.algebra import chunk_bounds
from tpfn.errors import LayoutError
from tpfn.bounded import all_gather, collective
from tpfn.layout import from_torch

__all__ = ["agreed_shape"]


def agreed_shape(local: torch.Tensor, placements: tuple, mesh, what: str, timeout: float | None = None) -> tuple | None:
    """The global shape that the ranks' local shapes of ``local`` (laid out by the torch ``placements``
    on the 1-D ``mesh``) make, or None where no other rank can answer (a dry run's fake ranks:
    ``tpfn.explain`` does not count these exchanges); ranks that ``LocalTensorMode`` simulates answer
    with no collective. Every rank calls it at the same point; ``what`` names the slot; the exchange
    waits ``timeout`` seconds at most (``tpfn.bounded``)."""
    n, shapes = mesh.size(), simulated_shapes(local.shape)
    if shapes is None:  # real ranks: each tells the others
        shape = tuple(local.shape)
        if not all(type(s) is int for s in shape) or fake_ranks(mesh):  # a dry run's ranks cannot answer
            return None
        mine = torch.tensor(shape, dtype=torch.int64, device=mesh.device_type)
        with collective(f"the exchange of the local shapes of {what}", mesh, timeout) as bound:
            everyone = all_gather(mine, 0, n, bound)
        shapes = [tuple(s) for s in everyone.view(n, len(shape)).tolist()]
    (p,) = placements
    layout, dim = from_torch(placements)[0], p.dim
    if len({s[:dim] + s[dim + 1:] for s in shapes}) > 1:
        held = ", ".join(f"rank {r}: {s}" for r, s in enumerate(shapes))
        raise LayoutError(f"{what} is declared {layout!r}, but the ranks' pieces differ beyond dim {dim} "
                          f"({held}); hand every rank its piece of one tensor, cut along dim {dim} only.")
    sizes = [s[dim] for s in shapes]
    total = sum(sizes)
    split = [chunk_bounds(total, n, r)[1] for r in range(n)] if type(p) is _dt.Shard \
        else [total // n] * n  # packed parts: an even split of every part
    if sizes != split:
        held = ", ".join(f"rank {r}: {size}" for r, size in enumerate(sizes))
        raise LayoutError(f"{what} is declared {layout!r}, but the ranks hold {held} of its {total} in dim "
                          f"{dim}, which is not how {layout!r} splits {total} over {n} ranks "
                          f"({', '.join(map(str, split))}); hand rank r the piece x.chunk({n}, dim={dim})[r] "
                          "of the whole tensor x (the larger pieces first).")
    return shapes[0][:dim] + (total,) + shapes[0][dim + 1:]
