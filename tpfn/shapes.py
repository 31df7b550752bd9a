"""Global shapes of local tensors: what a local shard alone cannot tell.

Seven positions on two ranks are 4 and 3: from its local 4 alone, rank 0 cannot tell 7
from 8. Every sharded local tensor that leaves a slot is remembered here, by identity and
by local shape and layout. The next annotation of that very tensor recovers its global
shape exactly; one computed from it with the same local shape (a residual sum) recovers
the most recent global shape seen for that local shape; anything else is taken to be an
even split, as DTensor assumes. Compiled code neither reads nor writes the memory (a graph
would be specialized on it): there, sharded local tensors are even splits.
"""

from __future__ import annotations

import collections

import torch
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["SHAPES", "contiguous_strides"]


class _Shapes:
    """Global shapes by tensor, then by (local shape, torch placements, mesh), the last 64."""

    def __init__(self, size: int = 64):
        self.size, self.table, self.tensors = size, collections.OrderedDict(), WeakTensorKeyDictionary()

    def remember(self, local, placements: tuple, global_shape, mesh) -> None:
        if torch.compiler.is_compiling():  # a compiled graph would guard on the memory
            return
        if any(p.is_shard() for p in placements):
            key = (tuple(local.shape), placements, id(mesh))
            self.tensors[local] = (key, tuple(global_shape))
            self.table[key] = tuple(global_shape)
            self.table.move_to_end(key)
            while len(self.table) > self.size:
                self.table.popitem(last=False)

    def recall(self, local, placements: tuple, mesh):
        """The remembered global shape, else the even split DTensor would assume."""
        if not torch.compiler.is_compiling():
            key = (tuple(local.shape), placements, id(mesh))
            mine = self.tensors.get(local)
            if mine is not None and mine[0] == key:
                return mine[1]
            found = self.table.get(key)
            if found is not None:
                return found
        shape = list(local.shape)
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
