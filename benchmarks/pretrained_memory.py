"""Pretrained memory: peak RSS per rank while loading a Hugging Face checkpoint of about 2 GB
(fp32) at TP=2, three ways.

A Llama-shaped model (hidden 2048, 12 layers, MLP 4096, vocab 1024: 2.03 GB of float32
parameters) is initialized on the CPU once, in a process of its own, and written with
transformers' ``save_pretrained`` in 500 MB shards into a temporary directory under /tmp.
Then, for each way, two fresh gloo ranks (127.0.0.1) load it:

- ``tpfn.from_pretrained``: built on meta, parallelized, each rank reads only its slices;
- ``set_model_state_dict``: built on meta (``empty_weights()``), parallelized, rank 0 reads
  the full state dict (``safetensors.torch.load_file`` of every shard) and PyTorch's
  ``set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)`` sends it;
- full model: every rank ``AutoModelForCausalLM.from_pretrained`` in full, then parallelizes.

Each rank's peak is ``ru_maxrss`` after loading minus its resident set just before (after
every import and the process group). The logits of one short sequence are compared across
the three ways. The directory is removed at the end.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from benchmarks.common import Table

HIDDEN, LAYERS, MLP, VOCAB, HEADS = 2048, 12, 4096, 1024, 16
TP = 2
WAYS = {
    "a": "(a) tpfn.from_pretrained",
    "b": "(b) meta + parallelize + set_model_state_dict (rank 0 reads all)",
    "c": "(c) every rank from_pretrained in full, then parallelize",
}


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP,
                       num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                       num_key_value_heads=HEADS, max_position_embeddings=256,
                       tie_word_embeddings=False)


def _write(path: str) -> int:
    """Initialize the model on the CPU, save it in shards; its parameter bytes."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config())
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(path, max_shard_size="500MB")
    del model
    return size


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _load(way: str, path: str) -> tuple:
    """(peak growth in bytes, the first logits) on this rank, loading ``path`` the ``way``."""
    import gc
    import glob
    import resource

    import safetensors.torch
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import DTensor
    from transformers import AutoConfig, AutoModelForCausalLM

    import tpfn
    from tests.ranks import mesh

    m = mesh(TP)
    config = AutoConfig.from_pretrained(path)
    gc.collect()
    dist.barrier()
    before = _kib("VmRSS")
    if way == "a":
        model = tpfn.from_pretrained(path, m)
    elif way == "b":
        with tpfn.empty_weights():
            model = AutoModelForCausalLM.from_config(config)
        tpfn.parallelize(model, m, tpfn.from_hf(model.tp_plan, model), src_rank=None)
        full = {}
        if dist.get_rank() == 0:
            for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
                full.update(safetensors.torch.load_file(file))
        set_model_state_dict(model, full, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))
        del full
    else:
        model = AutoModelForCausalLM.from_pretrained(path)
        tpfn.parallelize(model, m, tpfn.from_hf(model.tp_plan, model))
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    model.eval()
    with torch.no_grad():
        logits = model(torch.arange(8).reshape(1, 8) % VOCAB).logits
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    del model
    gc.collect()
    return peak, logits[0, :, :64].clone()


def run(quick: bool = False) -> Table:  # noqa: ARG001 - one run each; there is nothing to repeat
    from tests.ranks import Ranks

    table = Table("pretrained_memory",
                  f"Peak RSS per rank loading a ~2 GB fp32 Llama checkpoint (500 MB shards), "
                  f"{TP} ranks", ["way", "rank", "model GB", "model / tp GB",
                                   "peak growth GB", "peak / (model / tp)"])
    directory = tempfile.mkdtemp(prefix="tpfn-pretrained-memory-", dir="/tmp")
    try:
        path = os.path.join(directory, "llama")
        with Ranks(1, timeout=600) as writer:
            size = writer.run(_write, path)[0]
        shards = len([f for f in os.listdir(path) if f.endswith(".safetensors")])
        logits = {}
        for way, label in WAYS.items():
            with Ranks(TP, timeout=600) as ranks:
                results = ranks.run(_load, way, path)
            for rank, (peak, _) in enumerate(results):
                table.add(label, rank, size / 1e9, size / TP / 1e9, peak / 1e9,
                          peak / (size / TP))
            logits[way] = results[0][1]
            if way == "a":
                worst = max(r[0] for r in results)
                table.target(f"(a) at most 1/tp of the model plus 15% on every rank "
                             f"(worst {worst / (size / TP):.3f})", worst <= 1.15 * size / TP)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    differences = {w: float((logits[w] - logits["c"]).abs().max()) for w in ("a", "b")}
    table.notes.append(
        f"{size / 1e9:.2f} GB of parameters (hidden {HIDDEN}, {LAYERS} layers, MLP {MLP}, "
        f"vocab {VOCAB}) in {shards} safetensors shards; the logits of (a) and (b) differ from "
        f"(c)'s by at most {max(differences.values()):.1g}")
    table.notes.append("peak growth = ru_maxrss after loading minus VmRSS just before, in a fresh "
                       "process per rank and way; mapped file pages that were read count")
    return table


if __name__ == "__main__":
    print(run().text())
