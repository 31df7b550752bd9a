"""More ranks than KV heads: ``colwise(heads=h)`` gives each group of ranks one KV head."""

import pytest
import sympy
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import tpfn
from tests.models import clone, one_step, rel_err
from tests.ranks import mesh
from tpfn import PlanError, Replicate, colwise, per_rank, prepare_in, rowwise

# float64 references: rounding ~1e-16 relative; 1e-12 leaves room for sums reordered over 4 ranks.
TOL = 1e-12


class GQA(nn.Module):
    """Grouped-query attention, 4 query heads and 2 KV heads of 8 features, computing on the
    heads it is handed: their numbers from the local widths, query heads per KV head from
    the local shapes. ``k_proj`` has no bias: softmax ignores a shift shared by every key, so
    its gradient would be rounding noise on one device and on four alike."""

    def __init__(self, dim=32, heads=4, kv_heads=2, head_dim=8):
        super().__init__()
        self.head_dim = head_dim
        self.q_proj = nn.Linear(dim, heads * head_dim)
        self.k_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * head_dim)
        self.o_proj = nn.Linear(heads * head_dim, dim)

    def forward(self, x):
        q, k, v = (p(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).flatten(2))


PLAN = {"": prepare_in(Replicate()), "q_proj": colwise(), "k_proj": colwise(heads=2),
        "v_proj": colwise(heads=2), "o_proj": rowwise()}


def _two_kv_heads_at_tp4():
    torch.manual_seed(0)
    ref = GQA().double()
    tp = tpfn.parallelize(clone(ref), mesh(4), PLAN)
    rank = dist.get_rank()
    k = tp.k_proj.weight
    assert k.shape == (16, 32) and k.device_mesh.shape == (2, 2)   # 2 heads x 2 replicas
    assert torch.equal(k.to_local(), ref.k_proj.weight.chunk(2)[rank // 2])
    errors, forward, backward = one_step(tp, ref, torch.randn(2, 6, 32, dtype=torch.float64))
    placements = {n: p.grad.placements for n, p in tp.named_parameters() if n[0] in "kv"}
    fresh = tpfn.parallelize(GQA().double(), mesh(4), PLAN)
    fresh.load_state_dict(ref.state_dict())  # one device's whole tensors: each rank its heads
    loaded = torch.equal(fresh.k_proj.weight.to_local(), ref.k_proj.weight.chunk(2)[rank // 2])
    return errors, forward, backward, placements, loaded


def test_two_kv_heads_at_tp4_equal_one_device(ranks4):
    for errors, forward, backward, grads, loaded in ranks4.run(_two_kv_heads_at_tp4):
        assert loaded
        assert max(errors.values()) <= TOL, errors
        assert len(errors) == 16  # output, input grad, 7 parameters and their 7 gradients
        assert forward == {"all_reduce": 1}  # o_proj's partial sums
        # the input gradient of q, k and v at once; at the end of the backward, one all-reduce
        # within each pair of ranks sums the 4 gradients of k_proj's and v_proj's copies
        assert backward == {"all_reduce": 2}
        assert all(str(g) == "(Shard(dim=0), Replicate())" for g in grads.values())


def _two_models():
    found = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        tp = tpfn.parallelize(GQA().double(), mesh(4), PLAN)
        y = tp(torch.randn(2, 6, 32, dtype=torch.float64, requires_grad=True))
        with CommDebugMode() as mode:
            y.sum().backward()
        own = all(p.grad.device_mesh is p.device_mesh for p in tp.parameters())
        found.append((tpfn.trace.counts(mode), own))
    return found


def test_a_second_model_s_kv_gradients_live_on_its_own_view_of_the_mesh(ranks4):
    # each model's 2-D view of the mesh is its own: DTensor's caches, which compare meshes by
    # ranks and names, would otherwise hand the second model's gradients the first one's view
    # (its process groups; where only some of them, their sums in two all-reduces)
    assert ranks4.run(_two_models)[0] == [({"all_reduce": 2}, True)] * 2


def _unchanged(model) -> bool:
    return not any(isinstance(p, DTensor) for p in model.parameters()) and \
        all(tpfn.mounted(m) is None for m in model.modules())


def test_a_degree_that_neither_divides_nor_multiplies_the_kv_heads_is_refused_by_name():
    from tpfn.dryrun import fake_mesh

    model = GQA()
    with pytest.raises(PlanError) as e:
        tpfn.parallelize(model, fake_mesh(3), PLAN, src_rank=None)
    assert ("parameter 'k_proj.weight' is 2 heads in dim 0, and 3 ranks neither divide them nor "
            "are a multiple of them, so no rank would hold whole heads; choose a mesh size that "
            "divides 2 or is a multiple of it (colwise(heads=2) at 'k_proj' (Linear)).") in e.value.problems
    assert _unchanged(model)
    with pytest.raises(PlanError, match=r"colwise\(heads=2\) at '<root>' \(Embedding\): heads= "
                                        r"replicates the key and value heads of a linear projection"):
        tpfn.resolve(colwise(heads=2), nn.Embedding(8, 4))
    with pytest.raises(TypeError, match=r"colwise\(parts=2, heads=2\): 'heads' replicates the heads "
                                        r"of one projection, 'parts' packs several"):
        colwise(parts=2, heads=2)


def test_heads_the_ranks_divide_are_plain_shards():
    from tpfn.dryrun import fake_mesh

    model = tpfn.parallelize(GQA(), fake_mesh(2), PLAN, src_rank=None)
    assert model.k_proj.weight.placements == model.q_proj.weight.placements
    assert model.k_proj.weight.device_mesh.ndim == 1
    assert model.k_proj.weight.to_local().shape == (8, 32)


def _llama70b():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                         num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                         max_position_embeddings=4096, tie_word_embeddings=False)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


@pytest.mark.parametrize("t", [16, 64])
def test_the_llama_3_70b_shape_runs_at_more_ranks_than_kv_heads_from_its_own_plan(t):
    model = _llama70b()
    plan = tpfn.from_hf(model.tp_plan, model)  # knows the 8 KV heads: colwise(heads=8)
    report = tpfn.explain(model, plan, world_size=t, example_inputs=(1, 4096))
    layers, h, ffn, vocab, head_dim, e = 80, 8192, 28672, 128256, 128, 4  # meta: float32
    r = t // 8  # ranks per KV head
    # The blocks move what Megatron's formula says; the replicated KV adds, at the end of the
    # backward, one all-reduce within each group of r ranks of k_proj's and v_proj's weight
    # gradients, one head (128 x 8192) of each per rank and layer: 2 (r - 1) / r of it.
    assert report.blocks_bytes == report.megatron_bytes
    kv = layers * 2 * head_dim * h * e * sympy.Rational(2 * (r - 1), r)
    assert report.moved(None) == report.moved(None, within=True) == kv  # outside every module: nothing within
    assert report.collectives == {"all_reduce": 4 * layers + 2 + 1, "all_gather": 1}
    # Each rank holds 1/t of every weight but k_proj's and v_proj's: one KV head of each.
    per_layer = 2 * h * h // t + 2 * head_dim * h + 3 * ffn * h // t + 2 * h
    assert report.param_bytes == e * (layers * per_layer + 2 * vocab * h // t + h)
    assert (f"'k_proj', 'v_proj' of 'model.layers.0.self_attn' (LlamaAttention) replicate 8 heads "
            f"of 128 features over the {t} ranks: each head is held by a group of {r} ranks "
            f"(colwise(heads=8)), whose copies each see their own ranks' query heads, so at the "
            f"end of the backward the gradients of the 2 replicated parameters (2097152 elements "
            f"per rank) are summed within each group, in one all-reduce (and 79 more like it).") \
        in report.lints
    # its attention holds the rank's query heads per KV head: per_rank, nothing to lint
    assert dict(plan.rules)["model.layers.*.self_attn"] == (
        prepare_in(Replicate(), local=True) >> per_rank("num_key_value_groups", per_head=8))
    assert not any("num_key_value_groups" in lint for lint in report.lints)
    unheld = plan.override({"model.layers.*.self_attn": prepare_in(Replicate(), local=True)})
    assert any("holds num_key_value_groups = 8, the query heads per KV head of the whole model" in
               lint and f"hold the local ratio ({64 // t}) with per_rank('num_key_value_groups', "
               "per_head=8) in its style" in lint
               for lint in tpfn.explain(model, unheld, world_size=t, example_inputs=(1, 8)).lints)


def test_more_ranks_than_kv_heads_under_plain_colwise_is_linted_with_the_fix():
    model = _llama70b()
    plain = tpfn.from_hf(model.tp_plan, model).override(
        {f"model.layers.*.self_attn.{p}_proj": colwise() for p in "kv"})
    with pytest.raises(PlanError) as e:
        tpfn.explain(model, plain, world_size=16, example_inputs=(1, 8))
    assert ("'k_proj', 'v_proj' of 'model.layers.0.self_attn' (LlamaAttention) project 8 heads of "
            "128 features: fewer heads than the 16 ranks, so colwise() cannot give each rank a "
            "whole head; use at most 8 ranks for tensor parallelism, or replicate the heads over "
            "groups of ranks with colwise(heads=8) (and 79 more like it).") in e.value.problems


TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.1,
            use_cache=False)


def _llama(attn_implementation: str, kv_heads: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY, "num_key_value_heads": kv_heads}, attn_implementation=attn_implementation)
    model = LlamaForCausalLM(config)
    return model, tpfn.from_hf(model.tp_plan, model)  # the model's own plan, as it is


def _transformers_llamas():
    """transformers' Llama from its own plan against one device: 2 or 1 KV heads on the mesh's
    ranks, by sdpa (with a padding mask it repeats the KV heads by num_key_value_groups; without
    one it reads the ratio from the shapes) and by eager attention (which always repeats)."""
    found = {}
    n = dist.get_world_size()
    for kv, impl, padded in ((2, "sdpa", False), (2, "sdpa", True), (2, "eager", False), (1, "sdpa", True)):
        ref, plan = _llama(impl, kv)
        tp = tpfn.parallelize(clone(ref), mesh(n), plan)
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
        mask = torch.ones(2, 8, dtype=torch.long)
        mask[1, :3] = 0   # left padding
        kw = {"attention_mask": mask} if padded else {}
        logits, expected = tp(ids, **kw).logits, ref(ids, **kw).logits
        logits.pow(2).sum().backward()
        expected.pow(2).sum().backward()
        errors = {"logits": rel_err(logits, expected)}
        errors.update({k: rel_err(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad,
                                  ref.get_parameter(k).grad) for k, p in tp.named_parameters()})
        found[kv, impl, padded] = errors
        assert tp.model.layers[0].self_attn.num_key_value_groups == 4 // kv   # restored
    return found


def test_transformers_llamas_from_their_own_plans_at_more_ranks_than_kv_heads(ranks2, ranks4):
    # from_hf knows the KV heads: colwise(heads=...) on k and v, and the attention holds its
    # rank's query heads per KV head. float32: sums over 4 ranks in other orders agree to 1e-5
    # relative, as in tests/test_hf.py.
    for ranks in (ranks2, ranks4):
        for found in ranks.run(_transformers_llamas):
            for case, errors in found.items():
                assert max(errors.values()) <= 1e-5, (case, errors)


def test_an_attention_that_repeats_kv_by_the_global_ratio_is_named():
    model, plan = _llama("eager")  # repeat_kv(key, module.num_key_value_groups)
    plan = plan.override({"model.layers.*.self_attn": prepare_in(Replicate(), local=True)})
    with pytest.raises(PlanError) as e:
        tpfn.explain(model, plan, world_size=4, example_inputs=(2, 8))
    assert ("'model.layers.0.self_attn' (LlamaAttention) holds num_key_value_groups = 2, the query "
            "heads per KV head of the whole model, but 'k_proj', 'v_proj' replicate each of their "
            "2 KV heads over a group of 2 of the 4 ranks: each rank computes 1 query head against "
            "1 KV head, so repeating the KV heads by num_key_value_groups (transformers' eager "
            "attention, or its sdpa with a mask) makes 2 KV heads for 1; take the ratio from the "
            "local shapes (q.shape[1] // k.shape[1]), as transformers' sdpa does without a mask "
            "(enable_gqa), or hold the local ratio (1) with per_rank('num_key_value_groups', "
            "per_head=2) in its style (and 1 more like it).") in e.value.problems


# Checkpoints: the weights are DTensors of their true global shape, so both paths hold them.

def _laid_out(seed: int, tp: bool = True):
    torch.manual_seed(seed)
    model = GQA()
    if tp and dist.is_initialized():
        tpfn.parallelize(model, mesh(dist.get_world_size()), PLAN)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _state(model, opt) -> dict:
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    out = {n: full(p).detach().clone() for n, p in model.named_parameters()}
    out.update({f"{n}.{k}": full(v).clone() for n, p in model.named_parameters()
                for k, v in opt.state[p].items()})
    return out


def _save(path):
    model, opt = _laid_out(seed=0)
    torch.manual_seed(1)
    model(torch.randn(2, 6, 32)).pow(2).mean().backward()
    opt.step()
    tpfn.checkpoint.save(path, model, opt)
    return _state(model, opt)


def _load(path):
    model, opt = _laid_out(seed=2)
    tpfn.checkpoint.load(path, model, opt)
    return _state(model, opt)


def _pretrained(directory):
    source, _ = _laid_out(seed=0, tp=False)
    tpfn.save_pretrained(source, directory)
    with tpfn.empty_weights():
        empty = GQA()
    tpfn.parallelize(empty, mesh(dist.get_world_size()), PLAN, src_rank=None)
    tpfn.load_pretrained(empty, directory)
    again = directory + "-again"
    tpfn.save_pretrained(empty, again)
    back = GQA()
    tpfn.load_pretrained(back, again)  # one process reads what the ranks wrote
    return ([n for n, p in empty.named_parameters() if not torch.equal(p.full_tensor(), source.get_parameter(n))]
            + [f"saved {n}" for n, p in back.named_parameters() if not torch.equal(p, source.get_parameter(n))])


def _different(a, b) -> list:
    return [k for k in a if not torch.equal(a[k], b[k])]


def test_kv_heads_replicated_at_tp4_load_at_tp2_and_back(ranks2, ranks4, tmp_path):
    at4, at2 = str(tmp_path / "tp4"), str(tmp_path / "tp2")
    saved4, saved2 = ranks4.run(_save, at4)[0], ranks2.run(_save, at2)[0]
    assert _different(saved4, ranks2.run(_load, at4)[0]) == []   # replicated -> plain shards
    assert _different(saved2, ranks4.run(_load, at2)[0]) == []   # plain shards -> replicated
    assert _different(saved4, ranks4.run(_load, at4)[0]) == []
    model, opt = _laid_out(seed=2, tp=False)
    tpfn.checkpoint.load(at4, model, opt)  # one process
    assert _different(saved4, _state(model, opt)) == []
    assert ranks4.run(_pretrained, str(tmp_path / "pretrained")) == [[]] * 4


def test_verify_checks_replicated_kv_heads_against_one_device():
    report = tpfn.verify(GQA(), PLAN, (2, 6, 32), world_size=4, dtype=torch.float32)
    assert report.ok, str(report)
    assert {c.fqn: c.grad is not None for c in report.checks}["k_proj"]


def test_a_module_that_views_by_the_global_kv_head_count_is_named():
    attention = nn.Module()
    attention.num_key_value_heads, attention.head_dim = 2, 8
    attention.q, attention.k = nn.Linear(16, 32), nn.Linear(16, 16)
    report = tpfn.explain(attention, {"q": colwise(), "k": colwise(heads=2)}, world_size=4)
    assert report.warnings == ((
        "'<root>' (Module) holds num_key_value_heads = 2, the global KV head count of 'k', whose "
        "colwise(heads=2) hands on local shards: each of the 4 ranks holds 1 of the 2 heads (each "
        "held by 2 ranks), so a view by num_key_value_heads heads (view(B, T, "
        "self.num_key_value_heads, -1)) makes heads of the wrong size, silently; hold the local "
        "count (1) with per_rank('num_key_value_heads', heads=2) in its style, view with -1 heads "
        "of the head size."),)
    (note,) = report.notes  # a cost, not a wrong number
    assert note.startswith("'k' of '<root>' (Module) replicates 2 heads of 8 features "
                           "over the 4 ranks: each head is held by a group of 2 ranks")
    held = tpfn.explain(attention, {"": per_rank("num_key_value_heads", heads=2), "q": colwise(),
                                    "k": colwise(heads=2)}, world_size=4)
    assert held.warnings == () and held.notes == report.notes   # the fix the warning names


def test_gradient_hooks_on_kv_weights_are_refused_only_where_their_gradients_are_partial():
    from tpfn.dryrun import fake_mesh

    for n, refused in ((2, False), (4, True)):   # 2 KV heads: whole on 2 ranks, copies on 4
        model, plan = _llama("sdpa")
        model.model.layers[0].self_attn.k_proj.weight.register_hook(lambda g: g)
        try:
            tpfn.parallelize(model, fake_mesh(n), plan, src_rank=None)
        except PlanError as e:
            assert refused and "'model.layers.0.self_attn.k_proj.weight' has gradient hooks" in str(e)
        else:
            assert not refused
