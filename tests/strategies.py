"""Hypothesis strategies for placements, layouts, shapes and meshes."""

from __future__ import annotations

from hypothesis import strategies as st

from tpfn.layout import REDUCE_OPS, Partial, Replicate, Shard

# Unequal packed parts: two or three parts of 1 to 4 items (a GQA q, k, v in small).
UNEQUAL = st.lists(st.integers(1, 4), min_size=2, max_size=3).map(tuple)


def placements(ndim: int = 3, ops=REDUCE_OPS, packed: bool = True, unequal: bool = False):
    """Any placement of a tensor with ``ndim`` dims (negative shard dims and, if ``packed``,
    two packed parts included; with ``unequal``, parts of unequal sizes too)."""
    parts = st.sampled_from([1, 2] if packed else [1])
    if packed and unequal:
        parts = st.one_of(parts, UNEQUAL)
    return st.one_of(
        st.builds(Shard, st.integers(-ndim, ndim - 1), parts),
        st.just(Replicate()),
        st.builds(Partial, st.sampled_from(ops)),
    )


@st.composite
def layouts(draw, mesh_ndim: int, ndim: int = 3, unequal: bool = False):
    """A layout for ``mesh_ndim`` mesh dims that uses at most one Partial reduction."""
    op = draw(st.sampled_from(REDUCE_OPS))
    packed = mesh_ndim == 1  # packed shards are modelled on 1-D meshes
    return tuple(draw(placements(ndim, ops=(op,), packed=packed, unequal=unequal))
                 for _ in range(mesh_ndim))


@st.composite
def setups(draw, max_mesh_ndim: int = 3):
    """(global shape, mesh shape) with uneven sizes likely."""
    mesh_shape = tuple(draw(st.lists(st.integers(2, 4), min_size=1, max_size=max_mesh_ndim)))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=3)))
    return shape, mesh_shape


def heads(ndim: int = 3):
    """``Shard(dim, heads=h)`` for 1 to 4 heads."""
    return st.builds(lambda d, h: Shard(d, heads=h), st.integers(-ndim, ndim - 1), st.integers(1, 4))
