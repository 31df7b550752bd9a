"""Packed parts and ``on_shards``: fused projections and modules tpfn has no built-in style for."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate as TReplicate

import tpfn
from tests.models import clone, counts, max_rel_err, rel_err
from tests.ranks import mesh
from tpfn import (
    Partial, Replicate, Shard, colwise, on_shards, params, prepare_in, prepare_out, replicate,
    rowwise,
)
from tpfn.plans.mount import mount

TOL = 1e-5


def test_on_shards_is_a_core_that_states_its_layouts():
    style = params(w=Shard(0)) >> on_shards(Replicate(), None, grads=(Partial(), None),
                                            output=Partial()) >> prepare_out(Replicate())
    assert eval(repr(style), {n: getattr(tpfn, n) for n in tpfn.__all__}) == style

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(4, 2))

        def forward(self, x, index):
            return x

    m = mount(style, M())
    assert (m.shards.desired, m.shards.grads) == ((Replicate(), None), (Partial(), None))
    assert m.shards.output == Partial() and m.inputs.local is True
    assert m.outputs.slots[0].given == Partial() and m.outputs.slots[0].desired == Replicate()
    assert mount(colwise(parts=2), nn.Linear(2, 8)).params == (
        ("bias", Shard(0, parts=2)), ("weight", Shard(0, parts=2)))
    assert repr(colwise(parts=2)) == "colwise(parts=2)"


class GatedMLP(nn.Module):
    """A fused gate and up projection, as Phi-3 and many MoE experts pack them."""

    def __init__(self, dim=8, hidden=12):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def _packed_gate_up():
    m = mesh(2)
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = GatedMLP()
    tp = tpfn.parallelize(clone(ref), m, {"gate_up": colwise(parts=2), "down": rowwise()})
    w = tp.gate_up.weight
    gate, up = ref.gate_up.weight.chunk(2)
    assert torch.equal(w.to_local(), torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]]))
    assert torch.equal(w.full_tensor(), ref.gate_up.weight)
    x = torch.randn(3, 5, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out, expected = tp(x2), ref(x)
    assert rel_err(out, expected) <= TOL
    out.sum().backward(), expected.sum().backward()
    assert rel_err(x2.grad, x.grad) <= TOL
    assert max(max_rel_err(tp, ref, grads=True).values()) <= TOL
    return True


def test_a_packed_projection_gives_each_rank_its_slice_of_every_part(ranks2):
    assert all(ranks2.run(_packed_gate_up))


class Experts(nn.Module):
    """Dense experts weighted by a router: ``sum_e w[t, e] * expert_e(x[t])``."""

    def __init__(self, n=4, dim=8, hidden=6):
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(n, 2 * hidden, dim) / dim**0.5)
        self.down = nn.Parameter(torch.randn(n, dim, hidden) / hidden**0.5)

    def forward(self, x, weights):
        gate, up = torch.einsum("td,ehd->teh", x, self.gate_up).chunk(2, dim=-1)
        y = torch.einsum("teh,edh->ted", F.silu(gate) * up, self.down)
        return torch.einsum("ted,te->td", y, weights)


EXPERTS = (
    params(gate_up=Shard(1, parts=2), down=Shard(2))
    >> on_shards(Replicate(), Replicate(), grads=Partial(), output=Partial())
    >> prepare_out(Replicate())
)


def _experts():
    m = mesh(2)
    torch.manual_seed(0)
    ref = Experts()
    tp = tpfn.parallelize(clone(ref), m, EXPERTS)
    x = torch.randn(5, 8, requires_grad=True)
    weights = torch.softmax(torch.randn(5, 4), -1).requires_grad_()
    x2, w2 = (t.detach().clone().requires_grad_() for t in (x, weights))
    expected = ref(x, weights)
    comm = counts(lambda: tp(x2, w2).pow(2).sum().backward())
    expected.pow(2).sum().backward()
    assert rel_err(tp(x2, w2), expected) <= TOL
    assert rel_err(x2.grad, x.grad) <= TOL and rel_err(w2.grad, weights.grad) <= TOL
    assert max(max_rel_err(tp, ref, grads=True).values()) <= TOL
    return comm


def test_on_shards_runs_a_mixture_of_experts_on_its_shards(ranks2):
    # One all-reduce of the partial output; one each for the two inputs' partial gradients.
    assert ranks2.run(_experts)[0] == {"all_reduce": 3}


class HeadNorm(nn.Module):
    """q, k normalized per head after a column-wise projection (Qwen3's q_norm / k_norm)."""

    def __init__(self, dim=8, heads=4):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.norm = nn.RMSNorm(dim // heads)
        nn.init.normal_(self.norm.weight)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        q = self.q(x)
        q = self.norm(q.view(*q.shape[:-1], -1, self.q.in_features // self.heads))
        return self.o(q.flatten(-2))


def _per_head_norm():
    m = mesh(2)
    torch.manual_seed(0)
    ref = HeadNorm()
    tp = tpfn.parallelize(clone(ref), m, {
        "q": colwise(), "o": rowwise(),
        "norm": replicate() >> on_shards(param_grads={"weight": Partial()}),
    })
    x = torch.randn(2, 3, 8)
    tp(x).sum().backward()
    ref(x).sum().backward()
    assert isinstance(tp.norm.weight, DTensor)
    # Each rank saw its own heads: partial sums, summed at the end of backward.
    assert tp.norm.weight.grad.placements == (TReplicate(),)
    assert rel_err(tp.norm.weight.grad, ref.norm.weight.grad) <= TOL
    assert max(max_rel_err(tp, ref, grads=True).values()) <= TOL
    return True


def test_a_replicated_norm_on_local_heads_sums_its_partial_gradients(ranks2):
    assert all(ranks2.run(_per_head_norm))


def test_prepare_in_before_on_shards_folds_into_its_slot():
    m = mount(prepare_in(Shard(0)) >> on_shards(Replicate(), grads=Partial()), nn.Identity())
    assert m.inputs.slots[0].given == Shard(0) and m.inputs.slots[0].desired == Replicate()


class Gate(nn.Module):
    """Parameters in submodules, one of them tied: ``silu(proj(x)) * again(x)``."""

    def __init__(self):
        super().__init__()
        self.proj, self.again = nn.Linear(8, 12), nn.Linear(8, 12)
        self.again.weight = self.proj.weight

    def forward(self, x):
        return F.silu(self.proj(x)) * self.again(x)


def _submodule_params():
    m = mesh(2)
    torch.manual_seed(0)
    ref = Gate()
    style = (params(**{"proj.weight": Shard(0), "proj.bias": Shard(0), "again.bias": Shard(0)})
             >> on_shards(Replicate(), grads=Partial(), output=Shard(-1))
             >> prepare_out(Replicate()))
    tp = tpfn.parallelize(clone(ref), m, style)
    x = torch.randn(3, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out, expected = tp(x2), ref(x)
    out.pow(2).sum().backward(), expected.pow(2).sum().backward()
    return (rel_err(out, expected) <= TOL, rel_err(x2.grad, x.grad) <= TOL,
            tp.again.weight is tp.proj.weight, isinstance(tp.proj.weight, DTensor),
            max(max_rel_err(tp, ref, grads=True).values()) <= TOL)


def test_on_shards_hands_submodules_their_shards_too(ranks2):
    assert ranks2.run(_submodule_params) == [(True,) * 5] * 2


class Split(nn.Module):
    """Two outputs: the projection and the input it came from."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 12)

    def forward(self, x):
        return self.proj(x), x


def _tuple_outputs():
    m = mesh(2)
    torch.manual_seed(0)
    ref = Split()
    style = (params(**{"proj.weight": Shard(0), "proj.bias": Shard(0)})
             >> on_shards(Replicate(), grads=Partial())
             >> prepare_out(Replicate(), None, given=(Shard(-1), None)))
    tp = tpfn.parallelize(clone(ref), m, style)
    x = torch.randn(3, 8)
    (y, same), (expected, _) = tp(x), ref(x)
    return rel_err(y, expected) <= TOL, same is x


def test_on_shards_outputs_several_tensors_through_prepare_out(ranks2):
    assert ranks2.run(_tuple_outputs) == [(True, True)] * 2


def test_partial_gradients_of_a_parameter_the_style_does_not_place_are_refused():
    # a plain parameter's gradient would stay each rank's terms of the sum: refused by name
    norm = nn.LayerNorm(4)
    with pytest.raises(tpfn.PlanError, match=r"declares the gradient of 'weight' laid out Partial\(\), but the "
                       r"style does not place 'weight', so tpfn would never sum it; place it: "
                       r"params\(weight=Replicate\(\)\) >> on_shards"):
        tpfn.resolve(on_shards(Shard(1), output=Shard(1), param_grads={"weight": Partial()}), norm)
