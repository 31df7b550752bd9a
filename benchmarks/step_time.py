"""Step time: forward, backward and an Adam step, tpfn vs native TP with the same plan.

2 gloo ranks. PyTorch's reference Transformer and a Hugging Face Llama, with and without
sequence parallelism. Three variants per model, stepped in turn on the same batches:
native TP with PyTorch's plan; tpfn with the very same plan (``tpfn.from_torch``); tpfn
with its recommended plan (the Megatron minimum: q, k, v and gate, up share one annotated
input). The ratio of median step times is what to read.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.common import Table

VOCAB, BATCH, SEQ = 2048, 8, 64


def _reference(sp: bool):
    from tests.models import native_transformer_plan, transformer, transformer_plan

    def build():
        return transformer(vocab_size=VOCAB, dim=256, n_heads=8, n_layers=4, max_seq_len=SEQ,
                           weight_tying=False)
    return build, native_transformer_plan(sp), transformer_plan(sp)


def _llama(sp: bool):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
    )
    from transformers import LlamaConfig, LlamaForCausalLM

    import tpfn

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=SEQ, tie_word_embeddings=False)

    def build():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        model.config._attn_implementation = "sdpa"
        return model

    seq = Shard(1) if sp else Replicate()
    layer = "model.layers.*."
    # With sequence parallelism the residual stream stays in DTensors: Llama computes its
    # positions and mask from the embeddings' sequence length, which must be the global one.
    native = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq,
                                              use_local_output=not sp),
        **{layer + f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
        layer + "self_attn.o_proj": RowwiseParallel(output_layouts=seq, use_local_output=not sp),
        **{layer + f"mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")},
        layer + "mlp.down_proj": RowwiseParallel(output_layouts=seq, use_local_output=not sp),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }
    if sp:
        native.update({
            "model.norm": SequenceParallel(),
            layer + "input_layernorm": SequenceParallel(),
            layer + "post_attention_layernorm": SequenceParallel(),
            # the decoder layer passes hidden_states to attention by keyword
            layer + "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                    desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            layer + "mlp": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
        })
        recommended = tpfn.from_torch(native)  # already shares one input per attention and MLP
    else:
        recommended = None  # from_hf(model.tp_plan, model), built with the model
    return build, native, recommended


def _steps(model_name: str, sp: bool, steps: int) -> dict:
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.distributed.tensor.parallel import parallelize_module

    import tpfn
    from tests.models import local_heads
    from tests.ranks import mesh

    torch.set_num_threads(1)
    m = mesh(2)
    build, native_plan, recommended = (_reference if model_name == "reference" else _llama)(sp)
    models = {
        "native": parallelize_module(build(), m, native_plan),
        "tpfn, same plan": tpfn.parallelize(build(), m, tpfn.from_torch(native_plan)),
    }
    best = build()
    models["tpfn, recommended plan"] = tpfn.parallelize(
        best, m, recommended if recommended is not None else tpfn.from_hf(best.tp_plan, best))
    if model_name == "reference":
        for model in models.values():
            local_heads(model, 2)
    optimizers = {k: torch.optim.Adam(v.parameters(), lr=1e-4) for k, v in models.items()}
    gen = torch.Generator().manual_seed(0)
    times: dict = {k: [] for k in models}
    losses: dict = {k: [] for k in models}
    for step in range(steps + 3):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        target = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        order = list(models)
        order = order[step % 3:] + order[:step % 3]  # rotate who goes first
        for name in order:
            model, opt = models[name], optimizers[name]
            torch.distributed.barrier()
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            logits = model(tokens)
            logits = getattr(logits, "logits", logits)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())
            loss.backward()
            with implicit_replication():
                opt.step()
            elapsed = time.perf_counter() - start
            if step >= 3:  # warm-up steps not counted
                times[name].append(elapsed)
                losses[name].append(loss.item())
    return {k: (statistics.median(v), losses[k]) for k, v in times.items()}


def run(quick: bool = False) -> Table:
    from tests.ranks import Ranks

    table = Table("step_time", "Step time (forward, backward, Adam), 2 gloo ranks",
                  ["model", "sequence parallel", "native ms", "tpfn same plan ms",
                   "tpfn recommended ms", "same / native", "recommended / native"])
    steps = 5 if quick else 15
    with Ranks(2) as ranks:
        for model in ("reference", "llama"):
            for sp in (False, True):
                result = ranks.run(_steps, model, sp, steps)[0]
                native, same, best = (result[k][0] * 1e3 for k in (
                    "native", "tpfn, same plan", "tpfn, recommended plan"))
                table.add("PyTorch reference Transformer" if model == "reference" else "HF Llama",
                          "on" if sp else "off", native, same, best, same / native, best / native)
                gap = max(abs(a - b) / abs(b) for a, b in zip(result["tpfn, same plan"][1],
                                                              result["native"][1]))
                table.target(f"{model}, sp {'on' if sp else 'off'}: tpfn/native <= 1.00 "
                             f"(losses agree to {gap:.0e})", best / native <= 1.0)
    table.notes.append("dim 256, 4 layers, 8 heads, vocab 2048, batch 8 x 64 tokens; medians of "
                       f"{steps} steps per variant, stepped in turn")
    return table


if __name__ == "__main__":
    print(run().text())
