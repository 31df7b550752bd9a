"""Hand-written tpfn plans for transformers models, the reference plans ``tpfn.suggest`` is held to.

GPT-2, BERT, T5, OPT and BLOOM declare no tensor-parallel plan in transformers; Llama does, and
its plan here is the one ``from_hf`` derives from it (its embedding, which has a padding index,
spelled ``rowwise()``). Each plan is the Megatron pairing, written with
the language alone (no hooks, nothing patched onto the modules):

- q, k and v column-wise by heads, the output projection row-wise; the MLP's first layer
  column-wise, its second row-wise; one local replica per module whose several column-wise
  children read it (``prepare_in(Replicate(), local=True)``), so their input gradients are
  reduced once;
- the attention's global sizes held per rank (``per_rank``): GPT-2's ``split_size``, OPT's
  and BLOOM's ``num_heads``, T5's ``n_heads``, BERT's head count, Llama's query heads per KV head;
- GPT-2's ``Conv1D`` projections take ``colwise()`` / ``rowwise()`` like linears (q, k, v
  packed: ``colwise(parts=3)``); BLOOM's ALiBi biases, laid out per head, are sliced to the
  rank's heads (``per_rank(inputs={"alibi": heads})``); T5's relative position bias, an
  embedding with one column per head, is column-wise; Llama's KV heads are replicated over
  groups of ranks where there are more ranks than KV heads (``colwise(heads=...)``);
- the vocabulary-parallel embeddings row-wise, the tied head column-wise and gathered.

``build(name)`` makes the tiny model (``SIZES``: 2 layers, hidden 32, 4 heads of 8, Llama with 2
KV heads, vocabulary 64, no dropout) in float64, seeded, and its inputs; ``PLANS[name]`` is its
plan; ``minimum(name, n)`` the collectives of one forward and one backward at the Megatron
minimum on ``n`` ranks. ``tests/test_hf_plans.py`` holds each plan to one device at 2 and 4 ranks.
"""

from __future__ import annotations

import torch

from tpfn import Replicate, colwise, per_rank, plan, prepare_in, prepare_out, rowwise

__all__ = ["PLANS", "NAMES", "SIZES", "build", "minimum", "layers"]

SIZES = dict(hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=64, layers=2, vocab=64, positions=32)

_SHARED = prepare_in(Replicate(), local=True)  # one local replica for several column-wise readers
_HEAD = colwise() >> prepare_out(Replicate())   # the tied head: its logits gathered

H = SIZES["heads"]

PLANS = {
    "gpt2": plan({
        "transformer.wte": rowwise(),
        "transformer.h.*.attn": per_rank("num_heads", "split_size"),
        "transformer.h.*.attn.c_attn": colwise(parts=3),   # Conv1D: q, k and v packed
        "transformer.h.*.attn.c_proj": rowwise(),
        "transformer.h.*.mlp.c_fc": colwise(),
        "transformer.h.*.mlp.c_proj": rowwise(),
        "lm_head": _HEAD,
    }),
    "bert": plan({
        "bert.embeddings.word_embeddings": rowwise(),
        "bert.encoder.layer.*.attention.self": _SHARED >> per_rank("num_attention_heads", "all_head_size"),
        "bert.encoder.layer.*.attention.self.query": colwise(),
        "bert.encoder.layer.*.attention.self.key": colwise(),
        "bert.encoder.layer.*.attention.self.value": colwise(),
        "bert.encoder.layer.*.attention.output.dense": rowwise(),
        "bert.encoder.layer.*.intermediate.dense": colwise(),
        "bert.encoder.layer.*.output.dense": rowwise(),
        "cls.predictions.decoder": _HEAD,
    }),
    "t5": plan({
        "encoder.embed_tokens": rowwise(),                    # tied to the decoder's and the head
        "decoder.embed_tokens": rowwise(),
        "*.block.*.layer.0.SelfAttention": _SHARED >> per_rank("n_heads", "inner_dim"),
        "*.block.*.layer.0.SelfAttention.[qkv]": colwise(),
        "*.block.*.layer.0.SelfAttention.o": rowwise(),
        "*.block.0.layer.0.SelfAttention.relative_attention_bias": colwise(),  # a column per head
        # q reads the decoder's states, k and v the encoder's: two replicas, one reduction each
        "decoder.block.*.layer.1.EncDecAttention": prepare_in(
            Replicate(), kwargs={"key_value_states": Replicate()}, local=True) >> per_rank("n_heads", "inner_dim"),
        "decoder.block.*.layer.1.EncDecAttention.[qkv]": colwise(),
        "decoder.block.*.layer.1.EncDecAttention.o": rowwise(),
        "*.block.*.layer.*.DenseReluDense.wi": colwise(),
        "*.block.*.layer.*.DenseReluDense.wo": rowwise(),
        "lm_head": _HEAD,
    }),
    "opt": plan({
        "model.decoder.embed_tokens": rowwise(),
        "model.decoder.layers.*.self_attn": _SHARED >> per_rank("num_heads"),
        "model.decoder.layers.*.self_attn.[qkv]_proj": colwise(),
        "model.decoder.layers.*.self_attn.out_proj": rowwise(),
        "model.decoder.layers.*.fc1": colwise(),
        "model.decoder.layers.*.fc2": rowwise(),
        "lm_head": _HEAD,
    }),
    "bloom": plan({
        "transformer.word_embeddings": rowwise(),
        # q, k and v of each head side by side: plain column-wise shards hold whole heads
        "transformer.h.*.self_attention": per_rank("num_heads", inputs={"alibi": H}),
        "transformer.h.*.self_attention.query_key_value": colwise(),
        "transformer.h.*.self_attention.dense": rowwise(),
        "transformer.h.*.mlp.dense_h_to_4h": colwise(),
        "transformer.h.*.mlp.dense_4h_to_h": rowwise(),
        "lm_head": _HEAD,
    }),
    "llama": plan({
        "model.embed_tokens": rowwise(),
        "model.layers.*.self_attn": _SHARED >> per_rank("num_key_value_groups", per_head=SIZES["kv_heads"]),
        "model.layers.*.self_attn.q_proj": colwise(),
        "model.layers.*.self_attn.[kv]_proj": colwise(heads=SIZES["kv_heads"]),
        "model.layers.*.self_attn.o_proj": rowwise(),
        "model.layers.*.mlp": _SHARED,
        "model.layers.*.mlp.gate_proj": colwise(),
        "model.layers.*.mlp.up_proj": colwise(),
        "model.layers.*.mlp.down_proj": rowwise(),
        "lm_head": _HEAD,
    }),
}
NAMES = tuple(PLANS)


def _config(name: str):
    import transformers as hf

    s = SIZES
    common = dict(vocab_size=s["vocab"], use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if name == "gpt2":
        return hf.GPT2LMHeadModel, hf.GPT2Config(
            n_embd=s["hidden"], n_layer=s["layers"], n_head=H, n_positions=s["positions"],
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
    if name == "bert":
        return hf.BertForMaskedLM, hf.BertConfig(
            hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=H,
            intermediate_size=s["ffn"], max_position_embeddings=s["positions"], hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, **common)
    if name == "t5":
        return hf.T5ForConditionalGeneration, hf.T5Config(
            d_model=s["hidden"], d_kv=s["head_dim"], d_ff=s["ffn"], num_layers=s["layers"], num_heads=H,
            dropout_rate=0.0, decoder_start_token_id=0, **common)
    if name == "opt":
        return hf.OPTForCausalLM, hf.OPTConfig(
            hidden_size=s["hidden"], word_embed_proj_dim=s["hidden"], num_hidden_layers=s["layers"],
            ffn_dim=s["ffn"], num_attention_heads=H, max_position_embeddings=s["positions"], dropout=0.0,
            attention_dropout=0.0, **common)
    if name == "bloom":
        return hf.BloomForCausalLM, hf.BloomConfig(
            hidden_size=s["hidden"], n_layer=s["layers"], n_head=H, hidden_dropout=0.0,
            attention_dropout=0.0, **common)
    if name == "llama":
        return hf.LlamaForCausalLM, hf.LlamaConfig(
            hidden_size=s["hidden"], intermediate_size=s["ffn"], num_hidden_layers=s["layers"],
            num_attention_heads=H, num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
            max_position_embeddings=s["positions"], **common)
    raise KeyError(f"no tiny {name!r}; these: {', '.join(NAMES)}")


def build(name: str, seed: int = 0) -> tuple:
    """``(model, inputs)``: the tiny ``name`` in float64, the same on every rank, and the
    keyword inputs of one forward (token ids, 2 x 8; T5's decoder its own 2 x 5)."""
    cls, config = _config(name)
    torch.manual_seed(seed)
    model = cls(config).double()
    ids = torch.randint(1, SIZES["vocab"], (2, 8), generator=torch.Generator().manual_seed(seed + 1))
    inputs = {"input_ids": ids}
    if name == "t5":
        inputs["decoder_input_ids"] = torch.randint(1, SIZES["vocab"], (2, 5),
                                                    generator=torch.Generator().manual_seed(seed + 2))
    return model, inputs


def layers(name: str) -> int:
    """The attention and MLP blocks one forward runs through (T5: the decoder's cross-attention too)."""
    return SIZES["layers"] * (5 if name == "t5" else 2)   # t5: 2 encoder + 3 decoder per layer


def minimum(name: str, n: int) -> tuple:
    """``(forward, backward)`` collective counts of one forward and backward of ``build(name)``
    under ``PLANS[name]`` on ``n`` ranks: the Megatron minimum. Forward: one all-reduce per
    attention and per MLP, one per vocabulary-parallel embedding (T5: the encoder's and the
    decoder's), the head's gather. Backward: one all-reduce per shared replica (an attention's,
    T5's cross-attention's two, an MLP's first layer's input) and the head's input gradient;
    where Llama's KV heads are replicated, one more at the end, summing their copies' gradients."""
    embeddings = 2 if name == "t5" else 1
    forward = {"all_reduce": layers(name) + embeddings, "all_gather": 1}
    cross = SIZES["layers"] if name == "t5" else 0   # k and v read a second replica
    kv = 1 if name == "llama" and n > SIZES["kv_heads"] else 0
    return forward, {"all_reduce": layers(name) + cross + 1 + kv}
