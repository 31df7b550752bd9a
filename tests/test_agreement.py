"""Ranks agree on a sequence's length: seven positions on two ranks are 4 and 3, and from its
local 4 alone rank 0 cannot tell 7 from 8. A sharded local tensor that tpfn did not hand on
itself, nor computed from one that it did, costs one exchange of the ranks' local shapes
(one all-gather of a few ints), after which every rank knows its global shape, or every
rank raises the same ``LayoutError``."""

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.debug import CommDebugMode

import tpfn
from tests.models import clone, full, rel_err
from tpfn import LayoutError, Replicate, Shard, colwise, prepare_in, prepare_out, rowwise

TOL = 1e-5  # float32, one forward and backward against one device, as the neighbouring tests
TIMEOUT = 5  # seconds: ranks that disagree fail instead of waiting for each other


def _mesh():
    """A mesh on a group of its own with a short timeout, so that ranks that disagree fail."""
    return DeviceMesh.from_group(dist.new_group(timeout=datetime.timedelta(seconds=TIMEOUT)), "cpu")


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


PLANS = {
    "local": {"0": prepare_in(Shard(1)) >> colwise(), "2": rowwise() >> prepare_out(Replicate())},
    "dtensor": {"0": prepare_in(Shard(1), desired=Replicate()) >> colwise(local=False),
                "2": rowwise(local=False) >> prepare_out(Replicate())},
}


def _user_split(plan: str, lengths: tuple) -> dict:
    """Each rank hands the model its own torch.chunk piece of sequences of ``lengths``."""
    ref, rank = _mlp(), dist.get_rank()
    tp = tpfn.parallelize(clone(ref), _mesh(), PLANS[plan])
    errors, counts = {}, []
    for length in lengths:
        torch.manual_seed(length)
        x = torch.randn(2, length, 8)
        mine = x.chunk(2, dim=1)[rank].clone().requires_grad_()
        whole = x.clone().requires_grad_()
        for m in (ref, tp):
            m.zero_grad(set_to_none=True)
        with CommDebugMode() as mode:
            out = tp(mine)
        counts.append(tpfn.trace.counts(mode))
        expected = ref(whole)
        full(out).pow(2).sum().backward()
        expected.pow(2).sum().backward()
        errors[f"{length}: output"] = rel_err(out, expected)
        errors[f"{length}: input grad"] = rel_err(mine.grad, whole.grad.chunk(2, dim=1)[rank])
        ref_grads = dict(ref.named_parameters())
        for name, p in tp.named_parameters():
            errors[f"{length}: {name} grad"] = rel_err(p.grad, ref_grads[name].grad)
    return {"errors": errors, "counts": counts}


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_an_odd_sequence_the_user_split_gives_one_devices_numbers(ranks2, plan):
    """7 positions handed in as 4 and 3, then 8 as 4 and 4, then 5 as 3 and 2, to one model:
    each time the output, the input's gradient and every parameter gradient are one
    device's. Each forward adds one all-gather to the slot's own: the exchange of the
    input's local shapes (rank 0's 4 alone cannot tell 7 from 8)."""
    results = ranks2.run(_user_split, plan, (7, 8, 5), timeout=60)
    for result in results:
        assert {k: v for k, v in result["errors"].items() if not v < TOL} == {}
        assert result["counts"] == [{"all_gather": 2, "all_reduce": 1}] * 3


def _pieces(how: str) -> str:
    """Rank 0 and rank 1 hand in pieces that are no torch.chunk split of one tensor."""
    tp = tpfn.parallelize(_mlp(), _mesh(), PLANS["local"])
    rank = dist.get_rank()
    x = torch.randn(2, 7, 8)
    if how == "smaller first":  # x.tensor_split((3,), dim=1): 3 and 4
        mine = (x[:, :3], x[:, 3:])[rank]
    else:  # a batch of 2 on rank 0, of 3 on rank 1
        mine = torch.randn(2 + rank, 4 - rank, 8)
    try:
        tp(mine)
    except LayoutError as error:
        return str(error)
    return "finished"


@pytest.mark.parametrize("how, message", [
    ("smaller first",
     "input 0 of '0' (Linear) is declared Shard(dim=1), but the ranks hold rank 0: 3, rank 1: 4 "
     "of its 7 in dim 1, which is not how Shard(dim=1) splits 7 over 2 ranks (4, 3); hand rank "
     "r the piece x.chunk(2, dim=1)[r] of the whole tensor x (the larger pieces first)."),
    ("batches differ",
     "input 0 of '0' (Linear) is declared Shard(dim=1), but the ranks' pieces differ beyond dim "
     "1 (rank 0: (2, 4, 8), rank 1: (3, 3, 8)); hand every rank its piece of one tensor, cut "
     "along dim 1 only."),
])
def test_pieces_that_are_no_chunk_split_raise_the_same_error_on_every_rank(ranks2, how, message):
    assert ranks2.run(_pieces, how, timeout=60) == [message, message]


class TwoStreams(nn.Module):
    """Two sequences, of 7 and 8 positions, each embedded, normed and added back (a residual
    sum: a tensor tpfn did not hand on), then projected. On rank 0 both are 4 positions."""

    def __init__(self):
        super().__init__()
        self.emb_a, self.emb_b = nn.Embedding(16, 8), nn.Embedding(16, 8)
        self.norm_a, self.norm_b = nn.LayerNorm(8), nn.LayerNorm(8)
        self.head_a, self.head_b = nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, ids_a, ids_b):
        a, b = self.emb_a(ids_a), self.emb_b(ids_b)
        a, b = a + self.norm_a(a), b + self.norm_b(b)
        return self.head_a(a), self.head_b(b)


STREAMS = {
    "emb_*": rowwise() >> prepare_out(Shard(1)),
    "norm_*": tpfn.sequence_parallel(local=True),
    "head_*": prepare_in(Shard(1)) >> colwise() >> prepare_out(Replicate()),
}


def _two_streams(grad: bool) -> dict:
    torch.manual_seed(0)
    ref = TwoStreams()
    tp = tpfn.parallelize(clone(ref), _mesh(), STREAMS)
    ids_a, ids_b = torch.randint(0, 16, (2, 7)), torch.randint(0, 16, (2, 8))
    with CommDebugMode() as mode, torch.set_grad_enabled(grad):
        out = tp(ids_a, ids_b)
    counts = tpfn.trace.counts(mode)
    expected = ref(ids_a, ids_b)
    if not grad:
        return {"errors": {f"output {i}": rel_err(o, e) for i, (o, e) in
                           enumerate(zip(out, expected))}, "counts": counts}
    sum(o.pow(2).sum() for o in out).backward()
    sum(o.pow(2).sum() for o in expected).backward()
    errors = {f"output {i}": rel_err(o, e) for i, (o, e) in enumerate(zip(out, expected))}
    ref_grads = dict(ref.named_parameters())
    errors.update({name: rel_err(p.grad, ref_grads[name].grad) for name, p in tp.named_parameters()})
    return {"errors": errors, "counts": counts}


def test_two_sequence_parallel_streams_of_7_and_8_positions(ranks2):
    """Rank 0 holds 4 positions of each stream. The residual sums are new tensors, computed
    from the embeddings' outputs (which the slots handed on): their autograd graph names the
    global shape, with no exchange, and the head gathers 7 positions of one and 8 of the
    other, on both ranks. Without a graph (no_grad) the ranks exchange their local shapes
    once for each sum (2 of the forward's 6 all-gathers)."""
    for result in ranks2.run(_two_streams, True, timeout=60):
        assert {k: v for k, v in result["errors"].items() if not v < TOL} == {}
        assert result["counts"] == {"all_gather": 4, "reduce_scatter": 2}
    for result in ranks2.run(_two_streams, False, timeout=60):
        assert {k: v for k, v in result["errors"].items() if not v < TOL} == {}
        assert result["counts"] == {"all_gather": 6, "reduce_scatter": 2}


def _one_rank() -> dict:
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    mesh = DeviceMesh.from_group(groups[dist.get_rank()], "cpu")
    ref = _mlp()
    tp = tpfn.parallelize(clone(ref), mesh, PLANS["local"])
    x = torch.randn(2, 7, 8)
    with CommDebugMode() as mode:
        out = tp(x)
    return {"counts": tpfn.trace.counts(mode), "error": rel_err(out, ref(x))}


def test_a_one_rank_mesh_exchanges_no_shapes(ranks2):
    for result in ranks2.run(_one_rank, timeout=60):
        assert result["counts"] == {} and result["error"] < TOL
