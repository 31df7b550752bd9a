"""The Llama-3-70B shape on fake ranks: collectives of transformers' plan, and explain's speed.

80 layers, hidden 8192, FFN 28672, vocab 128256, 64 heads, 8 KV heads, built on the meta
device, one sequence of 4096 tokens. Native: PyTorch's TP running transformers' own plan
(``model.tp_plan`` in PyTorch's styles), parallelized and run forward + backward by hand on
a fake process group of 8 ranks. tpfn: ``explain`` with ``from_hf``'s plan, report
included, at 8 to 1024 ranks; the bytes of the blocks against the Megatron formula. Its 8
KV heads stop at 8 ranks, so the same shape with 64 KV heads runs at 8 to 64 ranks too.
"""

from __future__ import annotations

import time

import torch

from benchmarks.common import Table

SEQ = 4096


def _model(kv_heads: int = 8):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                         num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=kv_heads,
                         max_position_embeddings=SEQ, tie_word_embeddings=False)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def _native_plan(tp_plan: dict) -> dict:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel(),
              "embedding_rowwise": RowwiseParallel(input_layouts=Replicate()),
              "colwise_gather_output": ColwiseParallel(output_layouts=Replicate())}
    return {k: styles[v] for k, v in tp_plan.items()}


def _native(world_size: int):
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import parallelize_module

    import tpfn
    from tpfn.dryrun import fake_mesh

    model = _model()
    start = time.perf_counter()
    parallelize_module(model, fake_mesh(world_size), _native_plan(model.tp_plan), src_data_rank=None)
    parallelized = time.perf_counter()
    with CommDebugMode() as mode:
        tokens = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
        model(input_ids=tokens).logits.float().sum().backward()
    return parallelized - start, time.perf_counter() - parallelized, tpfn.trace.counts(mode)


def _explain(world_size: int, inputs: bool, kv_heads: int = 8):
    """(seconds, the report or the PlanError's first line)."""
    import tpfn

    model = _model(kv_heads)
    plan = tpfn.from_hf(model.tp_plan, model)
    start = time.perf_counter()
    try:
        report = tpfn.explain(model, plan, world_size=world_size,
                              example_inputs=(1, SEQ) if inputs else None)
        str(report)
    except tpfn.PlanError as e:  # the plan cannot run: the lint that says why
        report = next((p for p in e.problems if "fewer heads" in p), e.problems[0])
    return time.perf_counter() - start, report


def run(quick: bool = False) -> Table:
    table = Table("llama70b", "Llama-3-70B shape on fake ranks: communication and dry-run time",
                  ["ranks", "KV heads", "native parallelize s", "native fwd+bwd s",
                   "native all-reduces", "explain, layouts only s", "explain, fwd+bwd s",
                   "tpfn all-reduces", "block bytes / Megatron"])
    sizes = [(8, 8), (64, 64)] if quick else [(8, 8), (64, 8), (1024, 8), (8, 64), (16, 64),
                                               (32, 64), (64, 64)]
    for world_size, kv_heads in sizes:
        native = _native(world_size) if (world_size, kv_heads) == (8, 8) else None
        static, _ = _explain(world_size, inputs=False, kv_heads=kv_heads)
        seconds, report = _explain(world_size, inputs=True, kv_heads=kv_heads)
        if isinstance(report, str):  # the plan cannot run at this size: explain says why
            table.add(world_size, kv_heads, "-", "-", "-", static, seconds,
                      "refused: heads < ranks", "-")
            table.notes.append(f"{world_size} ranks, {kv_heads} KV heads: {report.split(':')[0]}")
            continue
        blocks, megatron = int(report.blocks_bytes), int(report.megatron_bytes)
        table.add(world_size, kv_heads, *(native[:2] if native else ("-", "-")),
                  native[2].get("all_reduce", 0) if native else "-", static, seconds,
                  report.collectives.get("all_reduce", 0), blocks / megatron)
        if native:
            table.target(f"{world_size} ranks: from_hf's plan issues the Megatron minimum, 4 "
                         f"all-reduces per layer + 2 (native: {native[2].get('all_reduce')})",
                         report.collectives.get("all_reduce") == 4 * 80 + 2)
            table.target(f"{world_size} ranks: explain, report included, no slower than native's "
                         "dry run by hand", seconds <= native[0] + native[1])
        table.target(f"{world_size} ranks, {kv_heads} KV heads: block bytes equal the Megatron "
                     "formula", blocks == megatron)
    table.notes.append("one sequence of 4096 tokens; the native dry run: parallelize_module on "
                       "the meta model, then a forward and backward under CommDebugMode")
    table.notes.append("with 8 KV heads, 64 and more ranks cannot split them: explain refuses the "
                       "plan (the forward fails in attention; the lint names the heads); with 64 "
                       "KV heads the same shape runs up to 64 ranks")
    return table


if __name__ == "__main__":
    print(run().text())
