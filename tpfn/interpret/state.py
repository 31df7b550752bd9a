"""What a parallelized model remembers: global shapes of local tensors, partial gradients.

``parallelize`` makes one ``State`` per call; every module it mounts shares it, and nothing
of it is shared with another model, mesh or process group.

Global shapes: seven positions on two ranks are 4 and 3, and from its local 4 alone rank 0
cannot tell 7 from 8. Every sharded local tensor that leaves a slot is remembered, by
identity and by local shape and layout. The next annotation of that very tensor recovers
its global shape exactly (``TENSOR_SHAPES``: a fact about that tensor, whichever model
handed it on). For any other sharded local tensor (a user's piece of a sequence, a
residual sum) rank 0's 4 could be 7 or 8: its global shape is a ``Guess`` (the most recent
one this model saw for that local shape, else an even split, as DTensor assumes), handed on
as a guess where nothing depends on it (a row-wise layer's input, whose sharded features its
output drops; a sequence-parallel norm's, whose output keeps the guess), and made exact
where something does (a move, a DTensor, one device's dropout noise): from the tensor a slot
handed on that it was computed from, a few autograd nodes back (``derived_shape``: a
residual sum), else by an exchange of the ranks' local shapes (``tpfn.interpret.agree``,
one all-gather of a few ints). Every rank decides alike, since whether a tensor is one a
slot handed on, how sure its shape is and the autograd graph are the same on every rank.
Compiled code neither reads nor writes the memory nor exchanges shapes (a graph would be
specialized on them): there, sharded local tensors are even splits.

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

from tpfn._torch import (DTensorSpec, WeakTensorKeyDictionary, local_tensor, per_rank, queue_callback,
                         rank_sizes, spec_of)
from tpfn.errors import LayoutError
from tpfn.interpret.agree import agreed_shape
from tpfn.interpret.moves import collective, unhooked

__all__ = ["State", "Shapes", "PartialGrads", "TENSOR_SHAPES", "Guess", "recall", "derived_shape"]

TENSOR_SHAPES = WeakTensorKeyDictionary()
"""local tensor -> (key, global shape), for the local tensors that slots handed on."""


def _key(local, placements: tuple, n: int) -> tuple:
    return rank_sizes(local.shape), placements, n


def _sharded(placements: tuple) -> bool:
    for p in placements:
        if p.is_shard():
            return True
    return False


def _even(local, placements: tuple, n: int) -> tuple:
    shape = list(local.shape)
    for p in placements:
        if p.is_shard():
            shape[p.dim] *= n
    return tuple(shape)


class Guess(tuple):
    """A global shape taken from this rank's local shape alone (other ranks may guess another)."""


def recall(local, placements: tuple, mesh, table=None, what: str | None = None,
           exact: bool = False) -> tuple:
    """The global shape of ``local`` if a slot handed it on; else (a ``Guess``) the one
    ``table`` (a model's ``Shapes.table``) last saw for its local shape, else the even split.
    ``exact``, with ``what`` naming the slot: never a guess, on a mesh of several real ranks
    the one their local shapes make, remembered for ``local`` (every rank asks alike)."""
    n = mesh.size() if _sharded(placements) else 1
    if n == 1:  # whole on every rank
        return tuple(local.shape)
    if torch.compiler.is_compiling():
        return _even(local, placements, n)
    key = _key(local, placements, n)
    mine = TENSOR_SHAPES.get(local)
    if mine is not None and mine[0] == key and not (exact and isinstance(mine[1], Guess)):
        return mine[1]
    if exact and what is not None:
        found = derived_shape(local)
        if found is not None and found[0] == key:  # as an elementwise op keeps local shapes
            return found[1]
        if found is not None:  # a graph that every rank has: no rank exchanges
            raise LayoutError(
                f"{what}: the global shape of this sharded local tensor is unknown: it is "
                f"computed from one of local shape {found[0][0]} (global {found[1]}) but has "
                f"local shape {key[0]}; hand it on as a DTensor (DTensor.from_local(x, mesh, "
                "placements, shape=...)), or lay it out with prepare_out(...) where it is made.")
        shape = agreed_shape(local, placements, mesh, what)
        if shape is not None:
            TENSOR_SHAPES[local] = (key, shape)
            return shape
    return Guess(table[key] if table is not None and key in table else _even(local, placements, n))


_DEPTH = 6  # autograd nodes walked back from a tensor to one a slot handed on, hooks aside
_NODE_KEY = "tpfn global shapes"  # in an autograd node's metadata: output number -> (key, shape)


def derived_shape(local) -> tuple | None:
    """``(key, global shape)`` of the sharded local tensor a slot handed on that ``local`` was
    computed from (a residual sum, a norm's output): the nearest among its autograd inputs,
    ``_DEPTH`` nodes back, breadth first, else None (no graph, or none near). Which one is
    found depends on the graph alone, the same on every rank."""
    level, seen = [unhooked(local.grad_fn, local.output_nr)], set()
    for _ in range(_DEPTH):
        level = [(n, i) for n, i in level if n is not None and id(n) not in seen
                 and not seen.add(id(n))]
        for node, nr in level:
            found = node.metadata.get(_NODE_KEY, {}).get(nr) if node.metadata else None
            if found is not None:
                return found
        level = [unhooked(n, i) for node, _ in level for n, i in node.next_functions]
    return None


class Shapes:
    """Global shapes by tensor, then by (local shape, torch placements, mesh size), the last 64."""

    def __init__(self, size: int = 64):
        self.size, self.table = size, collections.OrderedDict()

    def remember(self, local, placements: tuple, global_shape, mesh) -> None:
        if not _sharded(placements) or torch.compiler.is_compiling():
            return  # whole on every rank; or compiled (a graph would guard on the memory)
        n = mesh.size()
        if n > 1:  # one rank: all whole
            key = _key(local, placements, n)
            shape = global_shape if type(global_shape) is tuple else (
                Guess(global_shape) if isinstance(global_shape, Guess) else tuple(global_shape))
            TENSOR_SHAPES[local] = (key, shape)
            if local.grad_fn is not None and not isinstance(shape, Guess):
                local.grad_fn.metadata.setdefault(_NODE_KEY, {})[local.output_nr] = (key, shape)
            self.table[key] = tuple(shape)
            self.table.move_to_end(key)
            while len(self.table) > self.size:
                self.table.popitem(last=False)

    def recall(self, local, placements: tuple, mesh, what: str, exact: bool = False) -> tuple:
        """The global shape of ``local`` arriving at the slot ``what``: ``recall`` with this table."""
        return recall(local, placements, mesh, self.table, what, exact)


@per_rank  # LocalTensorMode: each simulated rank its own coordinates
def _on_first(local, *coordinate):
    """``local`` on the rank whose ``coordinate`` is all zeros, zeros on every other rank."""
    return local if all(c == 0 for c in coordinate) else torch.zeros_like(local)


class PartialGrads:
    """Collects the partial gradients of one backward and reduces them when it ends."""

    def __init__(self):
        self.pending: list = []
        self.reduced: dict = {}  # id(param) -> the placements its gradient was reduced from
        self.names: dict = {}  # id(param) -> its name in the model

    def watch(self, param, name: str) -> None:
        """Reduce ``param``'s (called ``name``) partial gradients in bulk at the end of each backward."""
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
            local = _on_first(old.to_local(), *(coordinate[i] for i, p in enumerate(placements)
                                                 if p.is_partial()))
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
            flat = torch.cat([local_tensor(g).reshape(-1) for g in grads])
            names = ", ".join(self.names.get(id(p), "?") for p in params)
            for dim, placement in enumerate(placements):
                if placement.is_partial() and mesh.size(dim) > 1:
                    with collective(f"the all-reduce of the partial gradients of {names} at the "
                                    "end of the backward", mesh):
                        if type(flat) is torch.Tensor and flat.device.type != "meta":  # in place
                            mesh.get_group(dim).allreduce(flat).wait()
                        else:  # a simulated rank's (LocalTensorMode) or a dry run's
                            flat = funcol.wait_tensor(funcol.all_reduce(flat, "sum", (mesh, dim)))
            replicated = tuple(Replicate() if p.is_partial() else p for p in placements)
            pieces = flat.split([local_tensor(g).numel() for g in grads])
            for param, grad, piece in zip(params, grads, pieces):
                spec = DTensorSpec(mesh, replicated, tensor_meta=spec_of(grad).tensor_meta)
                param.grad = DTensor(piece.view(local_tensor(grad).shape), spec, requires_grad=False)
                self.reduced[id(param)] = placements


class State:
    """What one ``parallelize`` call's modules share: shape memory and partial gradients."""

    def __init__(self):
        self.shapes, self.partial_grads = Shapes(), PartialGrads()
