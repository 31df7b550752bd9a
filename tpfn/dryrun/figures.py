"""Figures a report holds only in parts: how much of the model a plan shards, what each rank
holds, which collectives each slot and each module ran, and the end of the backward.

>>> mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
>>> report = tpfn.explain(mlp, {"0": colwise(), "2": rowwise()}, world_size=4,
...                       example_inputs=torch.ones(8, 16, requires_grad=True))
>>> s = sharded(report)
>>> s.tensors, s.of_tensors, s.bytes, s.of_bytes, [name for name, _ in s.whole]
(3, 4, 8448, 8512, ['2.bias'])
>>> held(report)   # (first rank, last rank, parameter bytes, activation bytes) on each
[(0, 3, 2176, 2048)]
"""

from __future__ import annotations

import attrs
import sympy

from tpfn._fqn import join
from tpfn.algebra import local_shape
from tpfn.dryrun.units import runs
from tpfn.layout import Shard

__all__ = ["Sharded", "sharded", "held", "local", "activations", "flows", "own", "ending",
           "shares", "nbytes"]


def nbytes(shape, itemsize):
    """Bytes of a tensor of ``shape`` (sizes may be sympy expressions)."""
    return sympy.Mul(*map(sympy.sympify, shape)) * itemsize


@attrs.frozen
class Sharded:
    """How much of the model a plan shards: parameter tensors and their (global) bytes, of
    all of them; ``whole``: ``(FQN, Param)`` of each one every rank holds whole."""

    tensors: int
    of_tensors: int
    bytes: object
    of_bytes: object
    whole: tuple = ()

    @property
    def fraction(self):
        """The share of the bytes sharded (None for a model without parameters)."""
        return None if self.of_bytes == 0 else sympy.sympify(self.bytes) / self.of_bytes


def _params(report):
    """``(FQN, Param)`` of every parameter, a tied one once."""
    return [(join(r.fqn, p.name), p) for r in report.rows for p in r.params if p.tied is None]


def sharded(report) -> Sharded:
    """The share of ``report``'s parameters its plan shards, by tensor and by bytes."""
    params = _params(report)
    cut = [(n, p) for n, p in params if isinstance(p.placement, Shard)]
    size = lambda ps: sum((nbytes(p.shape, p.itemsize) for _, p in ps), sympy.Integer(0))  # noqa: E731
    return Sharded(len(cut), len(params), size(cut), size(params),
                   tuple((n, p) for n, p in params if not isinstance(p.placement, Shard)))


def local(shape, layout, n, rank) -> tuple:
    """The shape ``rank`` of ``n`` holds of a tensor of ``shape`` laid out ``layout`` (None:
    whole); where a size or ``n`` is a symbol, the nominal even split."""
    if not isinstance(layout, Shard):
        return tuple(shape)
    dim = layout.dim % len(shape)
    if any(sympy.sympify(x).free_symbols for x in (*shape, n)):
        out = list(shape)
        out[dim] = sympy.sympify(shape[dim]) / n
        return tuple(out)
    return local_shape(shape, layout, (n,), (rank,))


def flows(report) -> dict:
    """``{(FQN, slot): Flow}``."""
    return {(f.fqn, f.slot): f for f in report.flows}


def activations(report) -> list:
    """``(Flow, layout)`` of each distinct tensor a slot handed on (the first slot that
    handed on its memory), where its shape is known."""
    seen, out = set(), []
    layouts = {(r.fqn, t.slot): t.desired for r in report.rows for t in r.transitions}
    for f in report.flows:
        if f.shape is not None and f.storage not in seen:
            seen.add(f.storage)
            out.append((f, layouts.get((f.fqn, f.slot))))
    return out


def held(report) -> list:
    """``(first rank, last rank, parameter bytes, activation bytes)`` for each run of ranks
    holding the same: parameters as ``Param.local`` says, activations as the distinct
    tensors the slots handed on (``activations``), each at its layout on that rank."""
    n, params, acts = report.world_size, _params(report), activations(report)
    symbolic = isinstance(n, sympy.Basic)  # rank 0 stands for every rank
    found = []
    for r in [0] if symbolic else range(n):
        p = sum((nbytes(next(s for s, a, b in q.local if a <= r <= b), q.itemsize) for _, q in params),
                sympy.Integer(0))
        a = sum((nbytes(local(f.shape, layout, n, r), f.itemsize) for f, layout in acts), sympy.Integer(0))
        found.append((p, a))
    return [(first, n - 1 if symbolic else last, p, a) for (p, a), first, last in runs(found)]


def own(report, fqn: str) -> list:
    """Positions in ``report.comms`` of the collectives module ``fqn`` ran outside its slots
    (in its own computation, on DTensors)."""
    slotted = {j for f in report.flows for j in (*f.forward, *f.backward)}
    return [j for j, c in enumerate(report.comms) if c.fqn == fqn and j not in slotted]


def ending(report) -> list:
    """Positions in ``report.comms`` of the collectives at the end of the backward, in no
    module: the partial gradients of ``report.partial_grads`` summed in bulk."""
    return [j for j, c in enumerate(report.comms) if c.fqn is None and c.phase == "backward"]


def shares(report) -> dict:
    """``{parameter FQN: (position of its all-reduce, bytes of its share)}`` for the
    parameters whose partial gradients the end of the backward sums, where one all-reduce
    sums exactly their elements (else empty: several buckets, told apart by no name)."""
    ends = [j for j in ending(report) if report.comms[j].kind == "all_reduce"]
    params = dict(_params(report))
    found = [(name, params[name]) for name in report.partial_grads if name in params]
    if len(ends) != 1 or not found:
        return {}
    comm = report.comms[ends[0]]
    sizes = {name: sympy.Mul(*map(sympy.sympify, p.local[0][0])) for name, p in found}
    if sympy.simplify(sum(sizes.values()) - comm.numel) != 0:
        return {}
    return {name: (ends[0], sympy.simplify(comm.bytes * size / comm.numel))
            for name, size in sizes.items()}
