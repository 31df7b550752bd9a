"""Plans: values from FQN patterns to styles, resolved purely, with every problem in one error."""

import copy

import pytest
import torch.nn as nn
from hypothesis import given
from hypothesis import strategies as st

from tests.models import transformer, transformer_plan
from tpfn import (
    PlanError, Replicate, colwise, plan, prepare_in, prepare_out, resolve, rowwise,
    sequence_parallel,
)
from tpfn.plans.plan import as_plan


def test_a_plan_is_a_value():
    p = plan({"w1": colwise(), "w2": rowwise()})
    assert p == plan({"w2": rowwise(), "w1": colwise()}) and hash(p) == hash(plan(dict(p.rules)))
    assert repr(p) == "plan({'w1': colwise(), 'w2': rowwise()})"
    assert as_plan({"w1": colwise()}) == plan({"w1": colwise()})
    assert as_plan(colwise()) == plan({"": colwise()})


def test_nesting_and_merging():
    mlp = plan({"w1": colwise(), "w2": rowwise()})
    assert mlp.under("layers.*.mlp") == plan({"layers.*.mlp.w1": colwise(), "layers.*.mlp.w2": rowwise()})
    assert plan({"layers.*": {"mlp": mlp, "": prepare_in(Replicate())}}) == plan({
        "layers.*": prepare_in(Replicate()),
        "layers.*.mlp.w1": colwise(), "layers.*.mlp.w2": rowwise()})
    assert (mlp | {"w1": colwise(), "w3": colwise()}) == plan({
        "w1": colwise(), "w2": rowwise(), "w3": colwise()})
    assert ({"w3": colwise()} | mlp) == plan({"w1": colwise(), "w2": rowwise(), "w3": colwise()})
    with pytest.raises(PlanError) as info:
        mlp | plan({"w1": rowwise()})
    assert info.value.problems == ["'w1' is bound to colwise() and to rowwise()"]


@pytest.mark.parametrize("bad, error, message", [
    ({1: colwise()}, TypeError,
     "plan keys must be module FQN patterns (str), e.g. 'layers.*.attention.wq' "
     "(got 1 that is a <class 'int'>)."),
    ({("a", "b"): colwise()}, TypeError,
     "plan keys must be module FQN patterns (str), e.g. 'layers.*.attention.wq' "
     "(got ('a', 'b') that is a <class 'tuple'>)."),
    ({"layers..w1": colwise()}, ValueError,
     "plan key 'layers..w1' has an empty name component; write e.g. 'layers.*.w1'."),
    ({"w1": "colwise"}, TypeError,
     "plan['w1'] must be a style (colwise(), rowwise(), prepare_in(...), ...) or a nested plan "
     "(got 'colwise' that is a <class 'str'>)."),
    (["w1"], TypeError, "a plan is built from a dict of pattern -> style (got ['w1'])."),
])
def test_malformed_plans_are_rejected_when_built(bad, error, message):
    with pytest.raises(error) as info:
        plan(bad)
    assert str(info.value) == message


def test_star_matches_one_name_component():
    model = transformer(n_layers=2)
    fqns = [b.fqn for b in resolve({"layers.*.attention.w[qk]": colwise()}, model)]
    assert fqns == ["layers.0.attention.wq", "layers.0.attention.wk",
                    "layers.1.attention.wq", "layers.1.attention.wk"]
    assert [(m.fqn, m.style) for m in resolve({"": prepare_in(Replicate())}, model)] == [
        ("", prepare_in(Replicate()))]
    with pytest.raises(PlanError, match="'layers.\\*' -> colwise\\(\\) matches no module"):
        resolve({"layers.*": colwise(), "*": colwise()}, nn.Sequential(nn.Linear(2, 2)))


def test_every_problem_is_reported_at_once_with_near_misses():
    model = transformer(n_layers=2)
    bad = {
        "layers.*.atention.wq": colwise(),              # a typo
        "layers.*.attention_norm": colwise(),           # a kind colwise cannot take
        "layers.0.feed_forward.w1": colwise(),
        "layers.*.feed_forward.w1": rowwise(),          # two styles on layers.0...w1
        "norm": sequence_parallel() >> prepare_out(Replicate()),
    }
    with pytest.raises(PlanError) as info:
        resolve(bad, model)
    assert info.value.problems == [
        "'layers.*.atention.wq' -> colwise() matches no module; did you mean "
        "'layers.*.attention.wq' or 'layers.*.attention.wv' or 'layers.*.attention.wo'?",
        "colwise() at 'layers.0.attention_norm' (LayerNorm): it shards nn.Linear and "
        "nn.Embedding, not LayerNorm.",
        "'layers.0.feed_forward.w1' (Linear) is bound to 2 styles ('layers.*.feed_forward.w1' -> "
        "rowwise(); 'layers.0.feed_forward.w1' -> colwise()); bind it once, e.g. by combining "
        "them with >> or narrowing a pattern.",
        "colwise() at 'layers.1.attention_norm' (LayerNorm): it shards nn.Linear and "
        "nn.Embedding, not LayerNorm.",
    ]
    assert str(info.value).startswith("the plan cannot be applied (4 problems):\n  - ")


def test_one_style_reached_by_two_patterns_binds_once():
    model = transformer(n_layers=1)
    assert len(resolve({"layers.0.attention.wq": colwise(), "layers.*.attention.wq": colwise()},
                       model)) == 1


def test_resolution_is_pure():
    model = transformer(n_layers=2)
    before = copy.deepcopy(model.state_dict())
    hooks = [len(m._forward_pre_hooks) for m in model.modules()]
    p = plan(transformer_plan(sp=True))
    resolve(p, model)
    assert all(v.equal(before[k]) for k, v in model.state_dict().items())
    assert hooks == [len(m._forward_pre_hooks) for m in model.modules()]
    assert p == plan(transformer_plan(sp=True))


@given(st.permutations(sorted(transformer_plan(sp=True).items())))
def test_resolution_does_not_depend_on_dict_order(items):
    model = transformer(n_layers=2)
    assert resolve(dict(items), model) == resolve(transformer_plan(sp=True), model)


def test_bindings_follow_module_order():
    model = transformer(n_layers=1)
    fqns = [b.fqn for b in resolve(transformer_plan(sp=False), model)]
    assert fqns == ["tok_embeddings", "pos_embeddings", "layers.0.attention", "layers.0.attention.wq",
                    "layers.0.attention.wk", "layers.0.attention.wv", "layers.0.attention.wo",
                    "layers.0.feed_forward.w1", "layers.0.feed_forward.w2", "output"]
    assert dict((b.fqn, b.style) for b in resolve(transformer_plan(sp=False), model))["output"] == \
        colwise() >> prepare_out(Replicate())


def test_a_plan_for_the_model_around_this_one_says_which_prefix_to_drop():
    """A ``...ForCausalLM`` plan on its ``.model``: one problem naming the prefix, not one per
    rule; a rule that matches nothing for another reason keeps its own."""
    inner = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(PlanError) as info:
        resolve({"model.0": colwise(), "model.1": rowwise(), "lm_head": colwise()}, inner)
    assert info.value.problems[0].startswith("'lm_head' -> colwise() matches no module")
    assert info.value.problems[1] == (
        "2 patterns start with 'model.', which this module does not have, and match once it is "
        "dropped: the plan is for a model that holds this one as 'model'; pass that model, or "
        "the plan's rules under 'model.' (e.g. '0').")
    assert len(info.value.problems) == 2


def test_a_pytorch_style_in_a_plan_names_from_torch():
    from torch.distributed.tensor.parallel import ColwiseParallel

    with pytest.raises(TypeError, match=r"plan\['0'\] is PyTorch's ColwiseParallel\(\.\.\.\), not a "
                                        r"tpfn style; convert the whole plan with tpfn.from_torch"):
        resolve({"0": ColwiseParallel()}, nn.Sequential(nn.Linear(2, 2)))
