"""Buffers placed by ``params(...)``: sharded, used in forward, kept by checkpoints."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import tpfn
from tests.models import clone
from tests.ranks import mesh
from tests.test_kinds import ScaledLinear
from tpfn import Partial, PlanError, Replicate, Shard, on_shards, params, prepare_in, prepare_out

# float64 references: rounding ~1e-16 relative; 1e-12 leaves room for sums reordered over 2 ranks.
TOL = 1e-12


class Gain(nn.Module):
    """A projection scaled by a buffer of per-feature gains, computing on what it is handed."""

    def __init__(self, dim=8, out=12):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out, dim) / dim**0.5)
        self.register_buffer("gain", torch.rand(out) + 0.5)

    def forward(self, x):
        return (x @ self.weight.T) * self.gain


# On DTensors: the gains sharded with the features they scale.
ON_DTENSORS = params(weight=Shard(0), gain=Shard(0)) >> prepare_in(Replicate()) \
    >> prepare_out(Replicate())
# On local shards: ScaledLinear's scales with its rows.
ON_SHARDS = params(weight=Shard(0), bias=Shard(0), scale=Shard(0)) >> on_shards(
    Replicate(), grads=Partial(), output=Shard(-1)) >> prepare_out(Replicate())


def _rel_err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm()).item()


def _sharded_buffers():
    rank, found = dist.get_rank(), {}
    for name, build, style in (("dtensors", Gain, ON_DTENSORS),
                               ("shards", lambda: ScaledLinear(8, 12), ON_SHARDS)):
        torch.manual_seed(0)
        ref = build().double()
        tp = tpfn.parallelize(clone(ref), mesh(2), style)
        buffer = dict(tp.named_buffers())["gain" if name == "dtensors" else "scale"]
        x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        with CommDebugMode() as mode:
            out = tp(x2)
            out.pow(2).sum().backward()
        expected = ref(x)
        expected.pow(2).sum().backward()
        found[name] = {
            "buffer": (str(buffer.placements), isinstance(buffer, nn.Parameter),
                       torch.equal(buffer.to_local(), ref.get_buffer(
                           "gain" if name == "dtensors" else "scale").chunk(2)[rank])),
            "errors": {"output": _rel_err(out, expected), "input.grad": _rel_err(x2.grad, x.grad),
                       **{n: _rel_err(p.grad.full_tensor(), ref.get_parameter(n).grad)
                          for n, p in tp.named_parameters()}},
            "counts": tpfn.trace.counts(mode)}
    return found


def test_a_sharded_buffer_used_in_forward_equals_one_device(ranks2):
    for found in ranks2.run(_sharded_buffers):
        for name, f in found.items():
            assert f["buffer"] == ("(Shard(dim=0),)", False, True), name
            assert max(f["errors"].values()) <= TOL, (name, f["errors"])
        # the output gathered forward; the input's gradient all-reduced (and, on DTensors,
        # the output's gradient split again: a local chunk, no collective); on shards, the
        # kernel's output is a tensor tpfn did not hand on, whose length the ranks exchange
        # before gathering it (one all-gather of a few ints)
        assert found["shards"]["counts"] == {"all_gather": 2, "all_reduce": 1}
        assert found["dtensors"]["counts"] == {"all_gather": 1, "all_reduce": 1}


def _checkpointed(directory):
    torch.manual_seed(0)
    source = ScaledLinear(8, 12)
    saved = tpfn.parallelize(clone(source), mesh(2), ON_SHARDS)
    path = os.path.join(directory, "dcp")
    tpfn.checkpoint.save(path, saved)
    torch.manual_seed(1)
    fresh = tpfn.parallelize(ScaledLinear(8, 12), mesh(2), ON_SHARDS)  # other scales
    tpfn.checkpoint.load(path, fresh)
    found = {"dcp": torch.equal(fresh.scale.full_tensor(), source.scale),
             "exported": torch.equal(tpfn.checkpoint.full_state_dict(saved)["scale"], source.scale)}
    pretrained = os.path.join(directory, "pretrained")
    tpfn.save_pretrained(saved, pretrained)  # gathered, written by rank 0
    with tpfn.empty_weights():
        empty = ScaledLinear(8, 12)
    empty.scale.zero_()
    tpfn.parallelize(empty, mesh(2), ON_SHARDS, src_rank=None)
    tpfn.load_pretrained(empty, pretrained)  # each rank reads its slice of the scales
    found["pretrained"] = torch.equal(empty.scale.full_tensor(), source.scale)
    found["local"] = tuple(empty.scale.to_local().shape)
    return found


def test_a_checkpoint_keeps_a_sharded_buffer(ranks2, tmp_path):
    for found in ranks2.run(_checkpointed, str(tmp_path)):
        assert found == {"dcp": True, "exported": True, "pretrained": True, "local": (6,)}
    plain = ScaledLinear(8, 12)
    tpfn.checkpoint.load(str(tmp_path / "dcp"), plain)  # one process: the whole scales
    torch.manual_seed(0)
    assert torch.equal(plain.scale, ScaledLinear(8, 12).scale)


def test_a_buffer_name_that_is_not_there_is_named():
    model = Gain()
    with pytest.raises(PlanError, match=r"params\(gian=Shard\(dim=0\)\) at '<root>' \(Gain\): no "
                                        r"parameter or buffer 'gian'; it has weight, gain \(did you "
                                        r"mean 'gain'\?\)\."):
        tpfn.parallelize(model, tpfn.dryrun.fake_mesh(2), params(gian=Shard(0)), src_rank=None)
    assert not isinstance(model.gain, DTensor)
