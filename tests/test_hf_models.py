"""transformers' architectures on 2 ranks: one per family of plans, each a tiny model built
from its config, parallelized from its own ``tp_plan`` by ``tpfn.from_hf`` and by
transformers' own tensor parallelism, output and every gradient against one device
(``tests/hf_zoo.py``). All of them run in one call to the session's ranks.

The sweep over every architecture is ``python tools/hf_sweep.py``; its table is the one in
docs/huggingface.md, and the rows of the families here must say what this run measures.
"""

import pathlib

import pytest

import tpfn
from tests import hf_zoo

# One architecture per family, for what it adds, and whether tpfn is at parity on it.
FAMILIES = {
    "llama": ("colwise and rowwise projections, a vocabulary-parallel embedding", True),
    "qwen3": ("per-head norms: replicated_with_grad_allreduce", True),
    "gemma3_text": ("a scaled embedding with its own forward, a tied head", True),
    "cohere": ("a tied head under transformers' own TP (weights tied after the plan)", True),
    "phi3": ("fused qkv and gate_up, gathered: colwise_gather_output, rowwise_split_input", True),
    "gpt_neox": ("embedding_rowwise keyed in the plan, a parallel residual", True),
    "olmo2": ("q and k norms over all heads: colwise_gather_output into them", True),
    "mixtral": ("experts: packed_colwise, rowwise, moe_tp_experts", True),
    "qwen3_moe": ("experts and per-head norms", True),
    "deepseek_v3": ("latent attention outside the plan, shared experts, grouped routing", True),
    "minicpm3": ("latent attention: mla_kv_a_proj", True),
    "deepseek_v2": ("latent attention and experts", True),
    "granite_swa": ("attention sinks: local_params", True),
    "qwen4_exp_text": ("embedding_colwise, an indexed attention", True),
    "llama4_text": ("packed_rowwise experts; transformers' own TP fails on it", True),
    "jamba": ("a hybrid of Mamba and attention layers, experts", True),
    "qwen3_next": ("linear attention layers beside full ones", True),
    "gpt_oss": ("only the embedding in its plan, experts with biases", True),
    "deepseek_v4": ("hyper-connections whose float32 gradients are ill-conditioned", True),
    "apertus": ("a plan that lacks a rule: an activation's parameters between colwise and "
                "rowwise", False),
    "sarvam_moe": ("a plan that lacks a rule: per-head norms left out", False),
    "longcat_flash": ("moe_identity_expert: identity experts as terms of the experts' sum", True),
    "esmc": ("norms over all features of a colwise projection: wrong in transformers too", False),
    "gemma4_vision": ("a vision encoder: no token ids", None),
}
DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "huggingface.md"


@pytest.fixture(scope="module")
def sweep(ranks2):
    found = ranks2.run(hf_zoo.outcomes, list(FAMILIES))[0]
    return {f["name"]: f for f in found}


def test_every_family_builds_or_is_skipped_with_its_reason(sweep):
    skipped = {name: f["skip"] for name, f in sweep.items() if f["skip"]}
    assert skipped == {"gemma4_vision": "takes pixel_values, pixel_position_ids, not token ids "
                                        "(a vision or audio encoder)"}


def test_tpfn_is_at_parity_on_each_family_it_expects(sweep):
    found = {name: hf_zoo.at_parity(f.get("tpfn"), hf_zoo.tolerance(f)) for name, f in sweep.items()}
    expected = {name: bool(ok) for name, (_, ok) in FAMILIES.items()}
    assert found == expected, {n: hf_zoo.worst(sweep[n]["tpfn"]) for n in found
                               if found[n] != expected[n]}


def test_tpfn_is_at_parity_wherever_transformers_own_tp_is(sweep):
    theirs = [n for n, f in sweep.items() if hf_zoo.at_parity(f.get("hf"), hf_zoo.tolerance(f))]
    behind = [n for n in theirs if not hf_zoo.at_parity(sweep[n]["tpfn"], hf_zoo.tolerance(sweep[n]))]
    assert behind == []
    assert {"llama4_text"} <= {n for n, f in sweep.items()
                              if not f["skip"] and not hf_zoo.at_parity(f["hf"])} - set(behind)


def test_a_plan_that_lacks_a_rule_is_found_by_its_gradients_and_at_parity_with_it(sweep):
    for name, module in (("apertus", "model.layers.*.mlp.act_fn"),
                         ("sarvam_moe", "model.layers.*.self_attn.k_norm")):
        mine, theirs = sweep[name]["tpfn"], sweep[name]["hf"]
        assert mine["partial"] and not hf_zoo.at_parity(theirs)  # wrong in transformers too
        assert module in mine["fixed"]["rules"] and hf_zoo.at_parity(mine["fixed"]), name


def test_moe_identity_expert_hands_its_input_on_as_terms():
    model, _ = hf_zoo.build("longcat_flash")
    rules = dict(tpfn.from_hf(model.tp_plan, model).rules)
    assert repr(rules["model.layers.*.mlp.experts.identity_expert"]) == (
        "prepare_in(Replicate(), desired=Partial(), grads=Partial(), local=True)")


def test_an_ill_conditioned_model_is_held_to_its_own_rounding(sweep):
    found = sweep["deepseek_v4"]
    assert found["rounding"] is not None and hf_zoo.tolerance(found) < 1e-2
    assert hf_zoo.at_parity(found["tpfn"], hf_zoo.tolerance(found))


def test_the_docs_table_says_what_the_sweep_measures(sweep):
    rows = hf_zoo.rows(DOC, "architectures")
    assert set(rows) == set(hf_zoo.architectures())
    for name, found in sweep.items():
        assert tuple(rows[name][:3]) == hf_zoo.row(found)[1:4], name
