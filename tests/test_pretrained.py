"""Pretrained checkpoints, shard by shard: tiny transformers models saved with save_pretrained,
loaded on 2 gloo ranks, each rank reading only its slices.

Tolerance: the loaded weights are compared bit for bit; logits and gradients are float32
forwards of the same weights through other reduction orders (all-reduces of partial sums),
so they agree to float32 rounding: 1e-5 relative, as in tests/test_hf.py.
"""

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from transformers import (
    AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MixtralConfig,
    MixtralForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
)

import tpfn
from tests import hf_zoo
from tests.models import rel_err
from tests.ranks import mesh
from tpfn import (
    CheckpointError, empty_weights, from_pretrained, load_pretrained, save_pretrained,
)

TOL = 1e-5
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.1,
            use_cache=False)
SHARD = "20KB"  # a tiny model in 4 to 7 files


def build(name: str):
    torch.manual_seed(0)
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(**TINY))
    if name == "llama-tied":
        return LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=True))
    if name == "phi3":
        return Phi3ForCausalLM(Phi3Config(**TINY, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    if name == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**TINY))
    if name == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**{**TINY, "intermediate_size": 16},
                                                num_local_experts=4, num_experts_per_tok=2))
    raise KeyError(name)


def packed_phi3_plan(path):
    """Phi-3's own plan, with its fused gate_up projection packed: each rank holds its slice
    of the gate and of the up projection (Shard(0, parts=2)), so the MLP computes locally."""
    with empty_weights():
        probe = Phi3ForCausalLM(AutoConfig.from_pretrained(path))
    rules = dict(tpfn.from_hf(probe.tp_plan, probe).rules)
    rules["model.layers.*.mlp.gate_up_proj"] = tpfn.colwise(parts=2)
    rules["model.layers.*.mlp.down_proj"] = tpfn.rowwise()
    return rules


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _round_trip(path, out, shard, packed, tied):
    m = mesh(2)
    rank = torch.distributed.get_rank()
    plan = packed_phi3_plan(path) if packed else "auto"
    model = from_pretrained(path, m, plan=plan)
    ref = AutoModelForCausalLM.from_pretrained(path)  # transformers, one device
    found = {"meta": [n for n, t in [*model.named_parameters(), *model.named_buffers()]
                      if (t.to_local() if isinstance(t, DTensor) else t).is_meta]}
    refs = dict(ref.named_parameters())
    found["weights"] = [n for n, p in model.named_parameters() if not torch.equal(full(p), refs[n])]
    ref_buffers = dict(ref.named_buffers())
    found["buffers"] = [n for n, b in model.named_buffers() if not torch.equal(b, ref_buffers[n])]
    found["tied"] = model.lm_head.weight is model.model.embed_tokens.weight
    if packed:
        found["packing"] = str(model.model.layers[0].mlp.gate_up_proj.weight.placements)
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (2, 8))
    logits, expected = model(ids).logits, ref(ids).logits
    found["logits"] = rel_err(logits, expected)
    logits.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    found["grads"] = max(rel_err(p.grad, refs[n].grad) for n, p in model.named_parameters())

    save_pretrained(model, out, max_shard_size=shard or "5GB")
    found["files"] = sorted(os.listdir(out))
    back = AutoModelForCausalLM.from_pretrained(out)  # transformers reads what tpfn wrote
    found["saved"] = [n for n, p in back.named_parameters() if not torch.equal(p, refs[n])]
    again = from_pretrained(out, m, plan=plan)
    mine = dict(model.named_parameters())
    found["reloaded"] = [n for n, p in again.named_parameters()
                         if not torch.equal(full(p), full(mine[n]))]

    # load_pretrained into a model built by hand, converting to bfloat16 on the way in
    with empty_weights():
        hand = type(ref)(AutoConfig.from_pretrained(path))
    tpfn.parallelize(hand, m, plan if packed else tpfn.from_hf(hand.tp_plan, hand), src_rank=None)
    load_pretrained(hand, path, dtype=torch.bfloat16)
    found["bf16"] = [n for n, p in hand.named_parameters()
                     if p.dtype != torch.bfloat16 or not torch.equal(full(p), refs[n].bfloat16())]
    found["rank"] = rank
    return found


CASES = [
    pytest.param("llama", SHARD, id="llama-sharded"),
    pytest.param("llama", None, id="llama-single-file"),
    pytest.param("llama-tied", SHARD, id="llama-tied-embeddings-sharded"),
    pytest.param("phi3", None, id="phi3-fused-qkv-and-packed-gate_up-single-file"),
    pytest.param("qwen3", SHARD, id="qwen3-per-head-norms-partial-grads-sharded"),
    # tpfn's save_pretrained writes Mixtral's fused 3-D layout, which transformers loads too;
    # transformers' own per-expert checkpoints: test_transformers_per_expert_mixtral_...
    pytest.param("mixtral", SHARD, id="mixtral-fused-experts-checkpoint-written-by-tpfn"),
]


@pytest.mark.parametrize("name,shard", CASES)
def test_loads_each_ranks_slices_matches_one_device_and_round_trips(ranks2, tmp_path, name, shard):
    source, path, out = build(name), str(tmp_path / "hf"), str(tmp_path / "tpfn")
    if name == "mixtral":
        save_pretrained(source, path, max_shard_size=shard)  # no process group: one writer
    else:
        source.save_pretrained(path, max_shard_size=shard or "5GB")
    sharded = os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    assert sharded == (shard is not None)
    results = ranks2.run(_round_trip, path, out, shard, name == "phi3", name == "llama-tied")
    for found in results:
        assert found["meta"] == [] and found["weights"] == [] and found["buffers"] == []
        assert found["tied"] == (name == "llama-tied")
        assert found["logits"] <= TOL and found["grads"] <= TOL, found
        assert found["saved"] == [] and found["reloaded"] == [] and found["bf16"] == []
        if name == "phi3":
            assert found["packing"] == "(_StridedShard(dim=0, sf=2),)"
        names = found["files"]
        assert ("model.safetensors.index.json" in names) == sharded
        assert ("model.safetensors" in names) == (not sharded) and "config.json" in names


def _per_expert(path):
    m = mesh(2)
    model = from_pretrained(path, m)
    ref = AutoModelForCausalLM.from_pretrained(path)  # transformers fuses the experts itself
    refs = dict(ref.named_parameters())
    experts = model.model.layers[0].mlp.experts
    found = {"weights": [n for n, p in model.named_parameters() if not torch.equal(full(p), refs[n])],
             "placements": [str(experts.gate_up_proj.placements), str(experts.down_proj.placements)],
             "local": tuple(experts.gate_up_proj.to_local().shape)}
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (2, 8))
    found["logits"] = rel_err(model(ids).logits, ref(ids).logits)
    return found


@pytest.mark.parametrize("shard", [SHARD, None], ids=["sharded", "single-file"])
def test_transformers_per_expert_mixtral_loads_fused_and_matches_one_device(ranks2, tmp_path, shard):
    path = str(tmp_path / "mixtral")
    build("mixtral").save_pretrained(path, max_shard_size=shard or "5GB")
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") if not shard else \
            open(os.path.join(path, "model.safetensors.index.json")) as f:
        keys = list(f.keys()) if not shard else list(json.load(f)["weight_map"])
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in keys  # one by one
    for found in ranks2.run(_per_expert, path):
        assert found["weights"] == [] and found["logits"] <= TOL, found
        assert "Replicate" not in "".join(found["placements"]), found  # sharded, read in slices
        assert found["local"] != (4, 32, 32), found


def _without_a_plan(path):
    import logging

    m = mesh(2)
    seen = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: seen.append((record.levelname, record.getMessage()))
    logger, level = logging.getLogger("tpfn"), logging.getLogger("tpfn").level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        model = from_pretrained(path, m)
        whole = from_pretrained(path, m, plan=None)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    ref = AutoModelForCausalLM.from_pretrained(path)
    refs = dict(ref.named_parameters())
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (2, 8))
    logits, expected = model(ids).logits, ref(ids).logits
    logits.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    floor = hf_zoo._floor(ref)  # a key's bias: a zero gradient under softmax, up to rounding
    return {"logged": seen,
            "sharded": sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor)
                              and not p.placements[0].is_replicate()),
            "weights": [n for n, p in model.named_parameters() if not torch.equal(full(p), refs[n])],
            "logits": rel_err(logits, expected),
            "grads": max(hf_zoo._error(p.grad, refs[n].grad, floor) for n, p in model.named_parameters()),
            "whole": [n for n, p in whole.named_parameters() if isinstance(p, DTensor)]}


def test_a_model_without_a_plan_loads_with_suggests_plan_logged(ranks2, tmp_path):
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    opt = OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                   num_attention_heads=4, word_embed_proj_dim=32,
                                   max_position_embeddings=64))
    assert not opt.tp_plan
    path = str(tmp_path / "opt")
    opt.save_pretrained(path)
    for found in ranks2.run(_without_a_plan, path):
        assert found["weights"] == [] and found["logits"] <= TOL and found["grads"] <= TOL, found
        assert "model.decoder.layers.0.fc1.weight" in found["sharded"], found["sharded"]
        plans = [r for r in found["logged"] if not r[1].startswith("load_pretrained: ")]  # (its reads: INFO too)
        (level, message), (whole_level, whole_message) = plans
        assert level == "INFO" and message.startswith(
            "OPTForCausalLM declares no tensor-parallel plan; tpfn.suggest's shards its parameters:\nplan({")
        assert whole_level == "WARNING" and found["whole"] == []
        assert whole_message == "from_pretrained(plan=None): every rank holds and computes the whole OPTForCausalLM"


# --- bad input --------------------------------------------------------------------------------


def _rewrite(file, change):
    with safe_open(file, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _bad(tmp_path):
    """{case: (checkpoint dir, model name, strict)} of broken checkpoints."""
    good = str(tmp_path / "good")
    build("llama").save_pretrained(good)
    single = os.path.join(good, "model.safetensors")
    cases = {}

    def variant(case, change=None, model="llama", strict=True):
        d = str(tmp_path / case)
        shutil.copytree(good, d)
        if change:
            change(os.path.join(d, "model.safetensors"))
        cases[case] = (d, model, strict)

    variant("missing", lambda f: _rewrite(f, lambda t: t.pop("model.norm.weight")))
    variant("unexpected", lambda f: _rewrite(f, lambda t: t.update({"model.extra.weight": torch.ones(3)})))
    variant("unexpected-accepted", lambda f: _rewrite(
        f, lambda t: t.update({"model.extra.weight": torch.ones(3)})), strict=False)
    variant("shape", lambda f: _rewrite(
        f, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.ones(63, 32)})))
    variant("dtype", lambda f: _rewrite(
        f, lambda t: t.update({"model.norm.weight": torch.ones(32, dtype=torch.int32)})))
    data = open(single, "rb").read()
    variant("truncated", lambda f: open(f, "wb").write(data[:-100]))
    variant("corrupt", lambda f: open(f, "wb").write(b"\x99" * 8 + data[8:]))
    other = str(tmp_path / "other-model")
    build("phi3").save_pretrained(other)
    cases["other-model"] = (other, "llama", True)
    experts = str(tmp_path / "lost-expert")
    build("mixtral").save_pretrained(experts)  # transformers' own per-expert layout
    _rewrite(os.path.join(experts, "model.safetensors"),
             lambda t: t.pop("model.layers.1.block_sparse_moe.experts.3.w3.weight"))
    cases["lost-expert"] = (experts, "mixtral", True)
    sharded = str(tmp_path / "sharded")
    build("llama").save_pretrained(sharded, max_shard_size=SHARD)
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        lost = json.load(f)["weight_map"]["model.norm.weight"]
    os.remove(os.path.join(sharded, lost))
    cases["lost-shard"] = (sharded, "llama", True)
    cases["meta-buffer"] = (good, "llama-on-meta", True)
    return cases, single


def _meta_model(name, path):
    config = AutoConfig.from_pretrained(path) if name != "llama" else None
    if name == "llama-on-meta":  # torch's meta device: the rotary buffer is meta too
        with torch.device("meta"):
            model = build("llama")
    else:
        with empty_weights():
            model = build(name) if config is None else build(name)
    return tpfn.parallelize(model, mesh(2), tpfn.from_hf(model.tp_plan, model), src_rank=None)


def _try_bad(cases):
    found = {}
    for case, (path, name, strict) in cases.items():
        model = _meta_model(name, path)
        try:
            load_pretrained(model, path, strict=strict)
            message = None
        except (CheckpointError, FileNotFoundError) as e:
            message = str(e)
        untouched = all(p.to_local().is_meta if isinstance(p, DTensor) else p.is_meta
                        for p in model.parameters())
        found[case] = (message, untouched)
    return found


def test_bad_checkpoints_raise_naming_the_key_and_the_file_and_change_nothing(ranks2, tmp_path):
    cases, single = _bad(tmp_path)
    first, second = ranks2.run(_try_bad, cases)
    assert first == second  # every rank raises alike
    where = {case: path for case, (path, _, _) in cases.items()}
    file = {case: os.path.join(where[case], "model.safetensors") for case in where}
    expected = {
        "missing": f"missing key 'model.norm.weight': the model's parameter of shape (32,) is "
                   f"in none of {file['missing']}",
        "unexpected": f"unexpected key 'model.extra.weight' in {file['unexpected']}: the model "
                      "has no parameter or buffer of that name; pass strict=False to ignore it.",
        "shape": f"'model.layers.0.mlp.up_proj.weight' in {file['shape']} has shape (63, 32), "
                 "but the model's parameter is (64, 32)",
        "dtype": f"'model.norm.weight' in {file['dtype']} is stored as I32 (torch.int32), which "
                 "does not convert to the model's torch.float32",
        "truncated": f"cannot read {file['truncated']}: Error while deserializing header: "
                     "incomplete metadata, file not fully covered; the file is truncated or corrupt",
        "corrupt": f"cannot read {file['corrupt']}: Error while deserializing header",
        "other-model": "is a 'phi3' model and this model is 'llama': this is a checkpoint of "
                       "another model",
        "lost-expert": "missing key 'model.layers.1.block_sparse_moe.experts.3.w3.weight': the "
                       "expert weights of the model's parameter "
                       "'model.layers.1.mlp.experts.gate_up_proj' (4, 32, 32) are in "
                       f"{file['lost-expert']} one by one",
        "lost-shard": "is missing (named by model.safetensors.index.json)",
        "meta-buffer": "buffer 'model.rotary_emb.inv_freq' is on the meta device and not in "
                       f"{file['meta-buffer']}",
    }
    for case, text in expected.items():
        message, untouched = first[case]
        assert message is not None and text in message, (case, message)
        assert untouched, case  # nothing half-loaded
    assert first["unexpected-accepted"] == (None, False)  # loaded, every parameter written
    assert "'model.layers.0.self_attn.qkv_proj.weight' in " in first["other-model"][0]


# --- data x tensor parallelism ------------------------------------------------------------------


def _dp_tp(path):
    from torch.distributed.fsdp import fully_shard

    m = mesh(2, 2, names=("dp", "tp"))
    model = from_pretrained(path, m["tp"])  # each rank reads its tensor-parallel slices
    for layer in model.model.layers:
        fully_shard(layer, mesh=m["dp"])
    fully_shard(model, mesh=m["dp"])
    ref = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (4, 8))
    mine = ids.chunk(2)[m["dp"].get_local_rank()]  # each data-parallel rank its half
    out, expected = model(mine).logits, ref(ids).logits.chunk(2)[m["dp"].get_local_rank()]
    return rel_err(out, expected)


def test_loads_at_tp_then_fully_shards_over_dp_and_matches_one_device(ranks4, tmp_path):
    """DP x TP: load on mesh['tp'] of a 2 x 2 mesh, then FSDP2 on mesh['dp']: the logits of
    each data-parallel half are one device's."""
    path = str(tmp_path / "hf")
    build("llama").save_pretrained(path, max_shard_size=SHARD)
    assert max(ranks4.run(_dp_tp, path)) <= TOL
