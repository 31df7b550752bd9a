"""What a parallelized model remembers: global shapes of local tensors, partial gradients.

``parallelize`` makes one ``State`` per call; every module it mounts shares it, and nothing
of it is shared with another model, mesh or process group.

Global shapes: seven positions on two ranks are 4 and 3, and from its local 4 alone rank 0
cannot tell 7 from 8. Every sharded local tensor that leaves a slot is remembered, by
identity and by local shape and layout. The next annotation of that very tensor recovers
its global shape exactly (``TENSOR_SHAPES``: a fact about that tensor, whichever model
handed it on); one computed from it with the same local shape (a residual sum) recovers the
most recent global shape this model saw for that local shape; anything else is taken to be
an even split, as DTensor assumes. Compiled code neither reads nor writes the memory (a
graph would be specialized on it): there, sharded local tensors are even splits.

Partial gradients: a replicated parameter used on sharded activations (a sequence-parallel
norm, a per-head norm) gets a partial gradient. Left so, every optimizer op on it would
all-reduce it again (Adam: three times per parameter per step). Such parameters are
``watch``-ed: at the end of each backward all of their gradients on a mesh are summed in
one all-reduce of one flat buffer, and the optimizer sees replicated gradients.
"""

from __future__ import annotations

import collections

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Replicate

from tpfn._torch import WeakTensorKeyDictionary, queue_callback
from tpfn.interpret.moves import collective

__all__ = ["State", "Shapes", "PartialGrads", "TENSOR_SHAPES", "recall"]

TENSOR_SHAPES = WeakTensorKeyDictionary()
"""local tensor -> (key, global shape), for the local tensors that slots handed on."""


def _key(local, placements: tuple, mesh) -> tuple:
    return tuple(local.shape), placements, mesh.size()


def _even(local, placements: tuple, mesh) -> tuple:
    shape = list(local.shape)
    for p in placements:
        if p.is_shard():
            shape[p.dim] *= mesh.size()
    return tuple(shape)


def recall(local, placements: tuple, mesh, table=None) -> tuple:
    """The global shape of ``local`` if a slot handed it on, else the one ``table`` (a model's
    ``Shapes.table``) last saw for its local shape, else the even split."""
    if not any(p.is_shard() for p in placements):  # whole on every rank
        return tuple(local.shape)
    if not torch.compiler.is_compiling():
        key = _key(local, placements, mesh)
        mine = TENSOR_SHAPES.get(local)
        if mine is not None and mine[0] == key:
            return mine[1]
        if table is not None and key in table:
            return table[key]
    return _even(local, placements, mesh)


class Shapes:
    """Global shapes by tensor, then by (local shape, torch placements, mesh size), the last 64."""

    def __init__(self, size: int = 64):
        self.size, self.table = size, collections.OrderedDict()

    def remember(self, local, placements: tuple, global_shape, mesh) -> None:
        if torch.compiler.is_compiling():  # a compiled graph would guard on the memory
            return
        if any(p.is_shard() for p in placements):
            key = _key(local, placements, mesh)
            TENSOR_SHAPES[local] = (key, tuple(global_shape))
            self.table[key] = tuple(global_shape)
            self.table.move_to_end(key)
            while len(self.table) > self.size:
                self.table.popitem(last=False)

    def recall(self, local, placements: tuple, mesh) -> tuple:
        """The remembered global shape, else the even split DTensor would assume."""
        return recall(local, placements, mesh, self.table)


class PartialGrads:
    """Collects the partial gradients of one backward and reduces them when it ends."""

    def __init__(self):
        self.pending: list = []
        self.reduced: dict = {}  # id(param) -> the placements its gradient was reduced from
        self.names: dict = {}  # id(param) -> its name in the model

    def watch(self, param, name: str) -> None:
        """Reduce ``param``'s (called ``name``) partial gradients in bulk at the end of each
        backward."""
        self.names[id(param)] = name
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
                queue_callback(self.flush)
            self.pending.append(param)

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        groups: dict = {}
        for param in pending:  # one bucket per process group(s), whichever mesh object holds them
            groups.setdefault((tuple(map(id, param.grad.device_mesh.get_all_groups())),
                               param.grad.placements, param.grad.dtype), []).append(param)
        for (_, placements, _), params in groups.items():
            grads = [p.grad for p in params]
            mesh = grads[0].device_mesh
            flat = torch.cat([g.to_local().reshape(-1) for g in grads])
            names = ", ".join(self.names.get(id(p), "?") for p in params)
            for dim, placement in enumerate(placements):
                if placement.is_partial() and mesh.size(dim) > 1:
                    with collective(f"the all-reduce of the partial gradients of {names} at the "
                                    "end of the backward", mesh):
                        flat = funcol.wait_tensor(funcol.all_reduce(flat, "sum", (mesh, dim)))
            replicated = [Replicate() if p.is_partial() else p for p in placements]
            for param, grad, piece in zip(params, grads, flat.split([g.to_local().numel() for g in grads])):
                param.grad = DTensor.from_local(piece.view_as(grad.to_local()), mesh, replicated,
                                                run_check=False, shape=grad.shape, stride=grad.stride())
                self.reduced[id(param)] = placements


class State:
    """What one ``parallelize`` call's modules share: shape memory and partial gradients."""

    def __init__(self):
        self.shapes = Shapes()
        self.partial_grads = PartialGrads()
