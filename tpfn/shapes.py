"""Global shapes of local tensors: what a local shard alone cannot tell.

Seven positions on two ranks are 4 and 3: from its local 4 alone, rank 0 cannot tell 7
from 8. Every sharded local tensor that leaves a slot is remembered here by its local
shape and layout, so the next annotation of that tensor (or of one computed from it with
the same shape, such as a residual sum) recovers the global shape; anything else is taken
to be an even split, as DTensor assumes.
"""

from __future__ import annotations

import collections

__all__ = ["SHAPES", "contiguous_strides"]


class _Shapes:
    """Global shapes by (local shape, torch placements, mesh), the most recent 64."""

    def __init__(self, size: int = 64):
        self.size, self.table = size, collections.OrderedDict()

    def remember(self, local_shape, placements: tuple, global_shape, mesh) -> None:
        if any(p.is_shard() for p in placements):
            key = (tuple(local_shape), placements, id(mesh))
            self.table[key] = tuple(global_shape)
            self.table.move_to_end(key)
            while len(self.table) > self.size:
                self.table.popitem(last=False)

    def recall(self, local_shape, placements: tuple, mesh):
        """The remembered global shape, else the even split DTensor would assume."""
        found = self.table.get((tuple(local_shape), placements, id(mesh)))
        if found is not None:
            return found
        shape = list(local_shape)
        for p in placements:
            if p.is_shard():
                shape[p.dim] *= mesh.size()
        return tuple(shape)


SHAPES = _Shapes()


def contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
