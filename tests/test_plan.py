"""Plans: values from FQN patterns to styles, resolved purely, with every problem in one error."""

import copy
import functools
import gc
import weakref

import pytest
import torch.nn as nn
from hypothesis import given
from hypothesis import strategies as st

from tests.models import transformer, transformer_plan
from tpfn import (
    PlanError, Replicate, Shard, colwise, plan, prepare_in, prepare_out, resolve, rowwise,
    sequence_parallel,
)
from tpfn.plans.plan import WIDTH, as_plan
from tests.test_style import NAMESPACE, valid_styles


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
    assert info.value.problems == [
        "'w1' is bound to colwise() and to rowwise(); bind it once, or override it: "
        "plan.override({'w1': rowwise()})"]


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
     "plan['w1'] is the string 'colwise', not a tpfn style; a Hugging Face tp_plan (strings such "
     "as 'colwise') converts whole with tpfn.from_hf(tp_plan, model)."),
    ({"w1": colwise}, TypeError, "plan['w1'] is the function colwise, not a style: call it, colwise()."),
    ({"w1": 3}, TypeError,
     "plan['w1'] must be a style (colwise(), rowwise(), prepare_in(...), ...) or a nested plan "
     "(got 3 that is a <class 'int'>)."),
    ({"w1": "colwise", "w2": rowwise(), "w3": colwise}, TypeError,
     "2 plan values are not styles:\n"
     "  - plan['w1'] is the string 'colwise', not a tpfn style; a Hugging Face tp_plan (strings such "
     "as 'colwise') converts whole with tpfn.from_hf(tp_plan, model).\n"
     "  - plan['w3'] is the function colwise, not a style: call it, colwise()."),
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
        "colwise() at 'layers.0.attention_norm' (LayerNorm): it shards nn.Linear, "
        "nn.Embedding, nn.MultiheadAttention, transformers' Conv1D, nn.Conv1d/2d/3d, nn.ConvTranspose1d/2d/3d, nn.BatchNorm1d/2d/3d and nn.GroupNorm, not LayerNorm.",
        "'layers.0.feed_forward.w1' (Linear) is bound to 2 styles ('layers.*.feed_forward.w1' -> "
        "rowwise(); 'layers.0.feed_forward.w1' -> colwise()); bind it once, e.g. by combining "
        "them with >> or narrowing a pattern.",
        "colwise() at 'layers.1.attention_norm' (LayerNorm): it shards nn.Linear, "
        "nn.Embedding, nn.MultiheadAttention, transformers' Conv1D, nn.Conv1d/2d/3d, nn.ConvTranspose1d/2d/3d, nn.BatchNorm1d/2d/3d and nn.GroupNorm, not LayerNorm.",
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



def _partial_forward(m):  # a forward set on the instance, as accelerate's hooks install it
    m.forward = functools.update_wrapper(functools.partial(type(m).forward, m), type(m).forward)


def _closure_forward(m):  # a wrapper closure over the module, as other libraries install it
    old = m.forward

    @functools.wraps(old)
    def forward(*args, **kwargs):
        return old(*args, **kwargs)
    m.forward = forward


@pytest.mark.parametrize("wrap", [_partial_forward, _closure_forward])
def test_resolving_a_plan_keeps_no_module_alive(wrap):
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    for m in model:
        wrap(m)
    assert len(resolve({"0": colwise(), "1": rowwise()}, model)) == 2
    refs = [weakref.ref(m) for m in (model, *model)]
    del model, m
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)


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
        plan({"0": ColwiseParallel()})
    with pytest.raises(PlanError, match=r"plan\['0'\] is PyTorch's ColwiseParallel\(\.\.\.\), not a "
                                        r"tpfn style; convert the whole plan with tpfn.from_torch"):
        resolve({"0": ColwiseParallel()}, nn.Sequential(nn.Linear(2, 2)))  # one problem among the plan's


# Patterns as plans have them: "" (the module itself) or dotted names, globs, layer stars.
names = st.sampled_from(["layers", "*", "0", "attention", "w[qkv]", "mlp", "*_proj", "lm_head",
                         "model", "self_attn", "q_proj"])
patterns = st.one_of(st.just(""), st.lists(names, min_size=1, max_size=5).map(".".join))
plans = st.dictionaries(patterns, valid_styles, max_size=12).map(plan)


@given(plans)
def test_a_plan_prints_as_the_code_that_builds_it_on_one_line_or_one_rule_per_line(p):
    text = repr(p)
    assert eval(text, NAMESPACE) == p
    one_line = f"plan({dict(p.rules)!r})"
    if len(one_line) <= WIDTH:
        assert text == one_line
    else:
        lines = text.split("\n")
        assert lines[0] == "plan({" and lines[-1] == "})" and len(lines) == len(p.rules) + 2
        assert lines[1:-1] == [f"    {pattern!r}: {style!r}," for pattern, style in p.rules]


def test_a_long_plan_reads_as_a_list_and_a_short_one_stays_on_one_line():
    short = plan({"w1": colwise(), "w2": prepare_in(Shard(-1)) >> rowwise() >> prepare_out(Shard(1))})
    assert repr(short) == ("plan({'w1': colwise(), 'w2': prepare_in(Shard(dim=-1)) >> rowwise() "
                           ">> prepare_out(Shard(dim=1))})")
    assert repr(plan({})) == "plan({})"
    assert repr(plan(transformer_plan(sp=False))) == """plan({
    'layers.*.attention': prepare_in(Replicate(), local=True),
    'layers.*.attention.w[qkv]': colwise(),
    'layers.*.attention.wo': rowwise(),
    'layers.*.feed_forward.w1': colwise(),
    'layers.*.feed_forward.w2': rowwise(),
    'output': colwise() >> prepare_out(Replicate()),
    'pos_embeddings': rowwise(),
    'tok_embeddings': rowwise(),
})"""


def test_override_replaces_the_rules_of_its_patterns_and_adds_the_others():
    p = plan({"w1": colwise(), "w2": rowwise(), "w3": colwise()})
    assert p.override({"w2": colwise(local=False), "w4": rowwise()}) == plan({
        "w1": colwise(), "w2": colwise(local=False), "w3": colwise(), "w4": rowwise()})
    assert p.override(plan({"w1": rowwise()})) == plan({"w1": rowwise(), "w2": rowwise(),
                                                       "w3": colwise()})
    assert p.override({"mlp": {"w1": rowwise()}}) == p | {"mlp.w1": rowwise()}   # nested
    assert p.override(prepare_in(Replicate())) == p | {"": prepare_in(Replicate())}
    assert p.override({}) == p and p.override(p) == p
    assert p == plan({"w1": colwise(), "w2": rowwise(), "w3": colwise()})        # unchanged
    # Where | would succeed, override is the same merge.
    assert p.override({"w1": colwise(), "w5": rowwise()}) == p | {"w5": rowwise()}


def test_override_replaces_exact_patterns_only():
    """``layers.0.mlp`` beside ``layers.*.mlp`` is a second rule; resolve then reports the
    module bound twice, as it would for any plan."""
    p = plan({"layers.*.feed_forward.w1": colwise()})
    q = p.override({"layers.0.feed_forward.w1": rowwise()})
    assert len(q.rules) == 2
    with pytest.raises(PlanError, match="bound to 2 styles"):
        resolve(q, transformer(n_layers=1))


def test_without_removes_rules():
    p = plan({"w1": colwise(), "w2": rowwise(), "w3": colwise()})
    assert p.without("w2") == plan({"w1": colwise(), "w3": colwise()})
    assert p.without("w1", "w3") == plan({"w2": rowwise()})
    assert p.without() == p and p.without("w1", "w2", "w3") == plan({})


def test_without_an_unknown_pattern_names_the_near_misses():
    p = plan({"lm_head": colwise(), "model.layers.*.mlp.up_proj": colwise()})
    with pytest.raises(ValueError) as info:
        p.without("lm_haed", "layers.*.mlp.up_proj", "norm", "lm_head")
    assert str(info.value) == (
        "plan.without('lm_haed', 'layers.*.mlp.up_proj', 'norm', 'lm_head'): "
        "no rule has the pattern 'lm_haed' (did you mean 'lm_head'?); "
        "no rule has the pattern 'layers.*.mlp.up_proj' (did you mean "
        "'model.layers.*.mlp.up_proj'?); "
        "no rule has the pattern 'norm' (its patterns: 'lm_head', 'model.layers.*.mlp.up_proj'); "
        "give each pattern exactly as the plan has it (print(plan) lists them).")
    with pytest.raises(ValueError, match=r"no rule has the pattern 'w1' \(it has none\)"):
        plan({}).without("w1")
    with pytest.raises(TypeError, match="plan keys must be module FQN patterns"):
        p.without(1)


def test_a_conflict_names_override_with_the_right_hand_rule():
    p = plan({"lm_head": colwise() >> prepare_out(Replicate()), "w": rowwise()})
    with pytest.raises(PlanError) as info:
        p | {"lm_head": colwise(local=False), "w": colwise()}
    assert info.value.problems == [
        "'lm_head' is bound to colwise() >> prepare_out(Replicate()) and to colwise(local=False); "
        "bind it once, or override it: plan.override({'lm_head': colwise(local=False)})",
        "'w' is bound to rowwise() and to colwise(); bind it once, or override it: "
        "plan.override({'w': colwise()})",
    ]
    with pytest.raises(PlanError, match=r"override it: plan.override\(\{'w': rowwise\(\)\}\)$"):
        {"w": colwise()} | p
    fixed = p.override({"lm_head": colwise(local=False), "w": colwise()})
    assert dict(fixed.rules)["lm_head"] == colwise(local=False)
    # Within one plan, a nested rule and a flat one of the same pattern: bind it once.
    with pytest.raises(PlanError) as info:
        plan({"mlp": {"w1": colwise()}, "mlp.w1": rowwise()})
    assert info.value.problems == ["'mlp.w1' is bound to colwise() and to rowwise()"]


notes = st.dictionaries(st.one_of(st.none(), patterns),
                        st.text(st.characters(codec="ascii", exclude_categories=("Cc",)), min_size=1,
                                max_size=300).filter(str.strip), max_size=4)


@given(plans, notes)
def test_notes_print_as_comments_and_are_no_part_of_the_value(p, said):
    noted = p.noted(said)
    assert noted == p and hash(noted) == hash(p)
    text = repr(noted)
    assert eval(text, NAMESPACE) == p
    if said:
        assert text.startswith("plan({\n") and text.endswith("})")
        assert all(len(line) <= 100 for line in text.splitlines() if line.lstrip().startswith("#"))


def test_a_note_prints_above_its_rule_and_a_note_without_a_rule_after_the_rules():
    p = plan({"mlp.up": colwise(), "mlp.down": rowwise()}, notes={
        None: "why the plan is what it is", "mlp.up": "64 features\nof 2 parts", "norm": "replicated"})
    assert repr(p) == """plan({
    # why the plan is what it is
    'mlp.down': rowwise(),
    # 64 features
    # of 2 parts
    'mlp.up': colwise(),
    # 'norm': replicated
})"""
    assert (p | {"w": colwise()}).notes == p.notes
    assert dict(p.override(plan({"mlp.up": rowwise()}, notes={"mlp.up": "now"})).notes)["mlp.up"] == "now"
    assert "mlp.up" not in dict(p.without("mlp.up").notes)
    assert dict(p.under("block").notes) == {None: "why the plan is what it is",
                                            "block.mlp.up": "64 features\nof 2 parts",
                                            "block.norm": "replicated"}
    with pytest.raises(TypeError, match=r"plan notes\['w'\] must be a non-empty str"):
        plan({"w": colwise()}, notes={"w": ""})
