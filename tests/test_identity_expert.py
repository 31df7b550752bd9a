"""A replica handed on as one of n equal terms of a sum, its gradient too: identity experts
inside experts whose outputs are partial sums (``moe_identity_expert``)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor.debug import CommDebugMode

import tpfn
from tests.models import clone, rel_err
from tests.ranks import mesh
from tpfn import Partial, PlanError, Replicate, Shard, on_shards, params, prepare_in, prepare_out

# float64 against one device: rounding ~1e-16 relative, summed over 2 ranks.
TOL = 1e-12


class Experts(nn.Module):
    """A routed expert and an identity expert (LongCat-Flash's zero-compute experts), mixed
    by routing weights: ``x`` and ``weights`` replicated, the expert sharded on its hidden dim."""

    def __init__(self, dim=8, hidden=16):
        super().__init__()
        self.up = nn.Parameter(torch.randn(hidden, dim) / dim**0.5)
        self.down = nn.Parameter(torch.randn(dim, hidden) / hidden**0.5)
        self.identity_expert = nn.Identity()

    def forward(self, x, weights):
        routed = torch.relu(x @ self.up.T) @ self.down.T
        return routed * weights[:, :1] + self.identity_expert(x) * weights[:, 1:]


TERMS = prepare_in(Replicate(), desired=Partial(), grads=Partial(), local=True)
PLAN = {
    "": params(up=Shard(0), down=Shard(1))
    >> on_shards(Replicate(), Replicate(), grads=Partial(), output=Partial())
    >> prepare_out(Replicate()),
    "identity_expert": TERMS,
}


def _run(plan):
    torch.manual_seed(0)
    ref = Experts().double()
    tp = tpfn.parallelize(clone(ref), mesh(2), plan)
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    w = torch.rand(6, 2, dtype=torch.float64, requires_grad=True)
    x2, w2 = (t.detach().clone().requires_grad_() for t in (x, w))
    expected = ref(x, w)
    expected.pow(2).sum().backward()
    with CommDebugMode() as forward:
        y = tp(x2, w2)
    with CommDebugMode() as backward:
        y.pow(2).sum().backward()
    grads = {"x": rel_err(x2.grad, x.grad), "weights": rel_err(w2.grad, w.grad),
             **{n: rel_err(p.grad, ref.get_parameter(n).grad) for n, p in tp.named_parameters()}}
    return (rel_err(y, expected), grads, tpfn.trace.counts(forward), tpfn.trace.counts(backward))


def _identity_experts_at_parity():
    return _run(PLAN)


def _whole_gradient_counted_twice():
    return _run({**PLAN, "identity_expert": prepare_in(Replicate(), desired=Partial(), local=True)})


def test_identity_experts_are_terms_both_ways_at_parity_with_one_device(ranks2):
    for out, grads, forward, backward in ranks2.run(_identity_experts_at_parity):
        assert out < TOL and max(grads.values()) < TOL, (out, grads)
        assert forward == {"all_reduce": 1}  # the experts' partial outputs, summed once
        assert backward == {"all_reduce": 2}  # the partial gradients of x and of the weights


def test_a_split_without_grads_hands_back_the_whole_gradient(ranks2):
    # DTensor's Replicate -> Partial: the value is one term, but its gradient comes back whole,
    # which the experts' partial input gradient then counts on each rank.
    for out, grads, _, _ in ranks2.run(_whole_gradient_counted_twice):
        assert out < TOL and grads["up"] < TOL and grads["x"] > 1e-2


def _terms_moves_nothing_else():
    torch.manual_seed(0)
    lone = tpfn.parallelize(nn.Identity(), mesh(2), TERMS)
    x = torch.randn(4, requires_grad=True)
    with CommDebugMode() as mode:
        y = lone(x)
        y.backward(torch.ones(4))
    return torch.allclose(y, x / 2), torch.allclose(x.grad, torch.full((4,), 0.5)), \
        tpfn.trace.counts(mode), dist.get_rank()


def test_terms_divide_the_value_and_the_gradient_locally(ranks2):
    for value, grad, counts, _ in ranks2.run(_terms_moves_nothing_else):
        assert value and grad and counts == {}


@pytest.mark.parametrize("kwargs, where", [
    (dict(grads=Partial()), "local=None"),
    (dict(grads=Partial(), local=False), "local=False"),
    (dict(grads=Replicate(), local=True), "grads=Replicate()"),
])
def test_grads_hand_back_terms_only_for_a_local_replica(kwargs, where):
    with pytest.raises(TypeError, match=r"^prepare_in: 'grads' hands the gradient of a replicated "
                       rf"local input back as terms of a sum: .*{where.replace('(', '.').replace(')', '.')}"):
        prepare_in(Replicate(), desired=Partial(), **kwargs)
    with pytest.raises(TypeError, match=r"input 0 is given Shard\(dim=0\)"):
        prepare_in(Shard(0), desired=Partial(), grads=Partial(), local=True)


def test_grads_are_declared_on_the_first_prepare_in_of_a_chain():
    assert repr(TERMS) == "prepare_in(Replicate(), desired=Partial(), grads=Partial(), local=True)"
    with pytest.raises(tpfn.StyleError, match="declare grads= on the first prepare_in"):
        prepare_in(Replicate()) >> TERMS


def test_from_hf_reads_moe_identity_expert_inside_moe_tp_experts_only():
    model = nn.ModuleDict({"experts": Experts()})
    strings = {"experts": "moe_tp_experts", "experts.identity_expert": "moe_identity_expert"}
    rules = dict(tpfn.from_hf(strings, model).rules)
    assert rules["experts.identity_expert"] == TERMS
    with pytest.raises(PlanError, match=r"'experts.identity_expert' is 'moe_identity_expert', .* "
                       r"its module 'experts' is not in the plan\. Key it 'moe_tp_experts'\."):
        tpfn.from_hf({"experts.identity_expert": "moe_identity_expert"}, model)
