"""``from_hf``: transformers' plan strings as tpfn styles, on real tiny transformers models."""

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate as TReplicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import (
    Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MixtralConfig,
    MixtralForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM,
)
from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

import tpfn
from tests import hf_zoo
from tests.models import clone, counts, max_rel_err, rel_err
from tests.ranks import mesh
from tpfn import (
    Partial, PlanError, Replicate, Shard, colwise, from_hf, on_shards, params, per_rank,
    prepare_in, prepare_out, replicate, rowwise, sequence_parallel,
)
from tpfn.adapters.from_hf import KNOWN, UNSUPPORTED

TOL = 1e-5
# How often a backward may reduce the partial gradients of replicated parameters (the
# per-head norms) itself, rather than leaving them partial: tpfn's policy, not from_hf's.
PARTIAL_GRADS = 1
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.1,
            use_cache=False)
MOE = dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)


def llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY))


def qwen3():
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**TINY))


def qwen3_moe(**kw):
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY, **MOE, **kw))


def mixtral():
    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(**{**TINY, "intermediate_size": 16},
                                            num_local_experts=4, num_experts_per_tok=2))


def gemma3():
    torch.manual_seed(0)
    return Gemma3ForCausalLM(Gemma3TextConfig(**TINY))


# transformers' plan strings as PyTorch styles: what native TP runs for the same plan.
NATIVE = {
    "colwise": ColwiseParallel(),
    "rowwise": RowwiseParallel(),
    "colwise_gather_output": ColwiseParallel(output_layouts=TReplicate()),
    "embedding_rowwise": RowwiseParallel(input_layouts=TReplicate()),
}


def _matches_single_device(build, **kw):
    """tpfn on 2 ranks with from_hf's plan against one device: logits, every gradient, and
    the collectives of the forward and of the backward."""
    m = mesh(2)
    ref = build(**kw)
    tp = tpfn.parallelize(clone(ref), m, from_hf(ref.tp_plan, ref))
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (2, 8))
    expected = ref(ids).logits
    out = {}
    forward = counts(lambda: out.setdefault("logits", tp(ids).logits))
    backward = counts(lambda: out["logits"].pow(2).sum().backward())
    expected.pow(2).sum().backward()
    assert not isinstance(out["logits"], DTensor) and rel_err(out["logits"], expected) <= TOL
    errors = max_rel_err(tp, ref, grads=True)
    assert max(errors.values()) <= TOL, errors
    return forward, backward, tp


def _llama():
    forward, backward, _ = _matches_single_device(llama)
    nat = parallelize_module(llama(), mesh(2), {k: NATIVE[v] for k, v in llama().tp_plan.items()})
    ids = torch.randint(0, 64, (2, 8))
    out = {}
    native = (counts(lambda: out.setdefault("logits", nat(ids).logits)),
              counts(lambda: out["logits"].pow(2).sum().backward()))
    return (forward, backward), native


def test_llama_matches_single_device_with_the_megatron_minimum(ranks2):
    mine, native = ranks2.run(_llama)[0]
    layers = TINY["num_hidden_layers"]
    # Forward: o_proj and down_proj per layer, the vocab-parallel embedding, the gathered head.
    assert mine[0] == native[0] == {"all_reduce": 2 * layers + 1, "all_gather": 1}
    # Backward: q, k, v share one input-gradient all-reduce, gate and up another (and the
    # head's input); PyTorch's native TP on transformers' plan all-reduces each of the five.
    assert mine[1] == {"all_reduce": 2 * layers + 1}
    assert native[1] == {"all_reduce": 5 * layers + 1}
    mine_total, native_total = (sum(c.get("all_reduce", 0) for c in run) for run in (mine, native))
    assert (mine_total, native_total) == (4 * layers + 2, 7 * layers + 2)  # + embedding, head


def _qwen3():
    forward, backward, _ = _matches_single_device(qwen3)
    return forward, backward


def test_qwen3_per_head_norms_sum_their_gradients(ranks2):
    forward, backward = ranks2.run(_qwen3)[0]
    # q_norm / k_norm see their rank's heads: their partial gradients add up to the
    # single-device ones (above), and the block still costs 4 all-reduces.
    assert forward == {"all_reduce": 5, "all_gather": 1}
    assert set(backward) == {"all_reduce"} and backward["all_reduce"] <= 5 + PARTIAL_GRADS


def _qwen3_moe():
    rank = dist.get_rank()
    forward, backward, tp = _matches_single_device(qwen3_moe, mlp_only_layers=[0])
    ref = qwen3_moe(mlp_only_layers=[0])
    gate, up = ref.model.layers[1].mlp.experts.gate_up_proj.chunk(2, dim=1)
    local = tp.model.layers[1].mlp.experts.gate_up_proj.to_local()
    sliced = torch.equal(local, torch.cat([gate.chunk(2, dim=1)[rank], up.chunk(2, dim=1)[rank]], 1))
    return forward, backward, sliced


def test_qwen3_moe_experts_get_a_slice_of_every_part(ranks2):
    forward, backward, sliced = ranks2.run(_qwen3_moe)[0]
    assert sliced  # each rank holds its slice of the gate and of the up projection
    # Layer 0 is dense (4 all-reduces); layer 1's experts sum their partial output forward
    # and their two inputs' partial gradients backward.
    assert forward == {"all_reduce": 2 + 2 + 1, "all_gather": 1}
    assert set(backward) == {"all_reduce"} and backward["all_reduce"] <= 2 + 3 + 1 + PARTIAL_GRADS


def _mixtral():
    forward, backward, _ = _matches_single_device(mixtral)
    return forward, backward


def test_mixtral_matches_single_device(ranks2):
    forward, backward = ranks2.run(_mixtral)[0]
    assert forward == {"all_reduce": 2 * 2 + 1, "all_gather": 1}
    assert backward == {"all_reduce": 2 * 3 + 1}


def _gemma3():
    forward, backward, tp = _matches_single_device(gemma3)
    return forward, backward, tp.lm_head.weight is tp.model.embed_tokens.weight


def test_gemma3_scaled_embedding_and_tied_head_match_single_device(ranks2):
    forward, backward, tied = ranks2.run(_gemma3)[0]
    assert tied
    assert forward == {"all_reduce": 5, "all_gather": 1}
    assert set(backward) == {"all_reduce"} and backward["all_reduce"] <= 5 + PARTIAL_GRADS


def test_qwen3_moe_plan_shards_experts_and_skips_what_a_variant_lacks():
    mixed = from_hf(qwen3_moe(mlp_only_layers=[0]).tp_plan, qwen3_moe(mlp_only_layers=[0]))
    rules = dict(mixed.rules)
    assert rules["model.layers.*.mlp.experts"] == (
        params(gate_up_proj=Shard(1, parts=2), down_proj=Shard(2))
        >> on_shards(Replicate(), None, Replicate(), grads=Partial(), output=Partial())
        >> prepare_out(Replicate()))
    assert rules["model.layers.*.self_attn.q_norm"] == (
        replicate() >> on_shards(param_grads={"weight": Partial()}))
    # Only layer 0's MLP has gate and up projections to share an input gradient.
    assert rules["model.layers.0.mlp"] == prepare_in(Replicate(), local=True)
    assert "model.layers.*.mlp" not in rules
    # Every layer sparse: the model's own rules for dense MLPs name nothing and are skipped.
    sparse = qwen3_moe()
    assert not any("gate_proj" in key for key, _ in from_hf(sparse.tp_plan, sparse).rules)


def test_every_registered_transformers_style_is_known():
    assert set(ALL_PARALLEL_STYLES) <= set(KNOWN)
    older = {"gather", "local", "local_colwise", "local_rowwise", "local_packed_rowwise",
             "colwise_rep", "rowwise_rep", "sequence_parallel", "replicate", "embedding_rowwise"}
    assert older <= set(KNOWN)


class Experts(nn.Module):
    """Experts as transformers stores them: 3-D weights, routed inputs."""

    def __init__(self, n=4, dim=8, hidden=6, transposed=False):
        super().__init__()
        shape = (n, dim, 2 * hidden) if transposed else (n, 2 * hidden, dim)
        self.gate_up_proj = nn.Parameter(torch.randn(*shape))
        self.down_proj = nn.Parameter(torch.randn(*((n, hidden, dim) if transposed else (n, dim, hidden))))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return hidden_states


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(8, 8), nn.Linear(8, 8)
        self.o_proj = nn.Linear(8, 8)
        self.sinks = nn.Parameter(torch.zeros(4))
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.o_proj(self.q_proj(x) * self.k_proj(x))


class ScaledEmbedding(nn.Embedding):
    def forward(self, ids):
        return super().forward(ids) * 2.0


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention()
        self.scaled = ScaledEmbedding(10, 8)
        self.experts = Experts()
        self.old = Experts(transposed=True)
        self.embed = nn.Embedding(10, 8)
        self.mlp = nn.ModuleDict({"fc": nn.Linear(8, 8)})


def _style(string, fqn):
    return dict(from_hf({fqn: string}, Block()).rules)[fqn]


@pytest.mark.parametrize("string, fqn, style", [
    ("colwise", "attn.q_proj", colwise()),
    ("colwise_gather_output", "attn.q_proj", colwise() >> prepare_out(Replicate())),
    ("colwise_rep", "attn.q_proj", colwise() >> prepare_out(Replicate())),
    ("rowwise", "attn.o_proj", rowwise()),
    ("rowwise_split_input", "attn.o_proj", prepare_in(Replicate()) >> rowwise()),
    ("rowwise_rep", "attn.o_proj", prepare_in(Replicate()) >> rowwise()),
    ("embedding_rowwise", "embed", rowwise()),
    ("embedding_rowwise", "scaled",  # its own forward computes on DTensors (Gemma's)
     prepare_in(Replicate()) >> params(weight=Shard(0)) >> prepare_out(Replicate())),
    ("embedding_colwise", "embed", colwise() >> prepare_out(Replicate())),
    ("packed_colwise", "attn.q_proj", colwise(parts=2)),
    # transformers places the parameters and adds nothing: the module computes on DTensors
    ("packed_rowwise", "mlp.fc", params(weight=Shard(1, parts=2), bias=Replicate())),
    ("sequence_parallel", "attn.norm", sequence_parallel(local=True)),
    ("replicated_with_grad_allreduce", "attn.norm",
     replicate() >> on_shards(param_grads={"weight": Partial(), "bias": Partial()})),
    ("all_reduce", "mlp", prepare_out(Replicate(), given=Partial())),
    ("gather", "mlp", prepare_out(Replicate(), given=Partial())),
    ("moe_tp_experts", "experts",
     on_shards(Replicate(), None, Replicate(), grads=Partial(), output=Partial())
     >> prepare_out(Replicate())),
    ("moe_tp_experts", "attn",  # one routed input: only the tokens
     on_shards(Replicate(), grads=Partial(), output=Partial()) >> prepare_out(Replicate())),
    ("local_params", "attn", on_shards()),
    ("replicate", "embed", replicate() >> on_shards()),
    ("local", "mlp", on_shards()),
    ("local_colwise", "attn.q_proj", params(weight=Shard(0), bias=Shard(0)) >> on_shards()),
    ("local_rowwise", "attn.o_proj", params(weight=Shard(1), bias=Replicate()) >> on_shards()),
    ("local_packed_rowwise", "attn.o_proj",
     params(weight=Shard(1, parts=2), bias=Shard(0, parts=2)) >> on_shards()),
])
def test_each_string_on_a_module_has_its_transformers_meaning(string, fqn, style):
    assert _style(string, fqn) == style


@pytest.mark.parametrize("string, placement", [
    ("packed_colwise", Shard(1, parts=2)),
    ("rowwise", Shard(2)),
    ("colwise", Shard(1)),
    ("packed_rowwise", Shard(2, parts=2)),
    ("embedding_rowwise", Shard(0)),
    ("replicate", Replicate()),
])
def test_a_string_on_a_parameter_places_it_by_its_dims(string, placement):
    plan = {"experts": "moe_tp_experts", "experts.gate_up_proj": string}
    style = dict(from_hf(plan, Block()).rules)["experts"]
    assert style.stages[0] == params(gate_up_proj=placement).stages[0]


def test_parameters_keyed_under_their_module_are_local_shards_it_computes_with():
    block = Block()
    assert dict(from_hf({"attn": "local_params", "attn.sinks": "colwise"}, block).rules) == {
        "attn": params(sinks=Shard(0)) >> on_shards()}
    # transformers 4.x: local_* parameters are plain shards; their module computes with them.
    old = {"old": "local", "old.gate_up_proj": "local_packed_rowwise", "old.down_proj": "local_colwise"}
    assert dict(from_hf(old, block).rules) == {
        "old": params(gate_up_proj=Shard(2, parts=2), down_proj=Shard(1)) >> on_shards()}
    assert dict(from_hf({"attn.sinks": "local_rowwise"}, block).rules) == {
        "attn": params(sinks=Shard(0)) >> on_shards()}
    assert dict(from_hf({"attn.sinks": "packed_rowwise", "attn.norm.bias": "packed_rowwise"},
                        block).rules) == {"attn": params(sinks=Replicate()),
                                          "attn.norm": params(bias=Replicate())}


def test_a_module_with_several_colwise_children_takes_its_input_replicated_once():
    two = from_hf({"attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.o_proj": "rowwise",
                   "mlp.fc": "colwise"}, Block())
    assert dict(two.rules)["attn"] == prepare_in(Replicate(), local=True)
    assert "mlp" not in dict(two.rules)  # one column-wise child: nothing to share
    keyed = from_hf({"attn": "local_params", "attn.q_proj": "colwise", "attn.k_proj": "colwise"},
                    Block())
    assert dict(keyed.rules)["attn"] == on_shards()  # its own style wins; q and k reduce alone


def test_every_problem_in_a_plan_is_reported_at_once():
    with pytest.raises(PlanError) as e:
        from_hf({
            "attn.q_proj": "fused_colwise",
            "attn.k_proj": "mla_kv_a_proj",
            "experts.identity": "grouped_gemm",
            "experts": "ep_dispatch_experts",
            "embed": "colwise",
            "attn.o_prj": "rowwise",
            "attn.sinks": "moe_tp_experts",
            "attn": "local",
        }, Block())
    assert e.value.problems == [
        f"'attn.q_proj': unknown transformers style 'fused_colwise'; known: {', '.join(KNOWN)}.",
        f"'experts.identity': transformers' 'grouped_gemm' {UNSUPPORTED['grouped_gemm']}.",
        "'experts': transformers' 'ep_dispatch_experts' is expert parallelism (whole experts per "
        "rank, tokens sent between ranks), which tpfn does not do; shard the experts on their "
        "hidden dim instead: 'moe_tp_experts' on the experts module, 'packed_colwise' and "
        "'rowwise' on its weights.",
        "'attn.o_prj' names no module or parameter of Block.",
        "'attn.sinks' names a parameter; 'moe_tp_experts' applies to modules, so key its module "
        "'attn'.",
        "'attn' (Attention) is 'local', which divides the parameters it owns (sinks) by the mesh "
        "size so that an all-reduce after it counts them once; layouts place values and never "
        "scale them. Key each parameter with a style.",
        "'embed' (Embedding) is 'colwise', which transformers applies to Linear modules; this is "
        "Embedding.",
        "'attn.k_proj' is 'mla_kv_a_proj', transformers' multi-head latent attention: its latent "
        "goes through 'attn.kv_a_layernorm', a norm over the latent, to 'attn.kv_b_proj', keyed "
        "'colwise'; it is missing. Key it 'colwise', or write the attention's plan by hand.",
    ]


def test_a_rule_outside_the_models_own_plan_must_name_something():
    model = llama()
    with pytest.raises(PlanError, match=r"'model.layers.\*.mlp.gat_proj' names no module"):
        from_hf({**model.tp_plan, "model.layers.*.mlp.gat_proj": "colwise"}, model)


class OldExperts(Experts):
    """Experts as transformers 4.x Llama4 stored them (transposed), computing their sum."""

    def __init__(self):
        super().__init__(transposed=True)

    def forward(self, x):
        gate, up = torch.einsum("td,edh->teh", x, self.gate_up_proj).chunk(2, dim=-1)
        return torch.einsum("teh,ehd->td", F.silu(gate) * up, self.down_proj)


def _old_moe():
    torch.manual_seed(0)
    ref = nn.Sequential(OldExperts())
    old = {"": "gather", "0": "local", "0.gate_up_proj": "local_packed_rowwise",
           "0.down_proj": "local_colwise"}
    tp = tpfn.parallelize(clone(ref), mesh(2), from_hf(old, ref))
    x = torch.randn(5, 8)
    with torch.no_grad():
        return rel_err(tp(x), ref(x)), counts(lambda: tp(x))


def test_transformers_4_gather_and_local_styles_sum_local_experts(ranks2):
    error, comm = ranks2.run(_old_moe)[0]
    assert error <= TOL and comm == {"all_reduce": 1}


def test_a_from_hf_plan_prints_one_rule_per_line_and_evaluates_back():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    qwen2 = Qwen2ForCausalLM(Qwen2Config(**TINY))
    p = from_hf(qwen2.tp_plan, qwen2)
    assert repr(p) == """plan({
    'lm_head': colwise() >> prepare_out(Replicate()),
    'model.embed_tokens': rowwise(),
    'model.layers.*.mlp': prepare_in(Replicate(), local=True),
    'model.layers.*.mlp.down_proj': rowwise(),
    'model.layers.*.mlp.gate_proj': colwise(),
    'model.layers.*.mlp.up_proj': colwise(),
    'model.layers.*.self_attn': prepare_in(Replicate(), local=True) >> per_rank('num_key_value_groups', per_head=2),
    'model.layers.*.self_attn.k_proj': colwise(heads=2),
    'model.layers.*.self_attn.o_proj': rowwise(),
    'model.layers.*.self_attn.q_proj': colwise(),
    'model.layers.*.self_attn.v_proj': colwise(heads=2),
})"""
    namespace = {name: getattr(tpfn, name) for name in tpfn.__all__}
    assert eval(repr(p), namespace) == p
    assert eval(repr(from_hf(llama().tp_plan, llama())), namespace) == from_hf(llama().tp_plan, llama())


def test_one_rule_of_a_from_hf_plan_is_overridden_and_its_conflict_names_how():
    model = llama()
    p = from_hf(model.tp_plan, model)
    with pytest.raises(PlanError, match=re.escape(
            "bind it once, or override it: plan.override({'lm_head': colwise(local=False)})")):
        p | {"lm_head": colwise(local=False)}
    q = p.override({"lm_head": colwise(local=False)})
    assert q.without("lm_head") == p.without("lm_head")
    assert dict(q.rules)["lm_head"] == colwise(local=False)
    assert [m.style for m in tpfn.resolve(q, model) if m.fqn == "lm_head"] == [colwise(local=False)]


# -- multi-head latent attention ('mla_kv_a_proj') -----------------------------------------

LATENT = {
    "kv_a_proj_with_mqa": replicate() >> on_shards(Replicate(), grads=Partial(),
                                                   param_grads={"weight": Partial()}),
    "kv_a_layernorm": replicate() >> on_shards(param_grads={"weight": Partial()}),
    "kv_b_proj": params(weight=Shard(0)) >> on_shards(None, output=Shard(-1)),
}


def _latent_attention(name, **overrides):
    """tpfn's and transformers' own TP of the tiny model against one device: the errors,
    the backward's collectives, and the plan."""
    hf_zoo.quiet()
    m = mesh(2)
    model, inputs = hf_zoo.build(name, **overrides)
    ref = clone(model)
    torch.manual_seed(3)
    cotangents = {}

    def cotangent(y):
        return cotangents.setdefault(y.shape, torch.randn(y.shape))

    expected = hf_zoo.step(ref, inputs, cotangent)
    found = {}
    for key, parallel in (("tpfn", hf_zoo.with_tpfn), ("hf", hf_zoo.with_transformers)):
        tp = parallel(clone(model), m)
        out = {}
        counts(lambda: out.setdefault("y", hf_zoo.step(tp, inputs, cotangent)))
        run = hf_zoo.errors(tp, ref, out["y"], expected)
        tp.zero_grad()
        y = tp(**inputs).logits
        found[key] = (hf_zoo.at_parity(run), hf_zoo.worst(run),
                      counts(lambda: (y * cotangent(y)).sum().backward()))
    return found, dict(from_hf(model.tp_plan, model).rules)


def test_latent_attention_sums_the_gradient_of_the_whole_latent_once(ranks2):
    found, rules = ranks2.run(_latent_attention, "minicpm3")[0]
    attn = "model.layers.*.self_attn"
    # The latent's gradient stays partial from kv_b_proj back through its norm; the
    # projection sums it once, at its input and (with the norm's) its weight.
    assert {k: rules[f"{attn}.{k}"] for k in LATENT} == LATENT
    assert rules[f"{attn}.q_b_proj"] == colwise() and f"{attn}.q_a_proj" not in rules
    # q_a_proj (plain) and kv_a_proj_with_mqa read the input: one replica, whose one
    # reduction takes kv_a_proj's partial input gradient, q_a_proj's added whole
    assert rules[attn] == prepare_in(Replicate(), local=True)
    (mine, _, tp_counts), (theirs, _, hf_counts) = found["tpfn"], found["hf"]
    assert mine and theirs, found
    layers = 2
    # Per layer: q_b_proj's and kv_a_proj's input, gate and up's shared one; + the head's
    # input and one bucket of partial weight gradients. transformers: q_b_proj, kv_b_proj,
    # the rotary keys, gate, up per layer, + the head's input.
    assert tp_counts == {"all_reduce": 3 * layers + 2}
    assert hf_counts == {"all_reduce": 5 * layers + 1}


def test_latent_attention_with_queries_of_full_rank_and_experts_matches_single_device(ranks2):
    found, rules = ranks2.run(_latent_attention, "deepseek_v2", q_lora_rank=None)[0]
    attn = "model.layers.*.self_attn"
    assert rules[f"{attn}.q_proj"] == colwise()
    assert {k: rules[f"{attn}.{k}"] for k in LATENT} == LATENT
    # q_proj and kv_a_proj_with_mqa take the input as it comes (q_a_proj, of the other
    # branch, is None here): they share one replicated input and its gradient's all-reduce.
    assert rules[attn] == prepare_in(Replicate(), local=True)
    assert found["tpfn"][0] and found["hf"][0], found


class Latent(nn.Module):
    """Multi-head latent attention's projections, named as transformers names them."""

    def __init__(self, norm=8):
        super().__init__()
        self.kv_a_proj_with_mqa = nn.Linear(8, 8 + 4, bias=False)
        self.kv_a_layernorm = nn.LayerNorm(norm)
        self.kv_b_proj = nn.Linear(8, 16, bias=False)


@pytest.mark.parametrize("plan, module, problem", [
    ({"kv_a_proj_with_mqa": "mla_kv_a_proj"}, Latent(),
     "it is not in the plan. Key it 'colwise', or write the attention's plan by hand."),
    ({"kv_a_proj_with_mqa": "mla_kv_a_proj", "kv_b_proj": "colwise"}, Latent(norm=12),
     "its parameters do not match the 8 latent features, so the latent's path is not the one "
     "'mla_kv_a_proj' is exact for; write the attention's plan by hand."),
    ({"kv_a_proj_with_mqa": "mla_kv_a_proj", "kv_b_proj": "colwise",
      "kv_a_layernorm": "sequence_parallel"}, Latent(),
     "it is 'sequence_parallel'. Leave it out of the plan."),
])
def test_latent_attention_whose_latent_takes_another_path_is_refused(plan, module, problem):
    with pytest.raises(PlanError) as e:
        from_hf(plan, module)
    assert e.value.problems == [
        "'kv_a_proj_with_mqa' is 'mla_kv_a_proj', transformers' multi-head latent attention: "
        "its latent goes through 'kv_a_layernorm', a norm over the latent, to 'kv_b_proj', "
        f"keyed 'colwise'; {problem}"]


# -- the shared input: only where the forward hands it straight to the projections -----------

class Straight(nn.Module):
    """Attention that hands its input straight to q, k and v."""

    def __init__(self):
        super().__init__()
        # No bias on k: its gradient is zero up to rounding (a softmax ignores a shift).
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(8, 8, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(8, 8)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, 2).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, 2).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, 2).transpose(1, 2)
        return self.o_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


class Prefixed(Straight):
    """Attention that puts a learned context before its input, then projects."""

    def __init__(self):
        super().__init__()
        self.context = nn.Parameter(torch.randn(1, 2, 8))

    def forward(self, x):
        x = torch.cat([self.context.expand(x.shape[0], -1, -1), x], dim=1)
        return super().forward(x)[:, 2:]


ATTENTION = {"attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise",
             "attn.o_proj": "rowwise"}


def _attention(kind):
    torch.manual_seed(0)
    ref = nn.ModuleDict({"attn": kind()})
    plan = from_hf(ATTENTION, ref)
    tp = tpfn.parallelize(clone(ref), mesh(2), plan)
    x = torch.randn(2, 5, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    expected = ref["attn"](x_ref)
    expected.pow(2).sum().backward()
    out = {}
    comm = counts(lambda: out.setdefault("y", tp["attn"](x)).pow(2).sum().backward())
    errors = [rel_err(out["y"], expected), rel_err(x.grad, x_ref.grad),
              *max_rel_err(tp, ref, grads=True).values()]
    shared = None
    if kind is Prefixed:  # what the shared input would do to it
        forced = tpfn.parallelize(clone(ref), mesh(2), plan.override({"attn": prepare_in(Replicate())}))
        try:
            forced["attn"](x)
        except RuntimeError as e:
            shared = str(e)
    return dict(plan.rules).get("attn"), max(errors), comm, shared


SHARED = prepare_in(Replicate(), local=True)


def test_a_module_that_hands_its_input_to_its_projections_shares_one_input_gradient(ranks2):
    style, error, comm, _ = ranks2.run(_attention, Straight)[0]
    assert style == SHARED
    assert error <= TOL
    assert comm == {"all_reduce": 2}  # o_proj's sum; q, k and v's one input gradient


def test_a_module_that_computes_on_its_input_first_shares_it_too(ranks2):
    style, error, comm, as_dtensor = ranks2.run(_attention, Prefixed)[0]
    # q, k and v read the concatenation, not the replica: each reduces its own input
    # gradient, and the replica adds up their whole sums; the numbers are one device's
    assert style == SHARED
    assert error <= TOL
    assert comm == {"all_reduce": 4}
    assert "mixed torch.Tensor and DTensor" in as_dtensor  # what a shared DTensor would meet


# -- plans that are wrong in transformers too ---------------------------------------------

def test_verify_names_the_rule_a_plan_lacks_for_replicated_parameters_with_partial_gradients():
    hf_zoo.quiet()
    model, _ = hf_zoo.build("qwen3_vl_moe_text")   # its plan leaves q_norm and k_norm out
    plan = from_hf(model.tp_plan, model)
    report = tpfn.verify(model, plan, {"input_ids": (2, 8)})
    assert not report.ok and report.culprit == "layers.1.self_attn.k_norm"
    assert report.hint.endswith(
        "The plan lacks replicate() >> on_shards(param_grads={'weight': Partial()}) (transformers: "
        "'replicated_with_grad_allreduce'), which sums them, on 'layers.*.self_attn.q_norm' and "
        "'layers.*.self_attn.k_norm'.")
    fixed = {**model.tp_plan, "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
             "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce"}
    assert tpfn.verify(model, from_hf(fixed, model), {"input_ids": (2, 8)}).ok


def test_from_hf_replicates_kv_heads_only_where_there_are_fewer_than_query_heads():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    mha = Qwen2ForCausalLM(Qwen2Config(**{**TINY, "num_key_value_heads": 4}))
    rules = dict(from_hf(mha.tp_plan, mha).rules)
    assert rules["model.layers.*.self_attn.k_proj"] == colwise()
    assert rules["model.layers.*.self_attn"] == prepare_in(Replicate(), local=True)
    gqa = dict(from_hf(llama().tp_plan, llama()).rules)
    assert gqa["model.layers.*.self_attn.v_proj"] == colwise(heads=2)
    assert gqa["model.layers.*.mlp.up_proj"] == colwise()   # an MLP: no heads


def test_transformers_conv1d_keyed_colwise_or_rowwise_is_sharded_by_its_features():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64))
    p = from_hf({"transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}, gpt2)
    mounts = {m.fqn: m for m in tpfn.resolve(p, gpt2)}
    assert mounts["transformer.h.0.mlp.c_fc"].params == (("bias", Shard(0)), ("weight", Shard(1)))  # (in, out)
    assert mounts["transformer.h.0.mlp.c_proj"].params == (("bias", Replicate()), ("weight", Shard(0)))
    with pytest.raises(PlanError, match=r"'transformer.h.0.attn' \(GPT2Attention\) is 'colwise', which "
                                        r"transformers applies to Linear modules; this is GPT2Attention\."):
        from_hf({"transformer.h.*.attn": "colwise"}, gpt2)
