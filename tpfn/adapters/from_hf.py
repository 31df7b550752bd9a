"""Hugging Face ``transformers`` tensor-parallel plans as tpfn plans.

A ``transformers`` model carries its plan as ``model.tp_plan``: module *or parameter*
names (``*`` for a layer number) mapped to style strings. ``from_hf(tp_plan, model)``
reads every string with the meaning transformers gives it and returns the tpfn plan that
does the same on ``model``. It reads the model because a transformers plan depends on it:
a key may name a parameter (``layers.*.mlp.experts.gate_up_proj``) whose placement
depends on its dims, and a model's own plan names modules that only some variants of the
architecture have (transformers skips those rules; so does ``from_hf``).

>>> mlp = nn.ModuleDict({"up": nn.Linear(4, 8), "down": nn.Linear(8, 4)})
>>> from_hf({"up": "colwise", "down": "rowwise"}, mlp)
plan({'down': rowwise(), 'up': colwise()})

Every string with a faithful tpfn meaning is read (docs/huggingface.md lists each as its
tpfn composition); the others (expert parallelism) are refused with the reason.

Where an attention module's config has fewer key/value heads than query heads, its
column-wise k and v projections (those ``num_key_value_heads * head_dim`` wide) are
``colwise(heads=num_key_value_heads)``: sharded on meshes that divide their heads, each head
replicated over a group of ranks on larger ones (as Megatron and vLLM do), and the query heads
per KV head it holds (``num_key_value_groups``) are held per rank,
``per_rank("num_key_value_groups", per_head=num_key_value_heads)``: so the model's own plan runs
at every degree its query heads allow.

Where several column-wise layers are children of one module (attention's q, k and v; an
MLP's gate and up projections), the module takes its input as one local replica,
``prepare_in(Replicate(), local=True)``: the children's partial input gradients are summed
and all-reduced once (the Megatron minimum) instead of one all-reduce each, and whatever
else the forward does with its input (a context concatenated first, a plain projection)
gets its whole gradient, added after the reduction.
"""

from __future__ import annotations

import collections

import torch.nn as nn

from tpfn._fqn import generalize, join, spell
from tpfn.adapters.lora import is_lora, with_lora
from tpfn.errors import PlanError
from tpfn.layout import Partial, Replicate, Shard
from tpfn.plans.kinds import Conv1D, meaning
from tpfn.plans.mount import forward_names
from tpfn.plans.plan import Plan, plan
from tpfn.style.constructors import (
    colwise, identity, on_shards, params, per_rank, prepare_in, prepare_out, replicate, rowwise,
    sequence_parallel,
)

__all__ = ["from_hf", "experts", "MODULE_STYLES", "PARAM_RULES", "UNSUPPORTED", "KNOWN"]

_GATHERED = colwise() >> prepare_out(Replicate())
_SPLIT_INPUT = prepare_in(Replicate()) >> rowwise()
_SHARED = prepare_in(Replicate(), local=True)  # one replica for several column-wise children
_REDUCED = prepare_out(Replicate(), given=Partial())
# Inside moe_tp_experts, whose outputs are partial sums and whose input's gradient too: the
# identity experts' replicated input as one of n equal terms, its gradient too (x/n, g/n).
_TERMS = prepare_in(Replicate(), desired=Partial(), grads=Partial(), local=True)

# What a string does to a module it keys (transformers 5.24, then earlier releases);
# "replicated_with_grad_allreduce" and "moe_tp_experts" depend on the module (_module_style).
MODULE_STYLES = {
    "colwise": colwise(), "colwise_gather_output": _GATHERED, "colwise_rep": _GATHERED,
    "rowwise": rowwise(), "rowwise_split_input": _SPLIT_INPUT, "rowwise_rep": _SPLIT_INPUT,
    "embedding_rowwise": rowwise(), "embedding_colwise": _GATHERED,
    "packed_colwise": colwise(parts=2),
    "sequence_parallel": sequence_parallel(local=True),
    "all_reduce": _REDUCED,
    "moe_identity_expert": _TERMS,
    "local_params": on_shards(),
    "replicate": replicate() >> on_shards(),
    # transformers 4.x
    "gather": _REDUCED,
    **dict.fromkeys(("local", "local_colwise", "local_rowwise", "local_packed_rowwise"), on_shards()),
}


def _colwise(name: str, ndim: int):
    return Shard(max(ndim - 2, 0))


def _rowwise(name: str, ndim: int):
    return Replicate() if name == "bias" else Shard(ndim - 1)


# What a string does to a parameter, by its name and number of dims.
PARAM_RULES = {
    "colwise": _colwise, "colwise_gather_output": _colwise, "colwise_rep": _colwise,
    "rowwise": _rowwise, "rowwise_split_input": _rowwise, "rowwise_rep": _rowwise,
    "embedding_rowwise": lambda name, ndim: Shard(0),
    "embedding_colwise": lambda name, ndim: Shard(1),
    "packed_colwise": lambda name, ndim: Shard(0) if ndim == 1 else Shard(ndim - 2, parts=2),
    "packed_rowwise": lambda name, ndim: Replicate() if ndim == 1 else Shard(ndim - 1, parts=2),
    "replicate": lambda name, ndim: Replicate(),
    # transformers 4.x: the parameter is a plain local shard its module computes with
    "local_colwise": lambda name, ndim: Shard(ndim - 1) if name == "bias" else _colwise(name, ndim),
    "local_rowwise": _rowwise,
    "local_packed_rowwise": lambda name, ndim: Shard(ndim - 1, parts=2),
}
_LOCAL = ("local_colwise", "local_rowwise", "local_packed_rowwise")

# Strings that shard a module column-wise from a replicated input (their parent may share it).
_CONSUMERS = ("colwise", "colwise_gather_output", "colwise_rep", "packed_colwise", "mla_kv_a_proj")

# The module kinds each string applies to: transformers' linears, and its Conv1D (GPT-2's,
# weight stored (in, out)), which tpfn's colwise() and rowwise() shard by its output and input
# features as they do a linear's (transformers' own styles would cut its weight's other dim).
_LINEARS = (nn.Linear, Conv1D)
_KINDS = {**dict.fromkeys(("colwise", "colwise_gather_output", "colwise_rep", "rowwise",
                           "rowwise_split_input", "rowwise_rep", "packed_colwise"), _LINEARS),
          "mla_kv_a_proj": (nn.Linear,),
          **dict.fromkeys(("embedding_rowwise", "embedding_colwise"), (nn.Embedding,))}

# Strings whose meaning no tpfn style has: why, and what to do.
UNSUPPORTED = dict.fromkeys(("grouped_gemm", "ep_router", "ep_dispatch_experts"), (
    "is expert parallelism (whole experts per rank, tokens sent between ranks), which tpfn "
    "does not do; shard the experts on their hidden dim instead: 'moe_tp_experts' on the "
    "experts module, 'packed_colwise' and 'rowwise' on its weights"))

# transformers' multi-head latent attention (DeepSeek-V2 and its kin): kv_a_proj_with_mqa's
# output is the latent, which goes through the norm beside it to the column-wise
# up-projection, and the rotary keys, which every local head reads. "mla_kv_a_proj" sums the
# rotary keys' gradient over the ranks; tpfn sums the gradient of the whole output once, at
# the projection's input and weight, and leaves the latent's gradient partial on its way back
# (_latent). The norm and the up-projection are found by the names transformers gives them.
_MLA_NORM, _MLA_UP = "kv_a_layernorm", "kv_b_proj"

_BY_MODULE = ("replicated_with_grad_allreduce", "moe_tp_experts", "mla_kv_a_proj")
KNOWN = sorted({*MODULE_STYLES, *_BY_MODULE, *PARAM_RULES, *UNSUPPORTED})


def _partial_grads(module: nn.Module, *desired, grads=None):
    """``module`` on local tensors (inputs ``desired``) with its own parameters replicated and
    their gradients partial sums over the ranks."""
    partial = {n: Partial() for n, p in module.named_parameters(recurse=False) if p.requires_grad}
    return replicate() >> on_shards(*desired, grads=grads, param_grads=partial)


def _latent(fqn: str, modules: dict, keyed: dict, styles: dict, found: list):
    """Beside ``fqn`` (keyed 'mla_kv_a_proj'), the latent's norm and column-wise
    up-projection leave the latent's gradient partial: the norm's parameters' gradients
    become partial sums, and the up-projection hands back its local input gradient unreduced.
    Returns the up-projection's name (None after adding to ``found`` what prevents it)."""
    parent = fqn.rpartition(".")[0]
    norm, up = (join(parent, name) for name in (_MLA_NORM, _MLA_UP))
    every = generalize if parent else str  # one problem for all the layers
    rule = (f"{every(fqn)!r} is 'mla_kv_a_proj', transformers' multi-head latent attention: its latent "
            f"goes through {every(norm)!r}, a norm over the latent, to {every(up)!r}, keyed 'colwise'; ")
    if keyed.get(up) != "colwise" or not isinstance(modules[up], nn.Linear):
        why = ("it is missing" if up not in modules else "it is not in the plan" if up not in keyed
               else f"it is {keyed[up]!r}")
        found.append(f"{rule}{why}. Key it 'colwise', or write the attention's plan by hand.")
        return None
    width = modules[up].in_features
    sizes = None if norm not in modules else {
        p.numel() for p in modules[norm].parameters(recurse=False)}
    if sizes is None or not sizes <= {width} or width > modules[fqn].out_features:
        why = ("it is missing" if sizes is None
               else f"its parameters do not match the {width} latent features")
        found.append(f"{rule}{why}, so the latent's path is not the one 'mla_kv_a_proj' is exact "
                     "for; write the attention's plan by hand.")
        return None
    if keyed.get(norm) not in (None, "replicated_with_grad_allreduce"):
        found.append(f"{rule}it is {keyed[norm]!r}. Leave it out of the plan.")
        return None
    if sizes:
        styles[norm] = _partial_grads(modules[norm])
    weights = {n: Shard(0) for n, _ in modules[up].named_parameters(recurse=False)}
    styles[up] = params(**weights) >> on_shards(None, output=Shard(-1))
    return up


def _module_style(string, module: nn.Module, own: dict, where: str, found: list):
    """The style of ``module`` keyed ``string`` (None: not keyed) whose parameters keyed
    in the plan are placed ``own``; None after adding to ``found`` what prevents it."""
    placed = {n: p for n, (_, p) in own.items()}
    module = module.base_layer if is_lora(module) else module  # with_lora shards what is inside
    if string is None:  # only its parameters are keyed: local shards it computes with, or not
        local = any(s in _LOCAL for s, _ in own.values())
        return params(**placed) >> on_shards() if local else params(**placed)
    if string in _KINDS and not isinstance(module, _KINDS[string]):
        found.append(f"{where} is {string!r}, which transformers applies to "
                     f"{_KINDS[string][0].__name__} modules; this is {type(module).__name__}.")
        return None
    rest = [n for n, _ in module.named_parameters(recurse=False) if n not in own]
    if string == "local" and rest:
        found.append(f"{where} is 'local', which divides the parameters it owns ({', '.join(rest)}) "
                     "by the mesh size so that an all-reduce after it counts them once; layouts "
                     "place values and never scale them. Key each parameter with a style.")
        return None
    if string in _LOCAL or string == "packed_rowwise":
        placed.update({n: PARAM_RULES[string](n, module.get_parameter(n).dim()) for n in rest})
    if string == "packed_rowwise":  # transformers places the parameters and nothing else
        return params(**placed)
    if string == "replicated_with_grad_allreduce":
        core = _partial_grads(module)
    elif string == "mla_kv_a_proj":
        core = _partial_grads(module, Replicate(), grads=Partial())
    elif string == "embedding_rowwise" and not meaning(rowwise().core, module, "", ()).local:
        # An embedding with its own forward (Gemma's scales its output) computes on DTensors,
        # which sum the vocabulary shards where they need to: take the output as it comes.
        core = prepare_in(Replicate()) >> params(weight=Shard(0)) >> prepare_out(Replicate())
    elif string == "moe_tp_experts":
        core = experts(module)
    else:
        core = MODULE_STYLES[string]
    return params(**placed) >> core if placed else core


def experts(module: nn.Module):
    """The core of 'moe_tp_experts' on ``module``, an experts module whose parameters each
    rank holds a share of the features of: its replicated inputs computed on locally (the
    routing, where it takes it, as it comes), its output and its inputs' gradients partial
    sums, the output summed into a replicated one."""
    names, _, star = forward_names(module)
    routed = star or len(names) >= 3  # (hidden_states, top_k_index, top_k_weights)
    return on_shards(*((Replicate(), None, Replicate()) if routed else (Replicate(),)),
                     grads=Partial(), output=Partial()) >> prepare_out(Replicate())


# The attribute of an attention module that holds its query heads per key/value head.
_GROUPS = "num_key_value_groups"


def _kv_heads(fqn: str, modules: dict, model: nn.Module) -> int | None:
    """The number of key/value heads of the column-wise projection ``fqn`` where it projects the
    key or value heads of an attention module (its parent, holding an int ``head_dim``) whose
    config has fewer of them than query heads (a LoRA layer: its base's); else None."""
    parent, child = modules[fqn.rpartition(".")[0]], modules[fqn]
    child = child.base_layer if is_lora(child) else child
    config = getattr(parent, "config", None) or getattr(model, "config", None)
    kv, heads = (getattr(config, n, None) for n in ("num_key_value_heads", "num_attention_heads"))
    size = vars(parent).get("head_dim")
    if not all(type(v) is int and v > 0 for v in (kv, heads, size)) or kv >= heads:
        return None
    return kv if isinstance(child, nn.Linear) and child.out_features == kv * size else None


def from_hf(tp_plan: dict, model: nn.Module) -> Plan:
    """The tpfn plan of a ``transformers`` tensor-parallel plan on ``model``.

    ``tp_plan`` maps module or parameter names (``*`` for a layer number) to the style
    strings of ``transformers`` (``model.tp_plan`` is the model's own). A rule of the
    model's own plan that names nothing in ``model`` is skipped, as transformers does; any
    other, an unknown string, and a string tpfn cannot express faithfully are reported
    together in one ``PlanError``.

    >>> from_hf({"0": "colwise_gather_output"}, nn.Sequential(nn.Linear(4, 8)))
    plan({'0': colwise() >> prepare_out(Replicate())})
    >>> from_hf({"0": "fused_colwise"}, nn.Sequential(nn.Linear(4, 8)))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    tpfn.errors.PlanError: the plan cannot be applied (1 problem):
      - '0': unknown transformers style 'fused_colwise'; known: all_reduce, colwise, ...
    """
    if not isinstance(tp_plan, dict):
        raise TypeError(f"'tp_plan' must be a dict of name -> style string, as model.tp_plan "
                        f"(got {tp_plan!r} that is a {type(tp_plan)!r}).")
    if not isinstance(model, nn.Module):
        raise TypeError(f"'model' must be the nn.Module the plan is for (got {model!r} that is a "
                        f"{type(model)!r}).")
    modules = dict(model.named_modules())
    own_plan = getattr(model, "tp_plan", None) or {}
    found: list = []
    keyed: dict = {}  # fqn -> string
    own: dict = {}  # module fqn -> {parameter: (string, placement)}
    for key, string in tp_plan.items():
        if string not in KNOWN:
            found.append(f"{key!r}: unknown transformers style {string!r}; known: {', '.join(KNOWN)}.")
            continue
        if string in UNSUPPORTED:
            found.append(f"{key!r}: transformers' {string!r} {UNSUPPORTED[string]}.")
            continue
        generic = generalize(key)  # transformers' keys name every layer index '*'
        hits = [f for f in modules if generalize(f) == generic]
        params_hit = [(n, p) for n, p in model.named_parameters() if generalize(n) == generic]
        for name, param in params_hit:
            owner, _, leaf = name.rpartition(".")
            if string not in PARAM_RULES:
                found.append(f"{key!r} names a parameter; {string!r} applies to modules, so key "
                             f"its module {generalize(owner)!r}.")
                break
            own.setdefault(owner, {})[leaf] = (string, PARAM_RULES[string](leaf, param.dim()))
        keyed.update(dict.fromkeys(hits, string))
        if not hits and not params_hit and tp_plan.get(key) != own_plan.get(key):
            found.append(f"{key!r} names no module or parameter of {type(model).__name__}.")
    styles = {}
    for fqn in [f for f in modules if f in keyed or f in own]:
        where = f"{fqn!r} ({type(modules[fqn]).__name__})"
        style = _module_style(keyed.get(fqn), modules[fqn], own.get(fqn, {}), where, found)
        if style is not None:
            styles[fqn] = style
    latents = {_latent(f, modules, keyed, styles, found)
               for f, string in keyed.items() if string == "mla_kv_a_proj"}
    for fqn, string in keyed.items():
        parent = fqn.rpartition(".")[0]
        if string == "moe_identity_expert" and keyed.get(parent) != "moe_tp_experts":
            why = f"is {keyed[parent]!r}" if parent in keyed else "is not in the plan"
            module = repr(generalize(parent)) if parent else "(the model)"
            found.append(f"{generalize(fqn)!r} is 'moe_identity_expert', which hands the identity "
                         "experts' input on as terms of the sum that 'moe_tp_experts' makes of its "
                         f"experts' outputs; its module {module} {why}. Key it 'moe_tp_experts'.")
    if not found and not styles:
        found.append(f"{type(model).__name__}: {'this' if tp_plan else 'the empty'} tp_plan shards "
                     f"nothing{'' if tp_plan else ' (the model declares none)'}, and every rank "
                     "would hold and compute the whole model; write a plan for it (docs/plans.md), "
                     "or leave the model unparallelized to run it whole on purpose.")
    if found:
        raise PlanError(list(dict.fromkeys(found)))  # a problem of every layer, once
    parents = [fqn.rpartition(".")[0] for fqn, string in keyed.items()  # of column-wise children
               if string in _CONSUMERS and "." in fqn and fqn not in latents]
    readers = collections.Counter(parents)
    styles.update({p: _SHARED for p, n in readers.items() if n > 1 and p not in styles})
    kv = {f: h for f, string in keyed.items() if string == "colwise" and "." in f
          and styles.get(f) == colwise() and (h := _kv_heads(f, modules, model))}
    styles.update({f: colwise(heads=h) for f, h in kv.items()})  # each head held by a group of ranks
    for parent, heads in {f.rpartition(".")[0]: h for f, h in kv.items()}.items():
        if type(vars(modules[parent]).get(_GROUPS)) is int:  # their query heads: the rank's share
            styles[parent] = styles.get(parent, identity()) >> per_rank(_GROUPS, per_head=heads)
    return with_lora(plan(spell(styles, modules)), model)
