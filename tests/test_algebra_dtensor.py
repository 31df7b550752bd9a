"""Prediction equals reality: the algebra's steps are the collectives DTensor's redistribute issues.

Every pair of 1-D placements (packed shards included) on 2 gloo ranks, and every pair of 2-D layouts over
{Shard(0), Shard(1), Replicate(), Partial()} on a 2x2 mesh of 4 ranks, even and uneven
shapes: the collectives counted under ``CommDebugMode`` are exactly those the algebra
predicts, each rank's local tensor is what the virtual mesh predicts, and the backward
runs exactly ``pullback``'s collectives. A replica split into terms (``Replicate() ->
Partial()``), which DTensor's public ``redistribute`` keeps internal, is checked against its
local move (``redistribute_local_tensor``): no collective, the virtual mesh's terms.
"""

import itertools
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from tests import virtual
from tests.ranks import mesh
from tpfn import trace
from tpfn._torch import DTensorSpec, redistribute_local_tensor, spec_of
from tpfn.algebra import Split, pullback, transition
from tpfn.layout import Partial, Replicate, Shard, normalize, to_torch

PLACEMENTS_1D = [Shard(0), Shard(1), Shard(-1), Replicate(),
                 Partial("sum"), Partial("avg"), Partial("max"), Partial("min")]
PACKED = [Shard(0, parts=2), Shard(1, parts=2)]
PLACEMENTS_2D = [Shard(0), Shard(1), Replicate(), Partial()]
SHAPES = [(8, 6), (7, 5)]
PACKED_SHAPES = [(8, 12)]  # DTensor packs equal parts that the mesh divides

# gloo has no all-to-all: DTensor runs Shard(i) -> Shard(j) as an all-gather and a local chunk.
GLOO = {"all_to_all": "all_gather"}


def expected(steps) -> dict:
    kinds = (GLOO.get(s.collective, s.collective) for s in steps if s.collective)
    return dict(Counter(kinds))


def legal(src, dst) -> bool:
    try:
        transition(src, dst)
        return True
    except ValueError:
        return False


def _check_pairs(mesh_shape, layouts, shapes, with_backward):
    """On every rank: redistribute every legal pair; return the mismatches found."""
    device_mesh = mesh(*mesh_shape)
    coord = tuple(device_mesh.get_coordinate())
    problems = []
    for shape, src, dst in itertools.product(shapes, layouts, layouts):
        if not legal(src, dst):
            try:
                DTensor.from_local(torch.zeros(shape), device_mesh, to_torch(src)).redistribute(
                    device_mesh, to_torch(dst))
                # torch >= 2.14 lets Shard -> Partial through (zeros where a rank holds
                # nothing); tpfn keeps the rule that redistribution never makes partial sums.
                newer = any(isinstance(s, Shard) and isinstance(d, Partial) for s, d in zip(src, dst))
                if not newer:
                    problems.append(f"DTensor accepted {src} -> {dst}, which the algebra rejects")
            except (RuntimeError, AssertionError, ValueError):
                pass
            continue
        t = torch.randint(-9, 10, shape, generator=torch.Generator().manual_seed(7)).double()
        held = virtual.scatter(t, src, mesh_shape, seed=3)
        steps = transition(src, dst, ndim=t.dim())
        want = virtual.execute(steps, held, mesh_shape)[coord]
        local = held[coord].clone().requires_grad_(with_backward)
        d = DTensor.from_local(local, device_mesh, to_torch(src), run_check=False,
                               shape=t.shape, stride=t.stride())
        if any(isinstance(s, Split) for s in steps):
            # DTensor's redistribute keeps Replicate -> Partial internal: its local move.
            with CommDebugMode() as fwd:
                out = redistribute_local_tensor(local.detach(), spec_of(d), DTensorSpec(
                    device_mesh, to_torch(normalize(dst, t.dim())), tensor_meta=spec_of(d).tensor_meta))
            if trace.counts(fwd) != expected(steps):
                problems.append(f"{shape} {src} -> {dst}: DTensor issued {trace.counts(fwd)}")
            if not torch.allclose(out, want):
                problems.append(f"{shape} {src} -> {dst}: local value differs from the virtual mesh")
            continue
        with CommDebugMode() as fwd:
            out = d.redistribute(device_mesh, to_torch(dst))
        got = trace.counts(fwd)
        if got != expected(steps):
            problems.append(f"{shape} {src} -> {dst}: DTensor issued {got}, algebra {steps}")
        if not torch.allclose(out.to_local(), want):
            problems.append(f"{shape} {src} -> {dst}: local value differs from the virtual mesh")
        if not with_backward:
            continue
        grads = [dst] + ([(Partial(),) * len(dst)] if all(p == Replicate() for p in dst) else [])
        for grad in grads:
            out = d.redistribute(device_mesh, to_torch(dst))
            backward = out.to_local(grad_placements=to_torch(normalize(grad, t.dim()))).sum().backward
            predicted = pullback(src, dst, grad, ndim=t.dim())
            if any(isinstance(s, Partial) and isinstance(g, Partial) and s != g
                   for s, g in zip(src, grad)):
                # DTensor keeps a Partial gradient Partial on its way back and cannot turn
                # terms of one reduction into terms of another; it must refuse.
                try:
                    backward()
                    problems.append(f"DTensor pulled {grad} back through {src} -> {dst}")
                except AssertionError:
                    pass
                continue
            with CommDebugMode() as bwd:
                backward()
            if trace.counts(bwd) != expected(predicted):
                problems.append(f"{shape} backward of {src} -> {dst} with grad {grad}: DTensor "
                                f"issued {trace.counts(bwd)}, pullback {predicted}")
    return problems


def _all_1d_pairs():
    mesh_shape = (dist.get_world_size(),)
    plain = [(p,) for p in PLACEMENTS_1D]
    packed = plain + [(p,) for p in PACKED]
    return (_check_pairs(mesh_shape, plain, SHAPES, with_backward=True)
            + _check_pairs(mesh_shape, packed, PACKED_SHAPES, with_backward=True))


def _all_2d_pairs():
    layouts = list(itertools.product(PLACEMENTS_2D, repeat=2))
    return _check_pairs((2, 2), layouts, SHAPES, with_backward=True)


def test_every_1d_pair_matches_dtensor_on_2_ranks(ranks2):
    problems = ranks2.run(_all_1d_pairs)
    assert problems == [[], []]


def test_every_2d_pair_matches_dtensor_on_a_2x2_mesh(ranks4):
    problems = ranks4.run(_all_2d_pairs)
    assert problems == [[]] * 4
