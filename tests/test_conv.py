"""Convolutions on their channels: ``colwise()`` on the output channels, ``rowwise()`` on the input
channels, a grouped (depthwise) convolution and the norms between them (BatchNorm, GroupNorm) on
each rank's channels; against one device in float64, forward, every gradient and the running
statistics, on real gloo ranks."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.debug import CommDebugMode

import tpfn
from tests.models import clone, full, rel_err
from tests.ranks import mesh
from tpfn.dryrun import fake_mesh
from tpfn import PlanError, colwise, rowwise

# float64 references: rounding ~1e-16 relative; 1e-12 leaves room for sums reordered over the ranks.
TOL = 1e-12


class ConvPairs(nn.Module):
    """A 2-D pair with a BatchNorm, a depthwise convolution (reflect-padded) and a GroupNorm on
    the channels between its halves, then a 1-D pair through a transposed convolution."""

    def __init__(self, c: int = 4, hidden: int = 8):
        super().__init__()
        self.up = nn.Conv2d(c, hidden, 3, padding=1, bias=False)  # (a BatchNorm after it: a bias's gradient is 0)
        self.bn = nn.BatchNorm2d(hidden)
        self.dw = nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, padding_mode="reflect")
        self.gn = nn.GroupNorm(4, hidden)
        self.down = nn.Conv2d(hidden, c, 3, stride=2, padding=1)
        self.widen = nn.ConvTranspose1d(c, hidden, 2, stride=2)
        self.narrow = nn.Conv1d(hidden, c, 3, padding="same", padding_mode="circular", bias=False)

    def forward(self, x):
        h = self.down(F.silu(self.gn(self.dw(F.relu(self.bn(self.up(x)))))))
        h = h + x[..., ::2, ::2]
        y = h.flatten(2)
        return y + self.narrow(F.gelu(self.widen(y)))[..., ::2]


PLAN = {"up": colwise(), "bn": colwise(), "dw": colwise(), "gn": colwise(), "down": rowwise(),
        "widen": colwise(), "narrow": rowwise()}


def _pairs(n: int):
    torch.manual_seed(0)
    ref = ConvPairs().double().train()
    for name, p in ref.named_parameters():  # norms start at ones and zeros: make their gradients a test
        p.data.normal_()
    tp = tpfn.parallelize(clone(ref), mesh(n), PLAN)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64, generator=gen)
    cot = torch.randn(2, 4, 9, dtype=torch.float64, generator=gen)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = ref(x1)
    (expected * cot).sum().backward()
    with CommDebugMode() as forward:
        out = tp(x2)
    with CommDebugMode() as backward:
        (out * cot).sum().backward()
    errors = {"output": rel_err(out, expected), "input.grad": rel_err(x2.grad, x1.grad)}
    theirs = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
    for name, p in tp.named_parameters():
        errors[name] = rel_err(p, theirs[name])
        errors[name + ".grad"] = rel_err(p.grad, theirs[name].grad)
    for name, b in tp.named_buffers():  # the running statistics, updated on each rank's channels
        errors[name] = rel_err(full(b).double(), theirs[name].double())
    local = {"up.weight": tuple(tp.up.weight.to_local().shape), "dw.weight": tuple(tp.dw.weight.to_local().shape),
             "bn.running_mean": tuple(tp.bn.running_mean.to_local().shape), "widen.weight":
             tuple(tp.widen.weight.to_local().shape), "narrow.weight": tuple(tp.narrow.weight.to_local().shape),
             "dw.groups": tp.dw.groups, "gn.num_groups": tp.gn.num_groups}
    return errors, tpfn.trace.counts(forward), tpfn.trace.counts(backward), local


@pytest.mark.parametrize("n", [2, 4])
def test_convolution_pairs_and_the_norms_between_them_equal_one_device(n, request):
    ranks = request.getfixturevalue(f"ranks{n}")
    for errors, forward, backward, local in ranks.run(_pairs, n):
        assert max(errors.values()) <= TOL, {k: e for k, e in errors.items() if e > TOL}
        assert forward == {"all_reduce": 2}   # the partial sums of down and narrow
        assert backward == {"all_reduce": 2}  # the gradients of up's and widen's replicated inputs
        assert local == {"up.weight": (8 // n, 4, 3, 3), "dw.weight": (8 // n, 1, 3, 3),
                         "bn.running_mean": (8 // n,), "widen.weight": (4, 8 // n, 2),
                         "narrow.weight": (4, 8 // n, 3), "dw.groups": 8, "gn.num_groups": 4}


def test_the_rows_of_convolutions_and_norms_are_compositions_of_primitives():
    model = ConvPairs()
    rows = {name: tpfn.resolve(PLAN[name], getattr(model, name))[0] for name in PLAN}
    styles = {name: repr(row.row.style) for name, row in rows.items()}
    assert styles == {
        "up": "replicate() >> params(weight=Shard(dim=0)) >> on_shards(Replicate(), grads=Partial(), "
              "output=Shard(dim=1))",
        "bn": "params(bias=Shard(dim=0), running_mean=Shard(dim=0), running_var=Shard(dim=0), "
              "weight=Shard(dim=0)) >> on_shards(Shard(dim=1), output=Shard(dim=1))",
        "dw": "params(bias=Shard(dim=0), weight=Shard(dim=0)) >> on_shards(Shard(dim=1), output=Shard(dim=1)) "
              ">> per_rank('groups')",
        "gn": "params(bias=Shard(dim=0), weight=Shard(dim=0)) >> on_shards(Shard(dim=1), output=Shard(dim=1)) "
              ">> per_rank('num_groups')",
        "down": "replicate() >> params(bias=Replicate(), weight=Shard(dim=1)) >> on_shards(Shard(dim=1), "
                "output=Partial()) >> prepare_out(Replicate())",
        "widen": "replicate() >> params(bias=Shard(dim=0), weight=Shard(dim=1)) >> on_shards(Replicate(), "
                 "grads=Partial(), output=Shard(dim=1))",  # (in, out, k): the output channels are dim 1
        "narrow": "replicate() >> params(weight=Shard(dim=1)) >> on_shards(Shard(dim=1), output=Partial()) "
                  ">> prepare_out(Replicate())"}
    assert rows["down"].row.once == "bias"  # added once to the partial sums
    # the composition, written out, mounts as the built-in does (its output a DTensor unless local=True)
    for name in PLAN:
        written, row = tpfn.resolve(eval(styles[name], vars(tpfn)), getattr(model, name))[0], rows[name]
        assert (written.params, written.inputs.slots, written.shards.output, written.sizes) == (
            row.params, row.inputs.slots, row.shards.output, row.sizes), name


@pytest.mark.parametrize("module, shape", [
    (nn.Conv2d(3, 5, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2)), (2, 3, 9, 8)),
    (nn.Conv1d(3, 5, 3, padding="same", dilation=2), (3, 10)),
    (nn.Conv3d(3, 5, 2, padding="valid"), (1, 3, 4, 5, 6)),
])
def test_a_convolution_s_row_knows_its_output_shape(module, shape):
    row = tpfn.resolve(colwise(), module)[0].row
    assert row.shape(module, shape) == tuple(module(torch.randn(shape)).shape)
    # a transposed convolution's forward may be given its output_size: recalled from the ranks' shards
    transposed = nn.ConvTranspose2d(3, 5, 3, stride=2)
    assert tpfn.resolve(colwise(), transposed)[0].row.shape(transposed, (2, 3, 5, 4)) is None


def test_an_unbatched_input_to_a_convolution_on_channels_is_refused_by_name():
    model = tpfn.parallelize(nn.Conv1d(4, 8, 3), fake_mesh(2), colwise(), src_rank=None)
    with pytest.raises(ValueError, match=r"'<root>' \(Conv1d\) got an unbatched input of shape \(4, 6\), its "
                                         r"channels in dim 0, but colwise\(\) lays out channels in dim 1; give "
                                         r"it a batch of one \(x.unsqueeze\(0\)\)"):
        model(torch.randn(4, 6))


def test_what_channels_cannot_split_is_refused_by_name():
    model = nn.ModuleDict(dict(dw=nn.Conv2d(6, 6, 3, groups=3), gn=nn.GroupNorm(3, 6)))
    with pytest.raises(PlanError) as e:
        tpfn.parallelize(model, fake_mesh(2), {"dw": colwise(), "gn": colwise()}, src_rank=None)
    assert e.value.problems == [
        "colwise() at 'dw' (Conv2d): its 3 groups do not split evenly over 2 ranks, and each rank computes whole "
        "groups of channels; choose a mesh size that divides 3, or leave it out of the plan (replicated).",
        "colwise() at 'gn' (GroupNorm): its 3 groups do not split evenly over 2 ranks, and each rank computes "
        "whole groups of channels; choose a mesh size that divides 3, or leave it out of the plan (replicated)."]
    with pytest.raises(PlanError) as e:
        tpfn.resolve({"dw": rowwise(), "gn": rowwise(), "conv": colwise(parts=2)},
                     nn.ModuleDict(dict(dw=nn.Conv2d(6, 6, 3, groups=3), gn=nn.GroupNorm(3, 6),
                                        conv=nn.Conv1d(2, 4, 1))))
    assert e.value.problems == [
        "rowwise() at 'dw' (Conv2d): Conv2d(groups=3) computes each group from its own input channels, so it "
        "shards whole groups, channels in and out: use colwise().",
        "rowwise() at 'gn' (GroupNorm): GroupNorm normalizes each channel (or group of channels) on its own, so "
        "it computes on a rank's channels as they come: use colwise(), which shards its channels, between a "
        "column-wise and a row-wise convolution.",
        "colwise(parts=2) at 'conv' (Conv1d): parts=2 packs parts or heads of a linear projection's output "
        "features; Conv1d shards its channels whole: use colwise()."]
