"""Transformers' fused experts: each rank holds a share of every expert's features.

A mixture-of-experts layer of transformers (a module made by ``use_experts_implementation``)
holds all its experts in 3-D parameters: ``gate_up_proj`` (or ``up_proj`` without a gate)
of ``(experts, 2 * features, hidden)`` and ``down_proj`` of ``(experts, hidden, features)``,
the last two dims swapped where ``is_transposed``. As transformers' own plans do
('moe_tp_experts'), each rank takes its share of the features of every expert, the gate's and
the up projection's halves alike (``parts=2``), and ``down_proj`` the matching share of its
input: the routed tokens are computed on locally, and the output, a partial sum, is
all-reduced (``tpfn.adapters.from_hf.experts``). No token moves between ranks (that is expert
parallelism, which tpfn does not do). What else the experts module may compute stays whole:
experts with biases (added after the partial sum, they would be counted on every rank), with
child modules other than activations (a norm on each expert's output), or with weights tied
to a module that stays whole (experts tied to experts, an encoder's and a decoder's, are
sharded alike).

>>> import torch
>>> class Experts(nn.Module):  # as use_experts_implementation makes them
...     def __init__(self):
...         super().__init__()
...         self.has_gate, self.has_bias, self.is_transposed = True, False, False
...         self.gate_up_proj = nn.Parameter(torch.empty(4, 2 * 64, 16))
...         self.down_proj = nn.Parameter(torch.empty(4, 16, 64))
...     def forward(self, hidden_states, top_k_index, top_k_weights): ...
>>> found = experts(nn.Sequential(Experts()), 2, {})
>>> found[0].style
params(down_proj=Shard(dim=2), gate_up_proj=Shard(dim=1, parts=2)) >> on_shards(Replicate(), None, Replicate(), grads=Partial(), output=Partial()) >> prepare_out(Replicate())
"""

from __future__ import annotations

import collections

import torch.nn as nn

from tpfn._fqn import join
from tpfn.adapters.from_hf import experts as experts_core
from tpfn.layout import Shard
from tpfn.style.constructors import params
from tpfn.suggest.choose import Choice
from tpfn.suggest.emit import brief

__all__ = ["experts"]


def _weights(module: nn.Module):
    """``(up, w_up, w_down)`` of a fused experts module: the name of its up projection and the
    3-D parameters of its up and down projections; None where ``module`` is no such module."""
    if not all(isinstance(getattr(module, a, None), bool) for a in ("has_gate", "is_transposed")):
        return None
    up = "gate_up_proj" if module.has_gate else "up_proj"
    weights = [getattr(module, n, None) for n in (up, "down_proj")]
    if not all(isinstance(w, nn.Parameter) and w.dim() == 3 for w in weights):
        return None
    return up, *weights


def _dims(module: nn.Module) -> tuple:
    """The dims of the features in the up and the down projection's weights."""
    return (-1, -2) if module.is_transposed else (-2, -1)


_ACTIVATIONS = ("transformers.activations", "torch.nn.modules.activation")


def _why_whole(module: nn.Module, up: str, w_up, w_down, n: int) -> str | None:
    """Why the experts module computes whole on ``n`` ranks (None: it can be sharded)."""
    if getattr(module, "has_bias", False):
        return "its experts have biases, which a sum over the ranks would count once per rank"
    for name, child in module.named_children():
        if type(child).__module__ not in _ACTIVATIONS or any(True for _ in child.parameters()):
            return (f"its forward runs {name!r} ({type(child).__name__}), which may compute on each expert's "
                    "output, a partial sum while the features are sharded")
    i_up, i_down = _dims(module)
    features = w_down.shape[i_down]
    if w_up.shape[i_up] != (2 if module.has_gate else 1) * features or w_up.shape[i_down] != w_down.shape[i_up]:
        return (f"its {up} {tuple(w_up.shape)} and down_proj {tuple(w_down.shape)} are not the "
                f"{'transposed ' if module.is_transposed else ''}layout transformers' experts have")
    if features % n:
        return f"its {features} features per expert do not split over {n} ranks"
    return None


def experts(model: nn.Module, n: int, whole: dict) -> list:
    """A ``Choice`` for each fused experts module of ``model`` on ``n`` ranks: sharded on its
    features, or left whole with the reason (``whole``: module -> why it failed before).
    Experts whose weights other modules hold too (an encoder's and a decoder's tied) are
    sharded where every holder is, alike."""
    names = {id(m): fqn for fqn, m in model.named_modules()}  # (a module held twice: its first name)
    holders = collections.defaultdict(set)  # a parameter's id -> (module, name) of each place it is held
    for module in model.modules(remove_duplicate=False):
        for name, p in module.named_parameters(recurse=False, remove_duplicate=False):
            holders[id(p)].add((names[id(module)], name))
    styles, why, weights, sizes = {}, {}, {}, {}  # by module: style (None: whole), why whole, weights, features
    for fqn, module in model.named_modules():
        found = _weights(module)
        if found is None:
            continue
        up, w_up, w_down = found
        i_up, i_down = _dims(module)
        why[fqn] = whole.get(fqn) or _why_whole(module, up, w_up, w_down, n)
        weights[fqn], sizes[fqn] = {up: w_up, "down_proj": w_down}, w_down.shape[i_down]
        packed = {"parts": 2} if module.has_gate else {}
        styles[fqn] = None if why[fqn] else \
            params(**{up: Shard(3 + i_up, **packed), "down_proj": Shard(3 + i_down)}) >> experts_core(module)
    changed = True
    while changed:  # tied weights: sharded only where every place holding them is the same weight, alike
        changed = False
        for fqn in [f for f, s in styles.items() if s is not None]:
            other = next(((name, o, a) for name, w in weights[fqn].items() for o, a in sorted(holders[id(w)])
                          if (o, a) != (fqn, name) and (a != name or styles.get(o) != styles[fqn])), None)
            if other is not None:
                name, o, a = other
                why[fqn] = f"its {name} is tied to {join(o, a)!r}, " + (
                    "another of its weights" if o == fqn else "a weight of no fused experts module"
                    if o not in styles else "which stays whole" if styles[o] is None else
                    "which is sharded otherwise")
                styles[fqn], changed = None, True
    return [Choice(fqn, None, f"left whole: {brief(why[fqn])}") if style is None else
            Choice(fqn, style, f"sharded on each expert's {sizes[fqn]} features, its output all-reduced "
                               "(transformers' 'moe_tp_experts')") for fqn, style in styles.items()]
