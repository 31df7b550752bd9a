"""What ``parallelize`` refuses of a model before anything changes, beyond each style's own
problems (``tpfn.plans.mount.problems``): a model ``fully_shard`` already manages, modules whose
style would never run or could not place them (a lazy module's uninitialized parameters,
``nn.MultiheadAttention``'s ``out_proj``, an ``nn.Linear`` subclass with LoRA adapters of its
own), a parameter the plan places that a module outside the plan computes with (a head tied to
a sharded embedding), gradient hooks that would see one rank's partial sums, and column-wise
projections of an attention whose heads the ranks cannot split into whole heads each.

>>> import torch.nn as nn, tpfn
>>> model = nn.Sequential(nn.LayerNorm(4))
>>> _ = model[0].weight.register_hook(lambda g: g.clamp(-1, 1))
>>> bound = tpfn.resolve({"0": tpfn.sequence_parallel()}, model)
>>> print(refusals(dict(model.named_modules()), bound)[0][:82])
parameter '0.weight' has gradient hooks (register_hook or register_post_accumulate
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from tpfn._fqn import describe, generalize, join, within
from tpfn._torch import gradient_hooks, parameter, parameters_of
from tpfn.layout import Partial, Shard
from tpfn.plans.kinds import Conv1D

__all__ = ["refusals", "tied_outside", "local_colwise", "linear_width", "part_widths", "projected_heads",
           "split_heads", "once"]


def refusals(modules: dict, bound: tuple, n: int | None = None) -> list:
    """The problems of the model whose ``{fqn: module}`` is ``modules``, with the ``Mount`` of
    every bound module in ``bound``, on ``n`` ranks (None: any), one line each."""
    return _fully_sharded(modules) + _unrunnable(modules, bound) \
        + _hooks_on_partial_sums(modules, bound, n) + ([] if n is None else split_heads(modules, bound, n))


def local_colwise(mounts: dict, fqn: str):
    """The colwise() core bound at ``fqn`` with local outputs, or None (``mounts``: FQN -> ``Mount``)."""
    mount = mounts.get(fqn)
    core = None if mount is None else mount.style.core
    return core if getattr(core, "kind", None) == "colwise" and mount.outputs.local else None


def linear_width(child: nn.Module):
    """The output features of a linear layer (``nn.Linear``, transformers' ``Conv1D``), else None."""
    return child.out_features if isinstance(child, nn.Linear) else child.nf if isinstance(child, Conv1D) else None


def part_widths(child: nn.Module, core) -> tuple:
    """The output features of each part a colwise() core packs in ``child``."""
    return Shard(0, core.parts).sizes(linear_width(child))


def projected_heads(sub: nn.Module, fqn: str, mounts: dict) -> dict:
    """``{(heads, replicated): [child names]}`` of the colwise() projections of an attention
    module (one with an int ``head_dim``): the heads each part projects, and whether
    ``heads=`` replicates them over groups of ranks."""
    head_dim = getattr(sub, "head_dim", None)
    if not isinstance(head_dim, int) or head_dim < 1:
        return {}
    out: dict = {}
    for name, child in sub.named_children():
        core = local_colwise(mounts, join(fqn, name))
        if core is None or not linear_width(child):
            continue
        try:
            sizes = part_widths(child, core)
        except ValueError:  # parts that do not make the weight (parallelize names that)
            continue
        for width in dict.fromkeys(sizes):
            if width % head_dim == 0:
                out.setdefault((width // head_dim, core.heads is not None), []).append(name)
    return out


def split_heads(modules: dict, bound, n: int) -> list:
    """Column-wise projections of an attention whose heads (or KV heads) ``n`` ranks cannot
    split into whole heads each: its view of their local shards by its head size would fail
    with a bare shape error. Repeated blocks are said once, with their count."""
    mounts, found = {m.fqn: m for m in bound}, []
    for fqn, sub in modules.items():
        counts = projected_heads(sub, fqn, mounts)
        most = max((h for h, _ in counts), default=0)  # the query heads, where fewer are KV heads
        for (h, replicated), names in counts.items():
            if replicated or h % n == 0:
                continue
            if h < n:
                single = all(local_colwise(mounts, join(fqn, name)).parts == 1 for name in names)
                fix = (f", or replicate the heads over groups of ranks with colwise(heads={h})"
                       if n % h == 0 and single and h < most else "")
                problem = (f"fewer heads than the {n} ranks, so colwise() cannot give each rank a whole head; "
                           f"use at most {h} ranks for tensor parallelism{fix}")
            else:
                problem = (f"the {n} ranks do not divide them, so ranks would hold parts of heads; choose a "
                           f"mesh size that divides {h}")
            who, many = f"{', '.join(map(repr, names))} of {describe(sub, fqn)}", len(names) != 1
            sentence = f"{who} project{'' if many else 's'} {h} heads of {sub.head_dim} features: {problem}."
            found.append((generalize(fqn) + str(h), sentence))
    return once(found)


def once(found: list) -> list:
    """One sentence per key of ``found`` (``(key, sentence)`` pairs), counting the modules
    behind it: repeated blocks are said once."""
    seen: dict = {}
    for key, sentence in found:
        seen.setdefault(key, [sentence, 0])[1] += 1
    return [s if n == 1 else f"{s[:-1]} (and {n - 1} more like it)." for s, n in seen.values()]


def _fully_sharded(modules: dict) -> list:
    """FSDP2 first: its all-gathers would hand the bound modules whole parameters."""
    fsdp = [fqn for fqn, sub in modules.items() if isinstance(sub, FSDPModule)]
    if not fsdp:
        return []
    names = ", ".join(describe(modules[f], f) for f in fsdp[:3]) + (", ..." if len(fsdp) > 3 else "")
    return [f"{names} {'is' if len(fsdp) == 1 else 'are'} already sharded by fully_shard (FSDP2): "
            "its all-gathers would hand the bound modules whole parameters; parallelize the fresh "
            "model first, then fully_shard it on the data-parallel mesh (docs/training.md)."]


def _unrunnable(modules: dict, bound) -> list:
    """Bound modules whose style would never run, or could not place their parameters."""
    found = []
    for m in bound:
        sub, owner = modules[m.fqn], m.fqn.rpartition(".")[0]
        lazy = [n for n, p in sub.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
        if lazy:
            found.append(f"{describe(sub, m.fqn)} has uninitialized parameters ({', '.join(lazy)}: a lazy "
                         "module); run one forward with a real batch first, so that they have their "
                         "shapes, then parallelize.")
        base = next((k for k in (nn.Linear, nn.Embedding) if isinstance(sub, k)), None)
        own = base is not None and m.params and m.shards is None and type(sub).forward is not base.forward
        computing = [n for n, c in sub.named_children() if any(True for _ in c.parameters())
                     and all(b.fqn != join(m.fqn, n) for b in bound)] if own else []
        if computing:  # its own forward on DTensors, its adapters' plain weights
            found.append(f"{describe(sub, m.fqn)} is an nn.{base.__name__} with a forward of its own and "
                         f"submodules that compute ({', '.join(computing)}): {m.style!r} shards "
                         f"nn.{base.__name__}'s own weight, which they would meet in shards; bind the "
                         "submodules instead, or describe it with params(...) >> on_shards(...) (docs/styles.md).")
        parent = modules.get(owner) if m.fqn else None
        if isinstance(parent, nn.MultiheadAttention) and m.fqn.rpartition(".")[2] == "out_proj" \
                and all(b.fqn != owner for b in bound):  # (bound too: its own style says so)
            found.append(f"{describe(sub, m.fqn)} is nn.MultiheadAttention's out_proj, whose weights "
                         f"{describe(parent, owner)}'s forward reads directly, never calling it, so "
                         f"{m.style!r} would never run; bind the MultiheadAttention {owner!r} itself "
                         "(colwise() shards its heads).")
    return found


def tied_outside(modules: dict, bound) -> dict:
    """``{fqn: problem}`` of the modules outside every bound one that hold a parameter the plan
    places (a head tied to a sharded embedding): such a module would compute on plain inputs
    with the parameter's shard, so ``parallelize`` refuses its forward by name. One that never
    runs (T5's ``shared``, which its stacks' tied embeddings compute for) is no problem, nor a
    module around the one that places it (``_inside``)."""
    placed = {}  # id(parameter) -> (its name, where the plan places it, how)
    for m in bound:
        for name, placement in m.params:
            owner, _, leaf = join(m.fqn, name).rpartition(".")
            param = parameters_of(modules[owner]).get(leaf) if owner in modules else None
            if param is not None:
                placed.setdefault(id(param), (join(m.fqn, name), placement, m))
    inside = [m.fqn for m in bound]
    found = {}
    for fqn, sub in modules.items():
        if any(within(fqn, f) for f in inside):
            continue  # a bound module's style governs what it and its submodules compute with
        for leaf, param in parameters_of(sub).items():
            held = placed.get(id(param)) if param is not None else None
            if held is not None and held[0] != join(fqn, leaf) and not _inside(held[2].fqn, fqn):
                name, placement, m = held
                found.setdefault(fqn, f"parameter {join(fqn, leaf)!r} is tied to {name!r}, which {m.style!r} at "
                                 f"{m.where} places {placement!r}, but {describe(sub, fqn)} is outside the plan and "
                                 "computes with that shard; bind it with a style that places the parameter alike "
                                 "(colwise() for a head tied to a rowwise() embedding), or untie them.")
    return found


def _inside(fqn: str, parent: str) -> bool:
    """Whether module ``fqn`` lies within ``parent``: a parent that holds its child's parameter
    (BERT's ``cls.predictions.bias``, its decoder's) computes with it through the child."""
    return fqn != parent and within(fqn, parent)


def _hooks_on_partial_sums(modules: dict, bound, n: int | None) -> list:
    """Gradient hooks on parameters whose gradients are partial sums until the end of the
    backward: a hook would see one rank's terms, not the gradient (of heads replicated over
    groups of ranks, only where there are more ranks than heads)."""
    found = []
    for m in bound:
        placed = dict(m.params)
        for name, layout in (m.shards.param_grads if m.shards else ()):
            heads = getattr(placed.get(name), "heads", None)
            if heads is not None and n is not None and heads % n == 0:
                continue  # the ranks divide the heads: each holds whole ones, whole gradients
            if isinstance(layout, Partial) and gradient_hooks(parameter(modules[m.fqn], name)):
                found.append(
                    f"parameter {join(m.fqn, name)!r} has gradient hooks (register_hook or "
                    "register_post_accumulate_grad_hook), but under this plan its gradient is each "
                    "rank's partial sum until the end of the backward, so a hook would see one rank's "
                    "terms: remove them, and change the summed .grad after backward() instead.")
    return found
