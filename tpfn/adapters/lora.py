"""PEFT's LoRA layers under a plan: each sharded by its base layer's style.

PEFT wraps each targeted ``nn.Linear`` in a LoRA layer whose ``forward`` adds
``lora_B(lora_A(dropout(x))) * scaling`` to ``base_layer(x)``. A plan written for the model
without adapters binds the wrappers' names, which no built-in shards (they are not
``nn.Linear``). ``with_lora(plan, model)`` rewrites each such rule for what is inside,
Megatron's split of a low-rank pair:

- a column-wise base (``colwise(...)``): ``base_layer`` and ``lora_B`` take the style, its
  output features sharded alike; ``lora_A`` stays replicated (a rank-r projection of the
  replicated input), and ``lora_B`` sums its input's gradient like the base does;
- a row-wise base (``rowwise(...)``): ``base_layer`` and ``lora_A`` take the style, their
  input features sharded alike and their partial sums reduced (``lora_A``'s, r wide);
  ``lora_B`` stays replicated, on the replicated rank-r activations.

So every rank computes its slice of the base's output and of the adapter's, and one device's
numbers come out. Apply LoRA first (``get_peft_model``), then ``parallelize`` the model with
the rewritten plan. Refused, with the layer named: a LoRA layer on another base (an
embedding, a convolution), DoRA and other variants (they need the whole weight's norms),
dropout on a row-wise base's sharded input, and styles whose input (column-wise) or output
(row-wise) is a shard of the sequence, where the replicated half of the pair would see one
rank's positions.

>>> import torch.nn as nn
>>> from tpfn.style.constructors import colwise, rowwise
>>> class Lora(nn.Module):  # PEFT's shape of a LoRA layer
...     def __init__(self, base, r=2):
...         super().__init__()
...         self.base_layer = base
...         self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, r, bias=False)})
...         self.lora_B = nn.ModuleDict({"default": nn.Linear(r, base.out_features, bias=False)})
...         self.lora_dropout = nn.ModuleDict({"default": nn.Identity()})
>>> model = nn.ModuleDict({"up": Lora(nn.Linear(4, 8)), "down": Lora(nn.Linear(8, 4))})
>>> with_lora({"up": colwise(), "down": rowwise()}, model)
plan({
    'down.base_layer': rowwise(),
    'down.lora_A.*': rowwise(),
    'up.base_layer': colwise(),
    'up.lora_B.*': colwise(),
})
"""

from __future__ import annotations

import torch.nn as nn

from tpfn._fqn import describe, join, matches
from tpfn.errors import PlanError
from tpfn.layout import Replicate
from tpfn.plans.plan import Plan, as_plan
from tpfn.style.style import Style

__all__ = ["with_lora", "is_lora"]


def is_lora(module: nn.Module) -> bool:
    """Whether ``module`` is a LoRA layer as PEFT builds one: a ``base_layer`` and the
    adapters' ``lora_A`` and ``lora_B`` (module dicts by adapter name)."""
    return isinstance(getattr(module, "base_layer", None), nn.Module) and all(
        isinstance(getattr(module, name, None), nn.ModuleDict) for name in ("lora_A", "lora_B"))


def _problem(layer: nn.Module, fqn: str, style) -> str | None:
    """Why ``layer`` cannot be sharded by ``style`` with its adapters, or None."""
    where = describe(layer, fqn)
    if not isinstance(layer.base_layer, nn.Linear):
        return (f"{where} is a LoRA layer on {type(layer.base_layer).__name__}; tpfn shards LoRA "
                "layers on nn.Linear: leave it out of target_modules or out of the plan.")
    if any(len(getattr(layer, name, None) or ()) for name in ("lora_magnitude_vector", "lora_variant")):
        return (f"{where} holds a LoRA variant (DoRA), whose magnitude needs the norms of the whole "
                "weight; train plain LoRA under tensor parallelism (use_dora=False).")
    kind = getattr(style.normal.core, "kind", None)
    if kind == "colwise":
        slots = style.normal.inputs.slots
        given = slots[0].source if slots else None
        if given is not None and not isinstance(given, Replicate):
            return (f"{where}: {style!r} takes its input as {given!r}, so lora_A, replicated, would see "
                    "one rank's slice; give the layer a replicated input (no sequence parallelism here).")
        return None
    if kind == "rowwise":
        slots = style.normal.outputs.slots
        out = slots[-1].out if slots else None
        if out is not None and not isinstance(out, Replicate):
            return (f"{where}: {style!r} hands on its output as {out!r}, so lora_B, replicated, would "
                    "see one rank's part; keep the row-wise output replicated (no sequence parallelism here).")
        if any(not isinstance(d, nn.Identity) for d in layer.lora_dropout.values()):
            return (f"{where}: LoRA dropout on a row-wise base would draw on each rank's slice of the "
                    "input features, not one device's mask; train with lora_dropout=0.")
        return None
    return (f"{where} is a LoRA layer bound to {style!r}; tpfn shards a LoRA layer by its base layer's "
            "colwise(...) or rowwise(...): bind the base's style, or leave the layer out of the plan.")


def _split(target: str, style, kind: str) -> list:
    half = "lora_B" if kind == "colwise" else "lora_A"  # the half sharded like the base
    return [(join(target, "base_layer"), style), (join(target, half, "*"), style)]


def with_lora(plan_like: Plan | dict | Style, model: nn.Module) -> Plan:
    """``plan_like`` (a plan, a dict as ``tpfn.plan`` takes, or a style) for ``model`` with
    PEFT's LoRA layers in place of the modules it binds: each rule binding a LoRA layer binds its
    ``base_layer`` and the half of its adapters sharded alike instead (see the module docstring).
    Other rules stay. Every problem is reported in one ``PlanError``, before anything changes.
    """
    plan = as_plan(plan_like)
    modules = dict(model.named_modules())
    rules, found = [], []
    for pattern, style in plan.rules:
        hits = [f for f in modules if matches(pattern, f)]
        layers = [f for f in hits if is_lora(modules[f])]
        if not layers:
            rules.append((pattern, style))
            continue
        problems = [p for p in (_problem(modules[f], f, style) for f in layers) if p]
        if problems:
            found += problems
            continue
        kind = style.normal.core.kind
        if len(layers) == len(hits):  # all of them: one pattern still
            rules += _split(pattern, style, kind)
        else:  # some: each by name
            rules += [(f, style) for f in hits if f not in layers]
            rules += [rule for f in layers for rule in _split(f, style, kind)]
    if found:
        raise PlanError(found)
    rules = dict(rules)
    return Plan(tuple(sorted(rules.items())), plan.kinds,
                tuple((key, text) for key, text in plan.notes if key is None or key in rules))  # (its notes kept)
