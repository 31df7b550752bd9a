import pickle

import attrs
import pytest
import torch.distributed.tensor as dt
from hypothesis import given
from hypothesis import strategies as st

from tests.strategies import layouts, placements
from tpfn import Partial, Replicate, Shard
from tpfn.layout import as_layout, from_torch, normalize, to_torch


@given(placements())
def test_repr_is_the_constructor_call(p):
    assert eval(repr(p)) == p


@given(placements(), placements())
def test_equal_by_value_and_hash_consistent(a, b):
    assert (a == b) == (repr(a) == repr(b))
    if a == b:
        assert hash(a) == hash(b)


def test_values_built_apart_are_equal_and_hash_alike():
    assert Shard(1) == Shard(dim=1) and hash(Shard(1)) == hash(Shard(dim=1))
    assert Partial() == Partial("sum") and Partial("sum") != Partial("max")
    assert Replicate() == Replicate() and Shard(0) != Replicate()
    assert len({Shard(0), Shard(0), Replicate(), Replicate()}) == 2


def test_placements_are_frozen_and_slotted():
    p = Shard(0)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        p.dim = 1
    assert not hasattr(p, "__dict__")
    assert pickle.loads(pickle.dumps(p)) == p


@pytest.mark.parametrize(
    "build, error, message",
    [
        (lambda: Shard(1.5), TypeError,
         "'dim' must be <class 'int'> (got 1.5 that is a <class 'float'>)."),
        (lambda: Shard("x"), TypeError, "'dim' must be <class 'int'> (got 'x' that is a <class 'str'>)."),
        (lambda: Shard(True), TypeError, "'dim' must be <class 'int'> (got True that is a <class 'bool'>)."),
        (lambda: Partial("median"), ValueError,
         "'op' must be in ('sum', 'avg', 'max', 'min') (got 'median')."),
        (lambda: Partial(3), TypeError, "'op' must be <class 'str'> (got 3 that is a <class 'int'>)."),
    ],
)
def test_bad_fields_are_rejected_at_construction(build, error, message):
    with pytest.raises(error) as info:
        build()
    assert str(info.value) == message


def test_as_layout_wraps_a_placement_and_rejects_anything_else():
    assert as_layout(Replicate()) == (Replicate(),)
    for bad in ([Shard(0)], (), (Shard(0), "R"), dt.Shard(0)):
        with pytest.raises(TypeError, match="'layout' must be a placement"):
            as_layout(bad)


def test_negative_dims_normalize_against_ndim():
    assert normalize((Shard(-1), Shard(-3), Replicate()), 3) == (Shard(2), Shard(0), Replicate())
    with pytest.raises(ValueError, match=r"Shard\(dim=-4\) does not fit a tensor of 3 dims"):
        normalize(Shard(-4), 3)


@given(st.integers(1, 3).flatmap(lambda n: layouts(n)))
def test_torch_round_trip(layout):
    torch_layout = to_torch(layout)
    assert all(isinstance(p, dt.placement_types.Placement) for p in torch_layout)
    assert from_torch(torch_layout) == layout
    assert from_torch(list(torch_layout)) == layout


def test_torch_placements_map_one_to_one():
    assert to_torch((Shard(1), Replicate(), Partial("avg"))) == (
        dt.Shard(1), dt.Replicate(), dt.Partial("avg"))
    assert from_torch(dt.Partial("max")) == (Partial("max"),)


def test_from_torch_rejects_placements_tpfn_does_not_model():
    with pytest.raises(ValueError, match=r"Partial\(product\) has no tpfn layout"):
        from_torch(dt.Partial("product"))



def test_packed_shards_are_dtensors_strided_shards():
    strided = dt.placement_types._StridedShard(1, split_factor=2)
    assert from_torch(strided) == (Shard(1, parts=2),)
    assert to_torch(Shard(1, parts=2)) == (strided,)
    assert repr(Shard(1, parts=2)) == "Shard(dim=1, parts=2)" and Shard(1, parts=1) == Shard(1)
    with pytest.raises(ValueError, match="'parts' must be at least 1 \\(got 0\\)."):
        Shard(0, parts=0)
