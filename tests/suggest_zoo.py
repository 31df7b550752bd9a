"""Every text model transformers can build tiny from its config, with tpfn.suggest's plan.

``types()`` lists the model types whose tiny model (``tests/hf_zoo.py``'s sizes, and the
sizes of encoder-decoder configs) runs on token ids; ``outcome(name, mesh)`` runs on each
rank of ``mesh``: one device's output and every gradient, then the same with
``tpfn.parallelize(model, mesh, tpfn.suggest(model, n))`` and, where the model declares a
plan, with ``tpfn.from_hf(model.tp_plan, model)``, each compared with one device, with the
collectives of one step and the share of parameter bytes each plan shards.
``tools/suggest_sweep.py`` runs every type and prints the table of docs/suggest.md;
``tests/test_suggest_models.py`` runs GPT-2, BERT, T5, OPT, BLOOM and Llama in CI.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from tests import hf_zoo

# Sizes of configs hf_zoo's names do not reach (T5's family, and others written as GPT-2's).
SIZES = dict(d_model=32, d_ff=64, d_kv=8, num_heads=4, num_decoder_layers=2, encoder_layers=2,
             decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
             encoder_ffn_dim=64, decoder_ffn_dim=64, n_inner=64, ffn_dim=64, n_heads=4, n_kv_heads=2,
             num_kv_heads=2, dim=32, hidden_dim=64, n_ctx=64, max_seq_len=64, seq_length=64,
             relative_attention_num_buckets=8, relative_attention_max_distance=16)


def build(name: str):
    """``(model, inputs)`` of model type ``name``, as ``hf_zoo.build`` makes it, with
    ``SIZES`` besides; encoder-decoders get decoder ids too."""
    from transformers import CONFIG_MAPPING

    given = CONFIG_MAPPING[name]().to_dict()
    extra = {k: v for k, v in SIZES.items() if isinstance(given.get(k), int) and not isinstance(
        given.get(k), bool) and k not in hf_zoo.SIZES}
    model, inputs = hf_zoo.build(name, **extra)
    if getattr(model.config, "is_encoder_decoder", False) and "decoder_input_ids" not in inputs \
            and "input_ids" in inputs:
        inputs = {**inputs, "decoder_input_ids": inputs["input_ids"]}
    return model, inputs


def counts(model: nn.Module, inputs: dict, cotangent) -> tuple:
    """(the output, {collective: count}) of one forward and backward."""
    import tpfn

    with CommDebugMode() as mode:
        y = hf_zoo.step(model, inputs, cotangent)
    return y, tpfn.trace.counts(mode)


def _share(model: nn.Module) -> float:
    """The share of parameter bytes ``model`` holds sharded."""
    total = sharded = 0
    for p in model.parameters():
        b = p.numel() * p.element_size()
        total += b
        if isinstance(p, DTensor) and not all(x.is_replicate() for x in p.placements):
            sharded += b
    return sharded / total if total else 0.0


def _run(make, model, mesh, inputs, cotangent, ref, expected) -> dict:
    try:
        tp = make(copy.deepcopy(model), mesh)
        y, found = counts(tp, inputs, cotangent)
        return {**hf_zoo.errors(tp, ref, y, expected), "collectives": found, "share": _share(tp)}
    except Exception as e:  # noqa: BLE001 - reported in the table
        return {"error": hf_zoo._why(e)}


def with_suggest(model, mesh):
    import tpfn

    return tpfn.parallelize(model, mesh, tpfn.suggest(model, mesh.size()), src_rank=None)


def outcome(name: str, mesh) -> dict:
    """One model type on this rank: ``{"name", "model", "skip", "planned", "suggest", "hf"}``."""
    found = {"name": name, "model": None, "skip": None, "planned": False}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, inputs = build(name)
        found["model"] = type(model).__name__
        gen = torch.Generator().manual_seed(2)
        made = {}

        def cotangent(y):
            if tuple(y.shape) not in made:
                made[tuple(y.shape)] = torch.randn(y.shape, generator=gen, dtype=y.dtype)
            return made[tuple(y.shape)]

        ref = copy.deepcopy(model)
        expected = hf_zoo.step(ref, inputs, cotangent)
    except hf_zoo.Skip as e:
        found["skip"] = str(e)
        return found
    except Exception as e:  # noqa: BLE001
        found["skip"] = hf_zoo._unbuilt(name, e)
        return found
    found["suggest"] = _run(with_suggest, model, mesh, inputs, cotangent, ref, expected)
    found["planned"] = bool(getattr(model, "tp_plan", None))
    if found["planned"]:
        found["hf"] = _run(hf_zoo.with_tpfn, model, mesh, inputs, cotangent, ref, expected)
    return found


def outcomes(names: list, n: int = 2) -> list:
    from tests.ranks import mesh

    hf_zoo.quiet()
    return [outcome(name, mesh(n)) for name in names]
