"""A virtual mesh in one process: what every rank holds, and what each algebra step does to it.

An independent model of the semantics the algebra predicts: a distributed tensor is a dict
from mesh coordinate to local tensor. ``scatter`` lays a global tensor out (``torch.chunk``
for shards, random terms for partials), ``execute`` runs algebra steps on every rank at
once, ``gather`` reassembles the global value.
"""

from __future__ import annotations

import itertools

import torch

from tpfn.algebra import AllGather, AllReduce, AllToAll, Chunk, ReduceScatter, Split, transition
from tpfn.layout import Partial, Replicate, Shard, normalize


def _sizes(size: int, parts) -> list:
    """The sizes of the parts packed in a dim of ``size``: ``parts`` equal ones, or the sizes given."""
    return list(parts) if isinstance(parts, tuple) else [size // parts] * parts


def chunks(t: torch.Tensor, dim: int, k: int, parts=1) -> list:
    """``torch.chunk`` padded with empty chunks to exactly ``k`` (DTensor's split); with
    ``parts`` (a count of equal parts, or their sizes), chunk ``c`` of each part, concatenated."""
    if parts != 1:
        pieces = [chunks(piece, dim, k) for piece in t.split(_sizes(t.size(dim), parts), dim)]
        return [torch.cat([p[c] for p in pieces], dim) for c in range(k)]
    split = list(torch.chunk(t, k, dim)) if t.size(dim) else []
    empty = t.narrow(dim, 0, 0)
    return split + [empty] * (k - len(split))


def _gather(group: list, dim: int, parts) -> torch.Tensor:
    if parts == 1:
        return torch.cat(group, dim)
    size = sum(t.size(dim) for t in group)
    held = [[len(c) for c in chunks(torch.arange(part), 0, len(group))] for part in _sizes(size, parts)]
    pieces = [t.split([h[r] for h in held], dim) for r, t in enumerate(group)]
    return torch.cat([pieces[r][p] for p in range(len(held)) for r in range(len(group))], dim)


def _terms(t: torch.Tensor, op: str, k: int, gen: torch.Generator) -> list:
    """``k`` tensors whose reduction by ``op`` is exactly ``t`` (t holds small integers)."""
    noise = [torch.randint(-3, 4, t.shape, generator=gen).to(t.dtype) for _ in range(k)]
    if op == "sum":
        return noise[:-1] + [t - sum(noise[:-1], torch.zeros_like(t))]
    if op == "avg":
        return noise[:-1] + [t * k - sum(noise[:-1], torch.zeros_like(t))]
    sign = -1 if op == "max" else 1
    return [t] + [t + sign * n.abs() for n in noise[1:]]


def scatter(t: torch.Tensor, layout, mesh_shape, seed: int = 0) -> dict:
    """Every coordinate's local tensor for global ``t`` laid out by ``layout``."""
    gen = torch.Generator().manual_seed(seed)
    held = {(): t}
    for p, k in zip(normalize(layout, t.dim()), mesh_shape):
        nxt = {}
        for coord, local in held.items():
            if isinstance(p, Shard):
                parts = chunks(local, p.dim, k, p.parts)
            elif isinstance(p, Partial):
                parts = _terms(local, p.op, k, gen)
            else:
                parts = [local.clone() for _ in range(k)]
            nxt.update({coord + (c,): part for c, part in enumerate(parts)})
        held = nxt
    return held


def _reduce(ts: list, op: str) -> torch.Tensor:
    stacked = torch.stack(ts)
    return {"sum": stacked.sum(0), "avg": stacked.mean(0),
            "max": stacked.amax(0), "min": stacked.amin(0)}[op]


def _run_step(step, group: list) -> list:
    """The local tensors of one mesh-dim group (ordered by coordinate) after ``step``."""
    k = len(group)
    if isinstance(step, AllGather):
        return [_gather(group, step.dim, step.parts)] * k
    if isinstance(step, AllReduce):
        return [_reduce(group, step.op)] * k
    if isinstance(step, ReduceScatter):
        return chunks(_reduce(group, step.op), step.dim, k)
    if isinstance(step, AllToAll):
        return chunks(torch.cat(group, step.src_dim), step.dst_dim, k)
    if isinstance(step, Chunk):
        return [chunks(t, step.dim, k, step.parts)[c] for c, t in enumerate(group)]
    if isinstance(step, Split):  # n equal terms of a sum; every copy for avg, max, min
        return [t / k if step.op == "sum" else t for t in group]
    raise TypeError(f"not a step: {step!r}")


def execute(steps, held: dict, mesh_shape) -> dict:
    """Run ``steps`` on every coordinate at once."""
    held = dict(held)
    for step in steps:
        i = step.mesh_dim
        rest = [range(k) for j, k in enumerate(mesh_shape) if j != i]
        for other in itertools.product(*rest):
            coords = [other[:i] + (c,) + other[i:] for c in range(mesh_shape[i])]
            for coord, out in zip(coords, _run_step(step, [held[c] for c in coords])):
                held[coord] = out
    return held


def gather(held: dict, layout, mesh_shape) -> torch.Tensor:
    """The global value: replicate on every mesh dim, check all ranks agree, return it."""
    ndim = next(iter(held.values())).dim()
    full = execute(transition(layout, (Replicate(),) * len(mesh_shape), ndim=ndim), held, mesh_shape)
    values = list(full.values())
    for v in values[1:]:
        torch.testing.assert_close(v, values[0], msg="ranks disagree after replicating")
    return values[0]
