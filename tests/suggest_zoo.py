"""Every text model transformers can build tiny from its config, with tpfn.suggest's plan.

``types()`` lists every model type of transformers; ``build(name)`` makes its tiny model as
``tests/hf_zoo.py`` does (with the sizes of configs hf_zoo's names do not reach, T5's family
among them), or raises ``hf_zoo.Skip`` for a model that takes no token ids. ``outcome(name,
mesh)`` runs on each rank of ``mesh``: one device's output and every gradient, then the same
with ``tpfn.parallelize(model, mesh, tpfn.suggest(model, n))`` and, where the model declares
a plan, with ``tpfn.from_hf(model.tp_plan, model)``, each compared with one device, with the
collectives of one step (``tpfn.record``) and the share of parameter bytes each plan shards.
``tools/suggest_sweep.py`` runs every type and prints the table of docs/suggest.md;
``tests/test_suggest_models.py`` runs GPT-2, BERT, T5, OPT, BLOOM, Llama and Mixtral in CI.
"""

from __future__ import annotations

import collections
import copy
import functools
import warnings

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from tests import hf_zoo

# Sizes of configs hf_zoo's names do not reach (T5's family, and others written otherwise).
SIZES = dict(d_model=32, d_ff=64, d_kv=8, num_heads=4, num_decoder_layers=2, encoder_layers=2,
             decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
             encoder_ffn_dim=64, decoder_ffn_dim=64, n_inner=64, ffn_dim=64, n_heads=4, n_kv_heads=2,
             num_kv_heads=2, dim=32, hidden_dim=64, n_ctx=64, max_seq_len=64, seq_length=64,
             relative_attention_num_buckets=8, relative_attention_max_distance=16)


def types() -> list:
    """Every model type of transformers."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return sorted(CONFIG_MAPPING_NAMES)


def build(name: str):
    """``(model, inputs)`` of model type ``name``, as ``hf_zoo.build`` makes it, with ``SIZES``
    besides; an encoder-decoder gets decoder ids too."""
    from transformers import CONFIG_MAPPING

    given = CONFIG_MAPPING[name]().to_dict()
    extra = {k: v for k, v in SIZES.items() if isinstance(given.get(k), int) and not isinstance(
        given.get(k), bool) and k not in hf_zoo.SIZES}
    model, inputs = hf_zoo.build(name, **extra)
    if getattr(model.config, "is_encoder_decoder", False) and "decoder_input_ids" not in inputs \
            and "input_ids" in inputs:
        inputs = {**inputs, "decoder_input_ids": inputs["input_ids"]}
    return model, inputs


def heads(model: nn.Module) -> int | None:
    """The model's query heads (its text config's), or None."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for key in ("num_attention_heads", "num_heads", "n_head", "n_heads", "encoder_attention_heads"):
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def counts(model: nn.Module, inputs: dict, cotangent) -> tuple:
    """(the output, {collective: count}) of one forward and backward (``tpfn.record``: torch's
    ``CommDebugMode`` loses its module stack on some models, T5's among them)."""
    from tpfn.record import record

    with record(model) as comms:
        y = hf_zoo.step(model, inputs, cotangent)
    return y, dict(collections.Counter(c.kind for c in comms))


def share(model: nn.Module) -> float:
    """The share of parameter bytes ``model`` holds sharded."""
    total = sharded = 0
    for p in model.parameters():
        b = p.numel() * p.element_size()
        total += b
        if isinstance(p, DTensor) and not all(x.is_replicate() for x in p.placements):
            sharded += b
    return sharded / total if total else 0.0


def with_suggest(model: nn.Module, mesh, inputs: dict | None = None) -> nn.Module:
    """``model`` with suggest's plan over ``mesh``: for its default inputs (a transformers
    model's token ids), or ``inputs`` where it takes others."""
    import tpfn
    from tpfn.analysis.inputs import defaults

    given = None if defaults(model) is not None else inputs
    return tpfn.parallelize(model, mesh, tpfn.suggest(model, mesh.size(), example_inputs=given),
                            src_rank=None)


def _run(make, model, mesh, inputs, cotangent, ref, expected) -> dict:
    try:
        tp = make(copy.deepcopy(model), mesh)
        y, found = counts(tp, inputs, cotangent)
        return {**hf_zoo.errors(tp, ref, y, expected), "collectives": found, "share": share(tp)}
    except Exception as e:  # noqa: BLE001 - reported in the table
        return {"error": hf_zoo._why(e)}


def outcome(name: str, mesh) -> dict:
    """One model type on this rank: ``{"name", "model", "skip", "planned", "heads", "rounding",
    "suggest", "hf"}``; ``"suggest"`` and ``"hf"`` as ``hf_zoo.outcome``'s runs, with their
    ``"collectives"`` and sharded ``"share"``; ``"rounding"`` as there."""
    found = {"name": name, "model": None, "skip": None, "planned": False, "heads": None,
             "rounding": None}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, inputs = build(name)
        found["model"], found["heads"] = type(model).__name__, heads(model)
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
    except Exception as e:  # noqa: BLE001 - what fails on one device is the row's note
        found["skip"] = hf_zoo._unbuilt(name, e)
        return found
    found["suggest"] = _run(functools.partial(with_suggest, inputs=inputs), model, mesh, inputs,
                            cotangent, ref, expected)
    found["planned"] = bool(getattr(model, "tp_plan", None))
    if found["planned"]:
        found["hf"] = _run(hf_zoo.with_tpfn, model, mesh, inputs, cotangent, ref, expected)
    runs = [found["suggest"], found.get("hf")]
    if any(r and "error" not in r and hf_zoo.TOLERANCE / hf_zoo.ROUNDING < hf_zoo._worst(r)[1] < 1e-2
           for r in runs):
        found["rounding"] = hf_zoo._rounding(model, inputs, cotangent, expected, ref)
    return found


def outcomes(names: list, n: int = 2) -> list:
    """``outcome`` of each model type on this rank's mesh of ``n`` ranks (run on every rank)."""
    from tests.ranks import mesh

    hf_zoo.quiet()
    return [outcome(name, mesh(n)) for name in names]


def at_parity(found: dict, which: str = "suggest") -> bool:
    """Whether a run of ``found`` agrees with one device (within its rounding's bar)."""
    return hf_zoo.at_parity(found.get(which), hf_zoo.tolerance(found))


LR = 0.1  # optimizer_step's SGD


def optimizer_step(name: str, n: int) -> dict:
    """On each rank: the errors of suggest's plan against one device after one forward,
    backward and SGD step (outputs, every gradient, every parameter after the step)."""
    from tests.ranks import mesh
    from tpfn.interpret.layouts import full_value, layouts

    hf_zoo.quiet()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, inputs = build(name)
    ref, tp = copy.deepcopy(model), with_suggest(copy.deepcopy(model), mesh(n), inputs)
    gen = torch.Generator().manual_seed(2)
    cot = {}

    def cotangent(y):
        return cot.setdefault(tuple(y.shape), torch.randn(y.shape, generator=gen, dtype=y.dtype))

    expected = hf_zoo.step(ref, inputs, cotangent)
    y = hf_zoo.step(tp, inputs, cotangent)
    found = hf_zoo.errors(tp, ref, y, expected)
    floor = LR * hf_zoo._floor(ref)  # a step by a gradient zero up to rounding: measured as the gradient
    for m in (ref, tp):
        torch.optim.SGD(m.parameters(), lr=LR).step()
    placed, theirs = layouts(tp), dict(ref.named_parameters())
    found["stepped"] = {k: hf_zoo._error(full_value(p, placed.get(k)), theirs[k].detach(), floor)
                        for k, p in tp.named_parameters()}
    found["share"] = share(tp)
    return found
