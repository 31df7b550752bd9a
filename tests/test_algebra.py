"""The laws of the layout algebra, property-tested on a virtual mesh (tests/virtual.py)."""

import itertools
import math

import pytest
import sympy
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from tests import virtual
from tests.strategies import heads, layouts, setups
from tpfn.algebra import (
    AllGather, AllReduce, AllToAll, Chunk, ReduceScatter, Split, Step,
    comm_bytes, cotangent, local_shape, pullback, shard_ranges, transition,
)
from tpfn.layout import Partial, Replicate, Shard, normalize


def legal(src, dst) -> bool:
    try:
        transition(src, dst)
        return True
    except ValueError:
        return False


@st.composite
def problems(draw, n_layouts=2):
    """A global tensor of small integers, a mesh, and layouts that fit both."""
    shape, mesh_shape = draw(setups())
    ndim = max(len(shape), 1)
    outs = [draw(layouts(len(mesh_shape), ndim, unequal=True)) for _ in range(n_layouts)]
    shape = even_where_packed(shape, outs)
    assume(shape is not None)
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    t = torch.randint(-9, 10, shape, generator=gen).to(torch.float64)
    return t, mesh_shape, outs, seed


def even_where_packed(shape, layouts_) -> tuple | None:
    """The shape with every dim a packed shard splits into parts made to hold them: the sum
    of unequal parts, a multiple of a number of equal parts (None: no size holds both)."""
    shape, fixed = list(shape), {}
    packed = [p for layout in layouts_ for p in normalize(layout, len(shape))
              if isinstance(p, Shard) and p.parts != 1]
    for p in sorted(packed, key=lambda p: not isinstance(p.parts, tuple)):
        if isinstance(p.parts, tuple):
            if fixed.setdefault(p.dim, sum(p.parts)) != sum(p.parts):
                return None
            shape[p.dim] = sum(p.parts)
        elif p.dim in fixed:
            if shape[p.dim] % p.parts:
                return None
        else:
            shape[p.dim] -= shape[p.dim] % p.parts
    return tuple(shape)


def coords(mesh_shape):
    return itertools.product(*map(range, mesh_shape))


# Law 3: identity.
@given(st.integers(1, 3).flatmap(lambda n: layouts(n, unequal=True)))
def test_transition_to_itself_is_the_empty_program(layout):
    assert transition(layout, layout) == ()


# Law 2: redistribution preserves value (a Partial source counts as its reduction).
@given(problems())
def test_transition_preserves_the_value(problem):
    t, mesh_shape, (a, b), seed = problem
    assume(legal(a, b))
    held = virtual.scatter(t, a, mesh_shape, seed)
    out = virtual.execute(transition(a, b, ndim=t.dim()), held, mesh_shape)
    torch.testing.assert_close(virtual.gather(out, b, mesh_shape), t)
    for coord in coords(mesh_shape):
        assert tuple(out[coord].shape) == local_shape(t.shape, b, mesh_shape, coord)


# Law 2, composed: a -> b -> c holds the same local values as a -> c.
@given(problems(n_layouts=3))
def test_composition_equals_the_direct_transition(problem):
    t, mesh_shape, (a, b, c), seed = problem
    # a -> c may be illegal where b -> c splits a replica that a does not hold (a shard).
    assume(legal(a, b) and legal(b, c) and legal(a, c) and not isinstance(c[0], Partial))
    held = virtual.scatter(t, a, mesh_shape, seed)
    via_b = virtual.execute(transition(b, c, ndim=t.dim()),
                            virtual.execute(transition(a, b, ndim=t.dim()), held, mesh_shape),
                            mesh_shape)
    direct = virtual.execute(transition(a, c, ndim=t.dim()), held, mesh_shape)
    if any(isinstance(p, Partial) for p in c):
        # Terms of a reduction may differ; their reduction may not.
        torch.testing.assert_close(virtual.gather(via_b, c, mesh_shape), virtual.gather(direct, c, mesh_shape))
    else:
        for coord in coords(mesh_shape):
            torch.testing.assert_close(via_b[coord], direct[coord])


# Law 1: local shapes tile the global shape exactly, uneven included.
@given(setups(), st.data())
def test_local_shapes_tile_the_global_shape(setup, data):
    shape, mesh_shape = setup
    layout = data.draw(layouts(len(mesh_shape), len(shape), unequal=True))
    layout = tuple(Replicate() if isinstance(p, Partial) else p for p in layout)
    shape = even_where_packed(shape, [layout])
    ids = torch.arange(math.prod(shape)).reshape(shape)
    held = virtual.scatter(ids, layout, mesh_shape)
    seen = []
    for coord in coords(mesh_shape):
        assert tuple(held[coord].shape) == local_shape(shape, layout, mesh_shape, coord)
        # Count each element once per distinct shard: replicas sit at coordinate 0 only.
        if all(c == 0 or isinstance(p, Shard) for p, c in zip(layout, coord)):
            seen.extend(held[coord].flatten().tolist())
    assert sorted(seen) == ids.flatten().tolist()


def test_local_shape_follows_torch_chunk_for_uneven_sizes():
    assert [local_shape((7, 2), Shard(0), (2,), (c,)) for c in range(2)] == [(4, 2), (3, 2)]
    assert [local_shape((5,), Shard(0), (4,), (c,))[0] for c in range(4)] == [2, 2, 1, 0]
    assert local_shape((8, 6), (Shard(0), Shard(0)), (2, 2), (1, 1)) == (2, 6)
    assert local_shape((8, 6), (Shard(-1), Partial()), (4, 2), (3, 1)) == (8, 0)


@given(setups(), st.data())
def test_symbolic_local_shape_agrees_with_the_numeric_one(setup, data):
    shape, mesh_shape = setup
    layout = data.draw(layouts(len(mesh_shape), len(shape), unequal=True))
    shape = even_where_packed(shape, [layout])
    coord = tuple(data.draw(st.integers(0, k - 1)) for k in mesh_shape)
    names = sympy.symbols(f"d0:{len(shape)}", integer=True, nonnegative=True)
    symbolic = local_shape(names, layout, mesh_shape, coord)
    values = dict(zip(names, shape))
    assert tuple(int(sympy.sympify(s).subs(values)) for s in symbolic) == local_shape(
        shape, layout, mesh_shape, coord)


def test_a_symbolic_dim_that_the_mesh_divides_gives_a_plain_quotient():
    s, t = sympy.symbols("s t", positive=True, integer=True)
    assert local_shape((8 * s, 3), Shard(0), (8,), (5,)) == (s, 3)
    assert local_shape((s * t, 3), Shard(0), (t,), (0,)) == (s, 3)
    uneven = local_shape((s, 3), Shard(0), (2,), (1,))[0]
    assert [uneven.subs(s, n) for n in (6, 7)] == [3, 3]


# Cost: never negative, zero exactly when no step communicates.
@given(problems())
def test_cost_is_non_negative_and_zero_exactly_without_communication(problem):
    t, mesh_shape, (a, b), _ = problem
    assume(legal(a, b) and t.numel() > 0)
    steps = transition(a, b, ndim=t.dim())
    cost = comm_bytes(steps, t.shape, mesh_shape, itemsize=4)
    assert cost >= 0
    assert (cost == 0) == all(s.collective is None for s in steps)


def test_cost_follows_the_ring_model():
    b, s, h, n = sympy.symbols("b s h n", positive=True)
    shape = (b, s, h)
    assert comm_bytes(transition(Shard(1), Replicate()), shape, (n,), 2) == sympy.factor(
        2 * b * s * h * (n - 1) / n)
    assert comm_bytes(transition(Partial(), Shard(1)), shape, (n,), 2) == sympy.factor(
        2 * b * s * h * (n - 1) / n)
    assert comm_bytes(transition(Partial(), Replicate()), shape, (n,), 2) == sympy.factor(
        4 * b * s * h * (n - 1) / n)
    assert comm_bytes(transition(Shard(0), Shard(1)), shape, (n,), 2) == sympy.factor(
        2 * b * s * h * (n - 1) / n**2)
    assert comm_bytes(transition(Replicate(), Shard(0)), shape, (n,), 2) == 0
    # On a 2-D mesh, a step sees the tensor divided by the other mesh dims that shard it.
    steps = transition((Shard(0), Shard(1)), (Shard(0), Replicate()))
    assert steps == (AllGather(dim=1, mesh_dim=1, sharded_by=(0,)),)
    assert comm_bytes(steps, (8, 8), (2, 4), 1) == sympy.Rational(3, 4) * 64 / 2


@given(problems())
def test_symbolic_cost_agrees_with_the_numeric_one(problem):
    t, mesh_shape, (a, b), _ = problem
    assume(legal(a, b))
    steps = transition(a, b, ndim=t.dim())
    names = sympy.symbols(f"d0:{t.dim()}", positive=True)
    n = sympy.symbols(f"n0:{len(mesh_shape)}", positive=True)
    symbolic = comm_bytes(steps, names, n, 4)
    values = {**dict(zip(names, t.shape)), **dict(zip(n, mesh_shape))}
    assert sympy.simplify(symbolic.subs(values) - comm_bytes(steps, t.shape, mesh_shape, 4)) == 0


# Law 7: illegal transitions are rejected with the rule stated.
@given(st.integers(1, 3).flatmap(lambda n: st.tuples(layouts(n, unequal=True), layouts(n, unequal=True))))
def test_illegal_transitions_are_rejected(pair):
    src, dst = pair
    creates = any(isinstance(d, Partial) and s != d and not isinstance(s, Replicate)
                  for s, d in zip(src, dst))
    if creates:
        with pytest.raises(ValueError, match="no transition turns"):
            transition(src, dst)
    else:
        assert all(isinstance(s, Step) for s in transition(src, dst))


def test_illegal_transition_messages_state_the_rule():
    with pytest.raises(ValueError, match=r"turns Shard\(dim=0\) into Partial\(\) on mesh dim 0: "
                       r"Partial values arise only from computation .* or from a replica split "
                       r"into terms \(Replicate\(\) -> Partial\(\)\); a shard is neither"):
        transition(Shard(0), Partial())
    with pytest.raises(ValueError, match=r"terms pending a 'sum' reduction are not terms of a 'max'"):
        transition((Replicate(), Partial("sum")), (Replicate(), Partial("max")))
    with pytest.raises(ValueError, match="mixes Partial reductions"):
        transition((Partial("sum"), Partial("max")), (Replicate(), Replicate()))
    with pytest.raises(ValueError, match="layouts of different meshes"):
        transition(Shard(0), (Shard(0), Replicate()))


def test_one_step_per_kind_on_a_1d_mesh():
    assert transition(Shard(0), Replicate()) == (AllGather(0),)
    assert transition(Partial("max"), Replicate()) == (AllReduce("max"),)
    assert transition(Partial(), Shard(2)) == (ReduceScatter(2),)
    assert transition(Shard(0), Shard(1)) == (AllToAll(0, 1),)
    assert transition(Replicate(), Shard(1)) == (Chunk(1),)
    assert transition(Shard(-1), Shard(1), ndim=2) == ()
    assert transition(Shard(-1), Shard(1)) == (AllToAll(-1, 1),)


def test_a_replica_splits_into_terms_locally_as_dtensor_does():
    assert transition(Replicate(), Partial()) == (Split(),)
    assert transition(Replicate(), Partial("max")) == (Split("max"),)
    assert transition((Shard(0), Replicate()), (Shard(0), Partial())) == (
        Split(mesh_dim=1, sharded_by=(0,)),)
    assert comm_bytes(transition(Replicate(), Partial()), (8,), (2,), 4) == 0
    with pytest.raises(ValueError, match=r"not terms of a 'max' reduction"):
        transition(Partial(), Partial("max"))


def test_packed_shards_move_through_replicate_as_dtensor_does():
    assert transition(Shard(0, parts=2), Replicate()) == (AllGather(0, parts=2),)
    assert transition(Replicate(), Shard(1, parts=2)) == (Chunk(1, parts=2),)
    assert transition(Partial(), Shard(1, parts=2)) == (AllReduce(), Chunk(1, parts=2))
    assert transition(Shard(0), Shard(0, parts=2)) == (AllGather(0), Chunk(0, parts=2))
    assert local_shape((8, 3), Shard(0, parts=2), (2,), (1,)) == (4, 3)
    with pytest.raises(ValueError, match="needs dim 0 to hold 2 equal parts; it has 7"):
        local_shape((7, 3), Shard(0, parts=2), (2,), (0,))
    with pytest.raises(ValueError, match="packed shards .* are modelled on 1-D meshes only"):
        transition((Shard(0, parts=2), Replicate()), (Replicate(), Replicate()))


def test_nested_sharding_is_undone_inner_first_as_dtensor_does():
    assert transition((Shard(0), Shard(0)), (Shard(1), Shard(0))) == (
        AllGather(0, mesh_dim=1, sharded_by=(0,)),
        AllToAll(0, 1),
        Chunk(0, mesh_dim=1, sharded_by=(0,)),
    )


# Steps and their programs are values too.
@given(problems())
def test_steps_print_as_the_code_that_builds_them(problem):
    t, _, (a, b), _ = problem
    assume(legal(a, b))
    steps = transition(a, b)
    assert eval(repr(steps)) == steps
    assert hash(eval(repr(steps))) == hash(steps)


# Law 5: duality; the backward of a transition is its dual.
def test_pullback_pairs_gather_with_reduce_scatter_and_chunk_with_gather():
    assert pullback(Shard(1), Replicate(), grad=Partial()) == (ReduceScatter(1),)
    assert pullback(Replicate(), Shard(1)) == (AllGather(1),)
    assert pullback(Partial(), Replicate()) == ()
    assert pullback(Partial(), Shard(0)) == (AllGather(0),)
    assert pullback(Partial(), Replicate(), grad=Partial()) == (AllReduce(),)
    assert pullback(Shard(0), Shard(1)) == (AllToAll(1, 0),)


@given(st.integers(1, 3).flatmap(lambda n: st.tuples(layouts(n, unequal=True), layouts(n, unequal=True))))
def test_pullback_lands_on_the_cotangent_of_the_source(pair):
    src, dst = pair
    assume(legal(src, dst))
    steps = pullback(src, dst, ndim=3)
    got = list(normalize(dst, 3))
    for step in steps:  # replay the placement each step leaves on its mesh dim
        assert got[step.mesh_dim] == step.src
        got[step.mesh_dim] = step.dst
    assert tuple(got) == cotangent(normalize(src, 3))
    assert all(not isinstance(p, Partial) for p in got)


def test_a_split_pulls_back_to_nothing_or_to_a_split():
    whole = Replicate()  # the gradient of a Partial value: cotangent(Partial())
    assert pullback(Replicate(), Partial(), whole) == ()  # DTensor's: the whole gradient
    assert pullback(Replicate(), Partial(), whole, to=Partial()) == (Split(),)
    assert pullback(Replicate(), Replicate(), Partial(), to=Partial()) == ()  # terms stay terms
    with pytest.raises(ValueError, match=r"lands in \(Shard\(dim=0\),\) or, where it is "
                       r"replicated, as terms \(Partial\(\)\); not in \(Partial\(\),\)"):
        pullback(Shard(0), Replicate(), to=Partial())


# Law 5, with terms: a gradient may land as terms of a sum wherever the source is replicated,
# and holds the same value there.
@given(problems(), st.data())
def test_pullback_to_terms_lands_there_with_the_gradients_value(problem, data):
    t, mesh_shape, (src, dst), seed = problem
    assume(legal(src, dst))
    land = cotangent(normalize(src, t.dim()))
    terms = data.draw(st.lists(st.booleans(), min_size=len(land), max_size=len(land)))
    to = tuple(Partial() if isinstance(p, Replicate) and b else p for p, b in zip(land, terms))
    grad = cotangent(normalize(dst, t.dim()))
    assume(legal(grad, to))  # no transition splits a shard: it is gathered first
    steps = pullback(src, dst, grad, to=to, ndim=t.dim())
    got = list(grad)
    for step in steps:  # replay the placement each step leaves on its mesh dim
        assert got[step.mesh_dim] == normalize(step.src, t.dim())[0]
        got[step.mesh_dim] = normalize(step.dst, t.dim())[0]
    assert tuple(got) == to
    held = virtual.execute(steps, virtual.scatter(t, grad, mesh_shape, seed), mesh_shape)
    torch.testing.assert_close(virtual.gather(held, to, mesh_shape), t)


def test_unequal_parts_move_through_replicate_as_equal_ones_do():
    qkv = Shard(0, parts=(4, 2, 2))
    assert transition(qkv, Replicate()) == (AllGather(0, parts=(4, 2, 2)),)
    assert transition(Replicate(), qkv) == (Chunk(0, parts=(4, 2, 2)),)
    assert transition(Shard(0), qkv) == (AllGather(0), Chunk(0, parts=(4, 2, 2)))
    assert pullback(Replicate(), qkv) == (AllGather(0, parts=(4, 2, 2)),)
    assert local_shape((8, 3), qkv, (2,), (1,)) == (4, 3)
    assert shard_ranges(8, qkv, 2, 1) == ((2, 2), (5, 1), (7, 1))  # q[2:4], k[1:2], v[1:2]
    with pytest.raises(ValueError, match=r"packs parts of 4 \+ 2 \+ 2 = 8 in dim 0, which has 9\."):
        local_shape((9, 3), qkv, (2,), (0,))
    with pytest.raises(ValueError, match="two or more part sizes"):
        Shard(0, parts=(8,))


@given(st.lists(st.integers(1, 6), min_size=2, max_size=4), st.integers(2, 4), st.integers(1, 3))
def test_equal_sizes_are_the_equal_parts_of_an_int(sizes, k, n):
    """Law: ``parts=(p,) * n`` holds what ``parts=n`` holds, rank by rank."""
    part = sizes[0]
    for c in range(k):
        assert shard_ranges(part * n, Shard(0, parts=(part,) * n if n > 1 else 1), k, c) == \
            shard_ranges(part * n, Shard(0, parts=n), k, c)


@given(heads(), st.integers(1, 4), st.sampled_from([1, 2, 3, 4]), st.data())
def test_heads_are_whole_on_every_rank_and_replicas_agree(placement, per_head, factor, data):
    """Over ranks that divide the heads each holds its own; over a multiple of them each
    head's group holds it whole, every replica alike; each head is held somewhere."""
    h = placement.heads
    k = data.draw(st.sampled_from(sorted({d for d in range(1, h + 1) if h % d == 0} | {h * factor})))
    size = h * per_head
    held = [shard_ranges(size, Shard(0, heads=h), k, c) for c in range(k)]
    for ranges in held:
        assert len(ranges) == 1 and ranges[0][1] % per_head == 0 and ranges[0][1] > 0
    assert sorted({r for ranges in held for r in ranges}) == [
        (i * size // len(set(held)), size // len(set(held))) for i in range(len(set(held)))]
    if k <= h:
        assert held == [shard_ranges(size, Shard(0), k, c) for c in range(k)]
    else:
        assert all(held[c] == held[c - c % (k // h)] for c in range(k))
    ids = torch.arange(size * 3).reshape(size, 3)
    for c in range(k):
        assert local_shape(ids.shape, Shard(0, heads=h), (k,), (c,)) == (held[c][0][1], 3)


def test_heads_refuse_a_number_of_ranks_that_neither_divides_nor_multiplies_them():
    with pytest.raises(ValueError, match=r"over 3 ranks: 3 neither divides the 2 heads nor is a "
                                         r"multiple of them"):
        local_shape((16, 4), Shard(0, heads=2), (3,), (0,))
    with pytest.raises(ValueError, match=r"no transition moves a tensor into or out of "
                                         r"Shard\(dim=0, heads=2\)"):
        transition(Shard(0, heads=2), Replicate())
    assert transition(Shard(0, heads=2), Shard(0, heads=2)) == ()
    with pytest.raises(ValueError, match="a dim is either packed parts or heads, not both"):
        Shard(0, parts=2, heads=2)
