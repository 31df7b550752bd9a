"""Nothing silently wrong: what a style would compute wrongly is refused by name, and every
check one device makes is made on the sharded path too, on every rank alike."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tpfn
from tests.models import clone, rel_err
from tests.ranks import mesh
from tpfn import (
    LayoutError, PlanError, Replicate, Shard, colwise, on_shards, prepare_out, rowwise,
    sequence_parallel,
)

TOL = 1e-5  # one forward and backward in float32: the suite's usual bound, measured <= 2e-7


@pytest.mark.parametrize("module", [nn.BatchNorm1d(4), nn.GroupNorm(2, 4), nn.MaxPool1d(2),
                                    nn.AvgPool1d(2), nn.AdaptiveAvgPool1d(1), nn.InstanceNorm1d(4),
                                    nn.LayerNorm((3, 4), elementwise_affine=False)])
def test_sequence_parallel_refuses_modules_that_combine_positions(module):
    with pytest.raises(PlanError, match=f"{type(module).__name__} combines positions"):
        tpfn.resolve({"0": sequence_parallel()}, nn.Sequential(module))


def test_sequence_parallel_keeps_modules_that_act_on_each_position():
    for module in (nn.LayerNorm(4), nn.RMSNorm(4), nn.Dropout(0.1), nn.GELU()):
        assert tpfn.resolve({"0": sequence_parallel()}, nn.Sequential(module))


def _penalty():
    torch.manual_seed(0)
    mlp = tpfn.parallelize(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)), mesh(2),
                           {"0": colwise(), "2": rowwise()})
    x = torch.randn(3, 4, requires_grad=True)
    try:
        (g,) = torch.autograd.grad(mlp(x).pow(2).sum(), x, create_graph=True)
        g.pow(2).sum().backward()
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_a_second_order_gradient_through_the_shards_is_refused_by_name(ranks2):
    """A gradient penalty needs the backward's collectives differentiated again, which tpfn's
    moves are not: it is refused (native TP refuses too) instead of being 80% off."""
    for message in ranks2.run(_penalty):
        assert message.startswith("a second-order gradient (backward with create_graph=True) "
                                  "runs through ")


def _out_of_vocabulary():
    torch.manual_seed(0)
    embedding = tpfn.parallelize(nn.Sequential(nn.Embedding(10, 4)), mesh(2), {"0": rowwise()})
    try:
        embedding(torch.tensor([[1, 10]]))
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_an_id_outside_the_vocabulary_raises_on_every_rank(ranks2):
    """One device raises for an out-of-range id; the sharded lookup masks ids outside each
    rank's slice, so without a check it would give a row of zeros."""
    for message in ranks2.run(_out_of_vocabulary):
        assert "input 0 of '0' (Embedding): an id lies outside the vocabulary [0, 10)" in message


def _keys_on_a_tuple():
    class Pair(nn.Module):
        def forward(self, x):
            return x, x

    pair = tpfn.parallelize(Pair(), mesh(2), prepare_out(keys={"a": Replicate()}))
    try:
        pair(torch.ones(2))
    except LayoutError as error:
        return str(error)
    return "no error"


def test_keys_on_an_output_that_is_no_dict_are_refused(ranks2):
    assert ranks2.run(_keys_on_a_tuple)[0] == (
        "'<root>' (Pair) returned a tuple, but the plan lays out outputs by key ('a'), which only "
        "a dict has; give prepare_out one layout per position instead.")


def _loss_checks():
    torch.manual_seed(0)
    head = tpfn.parallelize(nn.Sequential(nn.Linear(4, 10)), mesh(2), {"0": colwise(local=False)})
    logits = head(torch.randn(3, 4))
    found = []
    for target, weight in ((torch.tensor([1, 2, 10]), None), (torch.tensor([1, 2, 3]), torch.ones(9)),
                           (torch.tensor([1, -100, 3]), None)):
        try:
            tpfn.cross_entropy(logits, target, weight)
            found.append("ok")
        except (RuntimeError, ValueError) as error:
            found.append(str(error))
    return found


def test_cross_entropy_checks_targets_and_weights_as_one_device_does(ranks2):
    for bad_target, bad_weight, ignored in ranks2.run(_loss_checks):
        assert "a target lies outside the 10 classes (and is not ignore_index=-100)" in bad_target
        assert bad_weight == ("cross_entropy: 'weight' must hold one weight per class, 10 (got one "
                              "of shape (9,)).")
        assert ignored == "ok"


def _deep_copy():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    tp = tpfn.parallelize(clone(ref), mesh(2), {"0": colwise(), "2": rowwise()})
    twin = copy.deepcopy(tp)
    x = torch.randn(3, 4)
    same = rel_err(twin(x), ref(x)) <= TOL and tpfn.mounted(twin[0]) == tpfn.mounted(tp[0])
    try:
        tpfn.parallelize(twin, mesh(2), {"0": colwise(), "2": rowwise()})
    except PlanError as error:
        return same, str(error)
    return same, "no error"


def test_a_deep_copy_of_a_parallelized_model_runs_and_is_not_parallelized_twice(ranks2):
    same, message = ranks2.run(_deep_copy)[0]
    assert same
    assert "'0' (Linear) is already parallelized (colwise()); parallelize a fresh module" in message


def _checkpointed(reentrant: bool):
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    tp = tpfn.parallelize(clone(ref), mesh(2), {"0": colwise(), "2": rowwise()})
    x = torch.randn(3, 4, requires_grad=True)
    checkpoint(tp, x, use_reentrant=reentrant).pow(2).sum().backward()
    ref(x.detach()).pow(2).sum().backward()
    return max(rel_err(p.grad.full_tensor(), q.grad) for p, q in zip(tp.parameters(), ref.parameters()))


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_is_first_order_and_runs(ranks2, reentrant):
    """The refusal of second-order gradients leaves activation checkpointing alone: its
    recomputation's backward builds no graph."""
    assert max(ranks2.run(_checkpointed, reentrant)) <= TOL
