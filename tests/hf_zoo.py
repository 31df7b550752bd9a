"""Every transformers architecture that declares a tensor-parallel plan, as a tiny model.

``architectures()`` lists the model types whose config class carries a
``base_model_tp_plan`` (transformers 5.24: 164); ``build(name)`` makes the tiny model of one
from its default config with its sizes shrunk (2 layers, hidden 32, 4 heads of 8, 2 KV heads,
vocabulary 128, 4 experts of 16; per-layer lists cut to 2 layers keeping each kind, so that
a hybrid keeps one layer of each), seeded, so that every rank builds the same weights.
``outcomes(names)`` runs on each of 2 ranks: for each model, one device's output and every
gradient, then the same with ``tpfn.parallelize(model, mesh, tpfn.from_hf(...))`` and with
transformers' own tensor parallelism (``apply_tensor_parallelism`` on the model's resolved
plan, what ``from_pretrained(tp_plan="auto")`` runs), each compared with one device. Nothing
is downloaded. ``tools/hf_sweep.py`` runs every architecture and prints the table of
docs/huggingface.md; ``tests/test_hf_models.py`` runs a representative set in CI.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import warnings

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

TOLERANCE = 1e-4
"""``tpfn.dryrun.verify.TOLERANCE``: float32 sums in another order move a tensor by about
1e-6 of its norm, a wrong layout by 1e-2 to 1. Both TP implementations are held to it."""

SIZES = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    moe_intermediate_size=16, shared_expert_intermediate_size=16, shared_intermediate_size=16,
    moe_shared_expert_intermediate_size=16, expert_ffn_hidden_size=16, moe_hidden_size=16,
    intermediate_size_mlp=64, ffn_hidden_size=64, dense_intermediate_size=64, share_expert_dim=16,
    num_experts=4, n_routed_experts=4, num_local_experts=4, moe_num_experts=4,
    num_experts_per_tok=2, num_experts_per_token=2, moe_topk=2, moe_k=2, top_k_experts=2,
    n_group=1, topk_group=1, num_expert_group=1, n_shared_experts=1, num_shared_experts=1,
    moe_num_shared_experts=1, zero_expert_num=1, first_k_dense_replace=1, num_dense_layers=1,
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, qk_head_dim=8,
    v_head_dim=8, index_head_dim=8, index_n_heads=2, index_topk=4, index_kpool=2,
    indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4,
    indexer_compress_ratio=2, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_heads=4, linear_head_dim=8,
    mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8, mamba_n_groups=1,
    mamba_num_heads=4, mamba_head_dim=16, mamba_d_ssm=64, ssm_state_size=8, n_groups=1,
    chunk_size=8, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
    num_sliding_attention_heads=4, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
    num_kv_shared_layers=0, num_nextn_predict_layers=0, embedding_dim=32, rotary_dim=4,
    n_embd=32, n_layer=2, n_head=4, n_positions=64, dim_model_base=32, unpadded_vocab_size=128,
    prediction_head_size=32, embedding_rank=8, d_rel=4, rel_extent=16, sliding_window=16,
    sliding_window_size=16, attention_chunk_size=16, block_size=4, hc_lowrank=8,
    ple_embed_dim=8, ngram_vocab_size_base=128, split_ngram_parts=2, heads_per_ngram=2,
    out_hidden_size=32, adapter_in_dim=32,
)
TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id", "eod_token_id", "sep_token_id",
          "mask_token_id", "image_token_id", "audio_token_id", "document_token_id")
# Sizes whose None means "no such part" (DeepSeek-V2's queries without a low-rank step).
OPTIONAL = ("q_lora_rank",)
# What the sizes above cannot say, per model type.
def _mrope_config(head_dim: int, sections: list) -> dict:
    """M-RoPE sections that fit a tiny head (the modeling code's defaults are wider)."""
    return dict(head_dim=head_dim, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "mrope_section": sections})


OVERRIDES = {
    **dict.fromkeys(("paddleocr_vl_text", "qwen2_5_omni_text", "qwen2_5_vl_text", "qwen2_vl_text",
                     "glm4v_text"), _mrope_config(8, [2, 1, 1])),
    "glm4v_moe_text": _mrope_config(8, [1, 1, 0]),             # half of each head rotates
    **dict.fromkeys(("glm_image_text", "glm_ocr_text"), _mrope_config(16, [4, 2, 2])),
    "neomme": dict(head_dim=16),                          # a quarter of the dims in pairs of 2
    "glm5_next_text": dict(qk_rope_head_dim=0, num_key_value_heads=4),  # no rotary keys
    "esmc": dict(num_key_value_heads=4),                    # no grouped-query attention
    "falcon_h1": dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16),
    "hunyuan_vl_text": dict(head_dim=8),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "deepseek_ocr2_text": dict(mlp_layer_types=["dense", "sparse"]),
    "t5gemma2_text": dict(dropout_rate=0.0),
    "t5gemma2_decoder": dict(dropout_rate=0.0),
}


def architectures() -> list:
    """The model types of transformers whose config declares a ``base_model_tp_plan``."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return sorted(t for t in CONFIG_MAPPING_NAMES if getattr(CONFIG_MAPPING[t], "base_model_tp_plan", None))


def _per_layer(values: list, n: int) -> list:
    """A per-layer list cut to ``n`` layers: each kind it holds once, in order, then repeats."""
    kinds = list({repr(v): v for v in values}.values())
    return (kinds * n)[:n] if len(kinds) < n else kinds[:n]


def _mrope(sections: list, total: int) -> list:
    """M-RoPE sections rescaled to sum to ``total`` (each at least 1)."""
    scaled = [max(1, s * total // sum(sections)) for s in sections]
    scaled[0] += total - sum(scaled)
    return scaled


def tiny_config(config_cls, name: str = "", **overrides):
    """``config_cls`` with its sizes shrunk (see the module docstring), then ``overrides``."""
    from transformers import PretrainedConfig

    default = config_cls()
    given = default.to_dict()
    layers = given.get("num_hidden_layers") or given.get("num_layers")
    kw = {}
    for key, value in given.items():
        if key in SIZES and not isinstance(value, bool) and (
                isinstance(value, int) or value is None and key not in OPTIONAL):
            kw[key] = SIZES[key]
        elif isinstance(value, list) and layers and len(value) == layers:
            kw[key] = _per_layer(value, 2)
        elif isinstance(value, list) and key.endswith(("layers", "layer_ids")) and all(
                isinstance(v, int) and not isinstance(v, bool) for v in value):
            kw[key] = [v for v in value if v < 2]
        elif isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
            kw[key] = {k: v for k, v in value.items() if int(k) < 2}  # per layer index
    for key in TOKENS:
        if isinstance(given.get(key), int) and given[key] >= SIZES["vocab_size"]:
            kw[key] = 1
        elif isinstance(given.get(key), list):
            kw[key] = [1]
    for key, sub in (getattr(config_cls, "sub_configs", None) or {}).items():
        if isinstance(getattr(default, key, None), PretrainedConfig):
            kw[key] = tiny_config(type(getattr(default, key)))
    if "kv_lora_rank" in given:  # latent attention: every head reads the one latent
        if "num_key_value_heads" in given:
            kw["num_key_value_heads"] = kw["num_attention_heads"]
        if "head_dim" in given:
            kw["head_dim"] = kw["qk_rope_head_dim"]
    rope = given.get("rope_parameters")
    if isinstance(rope, dict):
        rotary = kw.get("qk_rope_head_dim") or kw.get("head_dim") or 8
        kw["rope_parameters"] = {k: (dict(v, mrope_section=_mrope(v["mrope_section"], rotary // 2))
                                     if isinstance(v, dict) and "mrope_section" in v else v)
                                 for k, v in rope.items()}
        if "mrope_section" in rope:
            kw["rope_parameters"]["mrope_section"] = _mrope(rope["mrope_section"], rotary // 2)
    if "initializer_range" in given:
        kw["initializer_range"] = 0.1
    kw["use_cache"] = False
    kw.update(OVERRIDES.get(name, {}), **overrides)
    return config_cls(**kw)


def model_class(config_cls):
    """The causal LM of ``config_cls`` if it has one, else its base model (the auto
    mappings, then the modeling module's classes that name it their ``config_class``)."""
    from transformers import PreTrainedModel
    from transformers.models.auto import modeling_auto

    for mapping in (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING, modeling_auto.MODEL_MAPPING):
        try:
            return mapping[config_cls]
        except KeyError:
            pass
    module = importlib.import_module(config_cls.__module__.replace(".configuration_", ".modeling_"))
    found = [c for _, c in inspect.getmembers(module, inspect.isclass)
             if issubclass(c, PreTrainedModel) and c.__dict__.get("config_class") is config_cls]
    for suffix in ("ForCausalLM", "Model"):
        for c in found:
            if c.__name__.endswith(suffix):
                return c
    return found[0] if found else None


class Skip(Exception):
    """A model the sweep cannot run on token ids, with the reason."""


def _unbuilt(name: str, exc: BaseException) -> str:
    """Why a tiny model does not run on one device: transformers' own default config does
    not build (on the meta device), or the shrunk sizes do not fit it."""
    from transformers import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[name]
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model_class(config_cls)(config_cls())
    except Exception as default:  # noqa: BLE001
        return f"its default config does not build in transformers: {_why(default)}"
    return f"the tiny config fails on one device: {_why(exc)}"


# Models that take embeddings where their signature offers ids too.
EMBEDDINGS = ("qwen3_omni_moe_talker_code_predictor",)


def _inputs(model: nn.Module, config, name: str) -> dict:
    """Token ids (2 x 8), or embeddings where the model takes no ids; Skip for a model
    that needs other inputs (pixels, audio)."""
    params = inspect.signature(model.forward).parameters
    required = [n for n, p in params.items() if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n != "self"]
    gen = torch.Generator().manual_seed(1)
    if name in EMBEDDINGS:
        return {"inputs_embeds": torch.randn(2, 8, config.hidden_size, generator=gen)}
    if "input_ids" in params and not required or required == ["input_ids"]:
        return {"input_ids": torch.randint(0, SIZES["vocab_size"], (2, 8), generator=gen)}
    if "inputs_embeds" in params and required in ([], ["inputs_embeds"]):
        return {"inputs_embeds": torch.randn(2, 8, config.hidden_size, generator=gen)}
    raise Skip(f"takes {', '.join(required)}, not token ids (a vision or audio encoder)")


def build(name: str, **overrides):
    """``(model, inputs)``: the tiny model of model type ``name`` (its config's sizes shrunk,
    then ``overrides``), seeded, in eval mode."""
    from transformers import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[name]
    config = tiny_config(config_cls, name, **overrides)
    cls = model_class(config_cls)
    if cls is None:
        raise Skip("no model class names this config")
    with torch.device("meta"):
        size = sum(p.numel() for p in cls(config).parameters())
    if size > 4_000_000:
        raise Skip(f"its config does not shrink ({size / 1e6:.0f}M parameters at the tiny sizes)")
    torch.manual_seed(0)
    model = cls(config).eval()  # no dropout, no router noise: one device's numbers are fixed
    return model, _inputs(model, config, name)


def _output(out) -> torch.Tensor:
    for key in ("logits", "last_hidden_state"):
        value = getattr(out, key, None)
        if isinstance(value, torch.Tensor):
            return value
    return out[0] if isinstance(out, (tuple, list)) else out


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def step(model: nn.Module, inputs: dict, cotangent) -> torch.Tensor:
    torch.manual_seed(0)  # a forward that draws (a diffusion model's noise) draws alike on every run
    y = _full(_output(model(**inputs)))
    c = cotangent(y)
    (y * c).sum().backward()
    return y.detach()


def _error(a, b, floor: float = 0.0) -> float:
    """``||a - b|| / ||b||`` (``a`` put together if a DTensor), with ``||b||`` at least
    ``floor`` per element; inf where ``a`` is missing or shaped otherwise."""
    if a is None or a.shape != b.shape:
        return float("inf")
    a, b = _full(a).detach().double(), b.detach().double()
    norm = max(b.norm().item(), floor * b.numel() ** 0.5)
    diff = (a - b).norm().item()
    e = diff / norm if norm > 0 else (0.0 if diff == 0 else float("inf"))
    return e if e == e else float("inf")


def _floor(ref: nn.Module) -> float:
    """1e-3 of the root-mean-square gradient of ``ref``: what a gradient that is zero up to
    rounding (a key's bias, under a softmax) is measured against, as ``tpfn.verify`` does."""
    grads = [p.grad.double() for p in ref.parameters() if p.grad is not None]
    numel = sum(g.numel() for g in grads)
    return 1e-3 * (sum(g.square().sum().item() for g in grads) / numel) ** 0.5 if numel else 0.0


def errors(model: nn.Module, ref: nn.Module, y, expected) -> dict:
    """``{"output": error, "grads": {parameter: error}}`` of ``model`` against one device."""
    floor, mine = _floor(ref), dict(model.named_parameters())
    return {"output": _error(y, expected),
            "grads": {n: _error(mine[n].grad, p.grad, floor)
                      for n, p in ref.named_parameters() if p.grad is not None}}


def _partial_sums(model: nn.Module, ref: nn.Module) -> list:
    """The replicated parameters of ``model`` whose gradient differs from one device's on
    this rank while the sum over the ranks equals it: each rank's covers only its shard of
    the activations, and the plan lacks the rule that sums them. Collective: every rank."""
    import torch.distributed as dist

    floor, expected = _floor(ref), dict(ref.named_parameters())
    found = []
    for name, p in model.named_parameters():
        if p.grad is None or isinstance(p, DTensor) and not all(x.is_replicate() for x in p.placements):
            continue
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        total = local.detach().clone()
        dist.all_reduce(total)
        want = expected[name].grad
        if _error(local, want, floor) > TOLERANCE and _error(total, want, floor) <= TOLERANCE:
            found.append(name)
    return found


def _rounding(model: nn.Module, inputs: dict, cotangent, y, ref: nn.Module) -> float | None:
    """How far one device's float32 output and gradients lie from a float64 run of the same
    model (the largest relative error; None where the model does not run in float64)."""
    exact = copy.deepcopy(model).double()
    for sub in exact.modules():  # grouped_mm takes no float64: the experts' plain loop
        if hasattr(getattr(sub, "config", None), "_experts_implementation"):
            sub.config._experts_implementation = "eager"
    try:
        y64 = step(exact, inputs, lambda t: cotangent(t.float()).double())
    except Exception:  # noqa: BLE001 - a float32-only model keeps the plain tolerance
        return None
    found = errors(ref, exact, y, y64)
    return max([found["output"], *found["grads"].values()])


def with_transformers(model: nn.Module, mesh) -> nn.Module:
    """transformers' own tensor parallelism with ``model``'s weights, as
    ``from_pretrained(tp_plan="auto")`` runs it: the model built with its weights untied, its
    plan resolved for ``mesh``'s size and applied (``apply_tensor_parallelism``), then each
    rank's slice of every weight loaded and the weights tied."""
    from torch.distributed.tensor import distribute_tensor
    from transformers import initialization
    from transformers.distributed.configuration_utils import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    with initialization.no_tie_weights():
        fresh = type(model)(copy.deepcopy(model.config)).eval()
    tp_plan, _, _ = fresh._resolve_parallel_plans(DistributedConfig(tp_size=mesh.size()))
    fresh = apply_tensor_parallelism(fresh, mesh, tp_plan)
    weights = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, p in fresh.named_parameters(remove_duplicate=False):
            value = weights[name]
            if isinstance(p, DTensor):
                value = distribute_tensor(value, mesh, p.placements, src_data_rank=None).to_local()
                p = p.to_local()
            p.copy_(value)
    fresh.tie_weights()
    return fresh


def with_tpfn(model: nn.Module, mesh, tp_plan: dict | None = None) -> nn.Module:
    import tpfn

    plan = tpfn.from_hf(model.tp_plan if tp_plan is None else tp_plan, model)
    return tpfn.parallelize(model, mesh, plan, src_rank=None)


def _why(exc: BaseException) -> str:
    """The exception's type and first line (a ``PlanError``'s first problem), cut at 200."""
    problems = getattr(exc, "problems", None)
    text = problems or str(exc).strip().splitlines() or [""]
    why = f"{type(exc).__name__}: {text[0]}"
    return why if len(why) <= 200 else why[:199] + "…"


def _run(parallel, model: nn.Module, mesh, inputs: dict, cotangent, ref, expected) -> tuple:
    """(``{"output", "grads"}`` or ``{"error"}``, the parallel model or None)."""
    try:
        tp = parallel(copy.deepcopy(model), mesh)
        return errors(tp, ref, step(tp, inputs, cotangent), expected), tp
    except Exception as e:  # noqa: BLE001 - reported in the table
        return {"error": _why(e)}, None


def _agreed(flag: bool) -> bool:
    """``flag`` on any rank (so that every rank takes the same collectives next)."""
    import torch.distributed as dist

    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def outcome(name: str, mesh) -> dict:
    """One architecture on this rank: ``{"name", "model", "skip", "rounding", "tpfn", "hf"}``.

    ``"tpfn"`` and ``"hf"`` are ``{"output": error, "grads": {name: error}}`` or
    ``{"error": why}``; where tpfn's run is off, ``"partial"`` lists its replicated
    parameters whose gradients are partial sums (``_partial_sums``) and ``"fixed"`` is the
    run of the model's plan with ``replicated_with_grad_allreduce`` on their modules.
    ``"rounding"``: one device's own float32 error (``_rounding``), measured where a run is
    off by more than ``TOLERANCE / ROUNDING`` and less than 1e-2 (whether a run lies just
    under ``TOLERANCE`` or just over it depends on the CPU's kernels; its rounding does not)."""
    from tpfn._fqn import generalize

    found = {"name": name, "model": None, "skip": None, "rounding": None}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, inputs = build(name)
        found["model"] = type(model).__name__
        gen = torch.Generator().manual_seed(2)
        made = {}

        def cotangent(y):  # the same random cotangent in every run
            if tuple(y.shape) not in made:
                made[tuple(y.shape)] = torch.randn(y.shape, generator=gen, dtype=y.dtype)
            return made[tuple(y.shape)]

        ref = copy.deepcopy(model)
        expected = step(ref, inputs, cotangent)
    except Skip as e:
        found["skip"] = str(e)
        return found
    except Exception as e:  # noqa: BLE001 - what fails on one device is the row's note
        found["skip"] = _unbuilt(name, e)
        return found
    found["tpfn"], tp = _run(with_tpfn, model, mesh, inputs, cotangent, ref, expected)
    if _agreed(tp is not None and not at_parity(found["tpfn"])):
        partial = found["tpfn"]["partial"] = _partial_sums(tp, ref)
        if partial:
            rules = {generalize(n.rpartition(".")[0]): "replicated_with_grad_allreduce" for n in partial}
            fix = functools.partial(with_tpfn, tp_plan={**model.tp_plan, **rules})
            found["tpfn"]["fixed"] = {"rules": rules, **_run(fix, model, mesh, inputs, cotangent,
                                                             ref, expected)[0]}
    found["hf"], _ = _run(with_transformers, model, mesh, inputs, cotangent, ref, expected)
    runs = [found["tpfn"], found["hf"], found["tpfn"].get("fixed")]
    if any(r and "error" not in r and TOLERANCE / ROUNDING < _worst(r)[1] < 1e-2 for r in runs):
        found["rounding"] = _rounding(model, inputs, cotangent, expected, ref)
    return found


@functools.cache
def quiet():
    import transformers

    transformers.logging.set_verbosity_error()


def outcomes(names: list) -> list:
    """``outcome`` of each architecture on this rank's 2-rank mesh (run on every rank)."""
    from tests.ranks import mesh

    quiet()
    return [outcome(name, mesh(2)) for name in names]


ROUNDING = 10
"""A model whose one-device float32 numbers lie further than ``TOLERANCE / ROUNDING`` from
its float64 ones (an ill-conditioned gradient: DeepSeek-V4's hyper-connections, 20 Sinkhorn
steps) is at parity within ``ROUNDING`` times that deviation: another order of the same
float32 sums moves a number by a few times one order's own error."""


def tolerance(found: dict) -> float:
    """The bar for one architecture's runs (``TOLERANCE``, or its rounding's, see ``ROUNDING``)."""
    return max(TOLERANCE, ROUNDING * (found.get("rounding") or 0.0))


def at_parity(run: dict | None, tolerance: float = TOLERANCE) -> bool:
    """Whether a run's output and every gradient agree with one device."""
    return bool(run) and "error" not in run and _worst(run)[1] <= tolerance


def _worst(run: dict) -> tuple:
    return max([("output", run["output"]), *run["grads"].items()], key=lambda kv: kv[1])


def worst(run: dict) -> str:
    """The largest error of a run and where: ``"2.1e-01 model.layers.0.self_attn.q_norm.weight"``."""
    if "error" in run:
        return run["error"]
    where, err = _worst(run)
    return f"{err:.1e} {where}"


# Why a model is off where the plan, not tpfn, is at fault: what each run shows, checked
# with tpfn.verify (the first module that diverges, or the one that raises).
WHY = {
    "doge": "its dynamic attention mask comes from `dt_proj` (rowwise: every head on every rank) "
            "and meets the rank's local heads (2 of 4)",
    "esmc": "`q_norm`/`k_norm` are LayerNorms over all of q's and k's features, which `colwise` "
            "q_proj and k_proj leave sharded",
    "gemma3n_text": "its MLP's activation sparsity takes the mean and standard deviation of the "
                    "intermediate features, which `colwise` gate_proj and up_proj leave sharded",
    "inkling2_text": "its plan shards the experts' packed `gate_up_proj` with `colwise` (one "
                     "half of the gate and up columns each) where the experts chunk it in two: "
                     "`packed_colwise` is the string for it",
    "inkling2_loop_text": "as inkling2_text: `colwise` on the experts' packed `gate_up_proj`",
    "inkling_text": "its embedding normalizes the lookup inside its own forward, where the "
                    "vocabulary-parallel lookup is still a partial sum (DTensor refuses the norm)",
    "muse_glimmer_text": "as inkling_text: a norm inside the vocabulary-parallel embedding's forward",
    "muse_spark_text": "as inkling_text: a norm inside the vocabulary-parallel embedding's forward",
    "t5gemma2_text": "its scaled embedding writes a plain tensor into its vocabulary-parallel "
                     "lookup (`index_put_`) inside its own forward",
    "glm5_next_text": "its plan's `layers.*.self_attn.o_proj: rowwise` takes the o_proj of its "
                      "linear-attention layers too, whose inputs nothing in the plan shards",
    "neomme": "its exclusive self-attention's per-head `alpha` (one per head of the model) "
              "meets the rank's local heads; sharded with them by hand, "
              "`params(alpha=Shard(0)) >> on_shards()`, it would fit",
    "llama4_text": "transformers' own TP hands on the shared expert's row-wise output as "
                   "`DTensor.to_local()`, a view, which the MoE then adds to in place (`out.add_`)",
}


def _cell(run: dict | None, bar: float) -> str:
    if not run:
        return "-"
    return "yes" if at_parity(run, bar) else "no"


def row(found: dict) -> tuple:
    """``(architecture, builds, tpfn at parity, transformers' TP at parity, notes)``."""
    name = f"`{found['name']}`" + (f" ({found['model']})" if found.get("model") else "")
    if found["skip"]:
        built = "skipped" if "not token ids" in found["skip"] else "no"
        return name, built, "-", "-", found["skip"]
    bar = tolerance(found)
    mine, theirs = found["tpfn"], found["hf"]
    notes = []
    if "error" in mine:
        notes.append(f"tpfn: {mine['error']}")
    elif mine.get("fixed"):
        rules = ", ".join(f"`{k}`" for k in mine["fixed"]["rules"])
        ok = "at parity" if at_parity(mine["fixed"], bar) else f"still off ({worst(mine['fixed'])})"
        notes.append(f"the plan lacks `replicated_with_grad_allreduce` on {rules}: the gradients "
                     "of their replicated parameters are partial sums over the ranks (`tpfn.verify` "
                     f"names the rule); with it added, tpfn is {ok}")
    elif not at_parity(mine, bar):
        notes.append(f"tpfn off by {worst(mine)}")
    if found["name"] in WHY and not (at_parity(mine, bar) and at_parity(theirs, bar)):
        notes.append(WHY[found["name"]])
    if "error" in theirs and theirs["error"] != mine.get("error"):
        notes.append(f"transformers' TP: {theirs['error']}")
    elif "error" not in theirs and not at_parity(theirs, bar) and not mine.get("fixed"):
        notes.append(f"transformers' TP off by {worst(theirs)}")
    if found.get("rounding") and bar > TOLERANCE:
        notes.append(f"one device's float32 lies {found['rounding']:.0e} from float64: the bar is "
                     f"{bar:.0e} (`ROUNDING` in tests/hf_zoo.py)")
    return name, "yes", _cell(mine, bar), _cell(theirs, bar), "; ".join(notes)


def table(found: list) -> str:
    """The markdown table of docs/huggingface.md, one row per architecture."""
    lines = ["| architecture | builds | tpfn at parity | transformers' own TP at parity | notes |",
             "|---|---|---|---|---|"]
    for f in found:
        cells = [c.replace("|", "\\|").replace("\n", " ") for c in row(f)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rewrite(path: str, marker: str, body: str) -> None:
    """Put ``body`` between ``<!-- table:marker -->`` and ``<!-- /table -->`` in the page at
    ``path`` (the sweeps' tables)."""
    import re

    with open(path) as f:
        text = f.read()
    pattern = rf"<!-- table:{marker} -->.*?<!-- /table -->"
    if not re.search(pattern, text, flags=re.S):
        raise SystemExit(f"{path} has no place for the {marker} table")
    with open(path, "w") as f:
        f.write(re.sub(pattern, lambda _: f"<!-- table:{marker} -->\n{body}\n<!-- /table -->", text, flags=re.S))


def rows(path, marker: str) -> dict:
    """The table ``rewrite`` put at ``marker`` in the page at ``path``, read back: ``{model
    type: the cells after its first}`` (the first cell names it in backticks)."""
    import re

    text = re.search(rf"<!-- table:{marker} -->(.*?)<!-- /table -->", open(path).read(), flags=re.S).group(1)
    found = {}
    for line in text.splitlines():
        m = re.match(r"\| `([\w-]+)`[^|]*\|(.*)\|$", line)
        if m:
            found[m.group(1)] = [cell.strip() for cell in m.group(2).split(" | ")]
    return found
