"""Lints: what in a parallelized module works badly or not at all, found before it runs.

Each function takes the rows of a report (``tpfn.report.Row``) or the parallelized module
and returns sentences; repeated blocks say it once, with their count. They come in two
severities: a *warning* says the numbers would be wrong (``tpfn explain`` then exits 1), a
*note* that it works, at a cost in memory or bytes.

Warnings:

- ``heads``: column-wise projections with fewer heads (or KV heads) than ranks, or a head
  count the mesh size does not divide;
- ``head_counts``: a module that holds the global head count of the column-wise projections
  whose local shards it reshapes (``view(B, T, self.n_head, -1)`` is then silently wrong),
  or the query heads per KV head where KV heads are replicated (``num_key_value_groups``),
  and that its style does not hold per rank (``per_rank``, the fix each sentence names);
- ``fused``: a fused q, k, v projection whose parts ``colwise()`` cuts across (the fix:
  ``colwise(parts=(q, k, v))``).

Notes:

- ``replicated_heads``: KV heads replicated over groups of ranks (``colwise(heads=h)``),
  explained with the bytes their gradients' sums move;
- ``uneven``: a sharded parameter dim the mesh size does not divide;
- ``siblings``: parameters left unsharded where a sibling of the same shape shards them.

And ``failure``: where a dry run failed, with a hint for the usual causes.

A dry run at a symbolic world size runs at stand-in sizes; ``shown`` (the symbol) makes the
sentences name the stand-in (``the 4 ranks (the stand-in world size t=4)``).
"""

from __future__ import annotations

import re
import sys

import torch.nn as nn

from tpfn._fqn import describe, generalize, join
from tpfn.analysis.where import failing_module
from tpfn.layout import Shard
from tpfn.plans.refusals import linear_width, local_colwise, once, part_widths, projected_heads
from tpfn.style.constructors import per_rank

__all__ = ["uneven", "replicated_heads", "head_counts", "ratios", "fused", "siblings", "failure",
           "local_colwise", "named_ranks"]

# Attribute names that hold head counts, head sizes and model widths in common attention code
# (nanoGPT, minGPT, transformers, torchtitan, Megatron-style); their values must be positive ints.
HEADS = ("n_head", "n_heads", "num_heads", "num_attention_heads", "n_q_heads", "num_q_heads",
         "num_query_heads")
KV_HEADS = ("n_kv_head", "n_kv_heads", "num_kv_heads", "num_key_value_heads", "n_kv",
            "num_kv", "n_kv_groups")
# The query heads per KV head (transformers' num_key_value_groups, Megatron's and vLLM's ratios).
GROUPS = ("num_key_value_groups", "n_rep", "num_queries_per_kv", "num_kv_groups")
HEAD_SIZES = ("head_dim", "head_size", "attention_head_size", "d_head", "dim_head", "d_k")
WIDTHS = ("n_embd", "n_embed", "embed_dim", "hidden_size", "d_model", "dim", "all_head_size")


def _shards(mounts: dict, fqn: str):
    """The colwise() core at ``fqn`` whose module hands on local shards (not gathered), or None."""
    core = local_colwise(mounts, fqn)
    if core is None:
        return None
    slots = mounts[fqn].outputs.slots
    last = (slots[0].desired if slots[0].desired is not None else slots[0].given) if slots else None
    return core if last is None or isinstance(last, Shard) else None


def named_ranks(world_size: int, shown=None) -> str:
    """``'the 4 ranks'``, naming the stand-in where the world size is a symbol."""
    if shown is None or shown == world_size:
        return f"the {world_size} ranks"
    return f"the {world_size} ranks (the stand-in world size {shown}={world_size})"


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _held(sub: nn.Module, names) -> list:
    """``[(name, value)]`` of the positive int attributes of ``sub`` among ``names``."""
    return [(n, vars(sub)[n]) for n in names if _count(vars(sub).get(n))]


def _config(module: nn.Module, fqn: str, names):
    """The first of ``names`` in the ``config`` of ``fqn``'s module or its nearest ancestor
    that has one (nanoGPT's ``GPT.config``, transformers' ``self.config``), else None."""
    parts = fqn.split(".") if fqn else []
    for i in range(len(parts), -1, -1):
        config = vars(module.get_submodule(".".join(parts[:i]))).get("config")
        found = [v for v in (getattr(config, n, None) for n in names) if _count(v)]
        if found:
            return found[0]
    return None


def _local_children(sub: nn.Module, fqn: str, mounts: dict) -> list:
    """``[(name, child, core)]``: the linear children bound to colwise() with local shards."""
    found = [(name, child, _shards(mounts, join(fqn, name))) for name, child in sub.named_children()]
    return [(name, child, core) for name, child, core in found if core is not None and linear_width(child)]


def uneven(rows, world_size: int) -> list:
    """Sharded parameters whose dim the mesh size does not divide.

    >>> uneven(tpfn.explain(nn.Embedding(10, 4), rowwise(), world_size=4).rows, 4)
    ["'weight' Shard(dim=0) is uneven over 4 ranks: (10, 4) -> (3, 4) on ranks 0-2, (1, 4) on rank 3; pad dim 0 (10) to a multiple of 4, or choose a mesh size that divides it."]
    """
    found = []
    for row in rows:
        for p in row.params:
            if p.tied is None and len(p.local) > 1:
                full, dim = join(row.fqn, p.name), p.placement.dim
                found.append((generalize(full), (
                    f"{full!r} {p.placement!r} is uneven over {world_size} ranks: {p.text}; pad dim "
                    f"{dim} ({p.shape[dim]}) to a multiple of {world_size}, or choose a mesh size "
                    "that divides it.")))
    return once(found)


def replicated_heads(module: nn.Module, world_size: int, mounts: dict, shown=None) -> list:
    """KV heads that ``colwise(heads=h)`` replicates over groups of ranks, explained: each
    group holds one head, and the gradients of its copies are summed at the end of the backward;
    ``mounts`` maps FQNs to ``tpfn.mounted(...)``. (Heads the ranks cannot split into whole heads
    each are refused by ``parallelize``: ``tpfn.plans.refusals``.)

    >>> from tpfn.dryrun import fake_mesh
    >>> attention = nn.Module()
    >>> attention.head_dim, attention.q, attention.k = 4, nn.Linear(16, 16), nn.Linear(16, 8)
    >>> plan = {"q": colwise(), "k": colwise(heads=2)}
    >>> _ = tpfn.parallelize(attention, fake_mesh(4), plan, src_rank=None)
    >>> replicated_heads(attention, 4, {"q": tpfn.mounted(attention.q), "k": tpfn.mounted(attention.k)})
    ["'k' of '<root>' (Module) replicates 2 heads of 4 features over the 4 ranks: each head is held by a group of 2 ranks (colwise(heads=2)), whose copies each see their own ranks' query heads, so at the end of the backward the gradients of the 2 replicated parameters (68 elements per rank) are summed within each group, in one all-reduce."]
    """
    found = []
    for fqn, sub in module.named_modules():
        for (n, replicated), names in projected_heads(sub, fqn, mounts).items():
            if not replicated or n >= world_size:
                continue
            who, many = f"{', '.join(map(repr, names))} of {describe(sub, fqn)}", len(names) != 1
            params = [(name, p) for name in names for p, _ in mounts[join(fqn, name)].params]
            numel = sum(sub.get_submodule(name).get_parameter(p).numel() for name, p in params)
            found.append((generalize(fqn) + str(n) + "r", (
                f"{who} replicate{'' if many else 's'} {n} heads of {sub.head_dim} features over "
                f"{named_ranks(world_size, shown)}: each head is held by a group of {world_size // n} ranks "
                f"(colwise(heads={n})), whose copies each see their own ranks' query heads, so at the end of "
                f"the backward the gradients of the {len(params)} replicated parameter{'s' * (len(params) != 1)} "
                f"({numel // n} elements per rank) are summed within each group, in one all-reduce.")))
    return once(found)


def _global(sub, fqn, module, value, kv, widths, size):
    """The children whose global (KV) head count ``value`` (held by ``sub``) is, or [] if it is not
    one: by the head size where ``sub`` has one, else by the config the model was built from,
    else by the width ``sub`` holds (nanoGPT's ``n_embd``), else by the widest projection."""
    if size is not None:
        counts = {n: w // size for n, w in widths.items() if w % size == 0}
        if not counts or value != (min if kv else max)(counts.values()):
            return []
        return [n for n, c in counts.items() if c == value]
    config = _config(module, fqn, KV_HEADS if kv else HEADS)
    widest = max(widths.values())
    if config is not None:
        if value != config:
            return []
    elif kv:
        return []  # a KV count without a head size or a config: nothing to tell it by
    else:
        width = next((v for _, v in _held(sub, WIDTHS)), None)
        if width not in (None, widest) or widest % value:
            return []  # a local width: its numbers are per rank already
    names = [n for n, w in widths.items() if w % value == 0]
    return ([n for n in names if widths[n] != widest] or names) if kv else names


def head_counts(module: nn.Module, world_size: int, mounts: dict, shown=None) -> list:
    """Modules that hold the global head (or KV head) count of column-wise children whose
    local shards they are handed: a view by it (``view(B, T, self.n_head, -1)``) makes heads
    of the wrong size on every rank, and nothing fails.

    >>> attention = nn.Module()
    >>> attention.n_head, attention.c_attn = 4, nn.Linear(64, 192)
    >>> report = tpfn.explain(attention, {"c_attn": colwise(parts=3)}, world_size=2)
    >>> print(report.lints[0])
    '<root>' (Module) holds n_head = 4, the global head count of 'c_attn', whose colwise(parts=3) hands on local shards: each of the 2 ranks holds 2 of the 4 heads, so a view by n_head heads (view(B, T, self.n_head, -1)) makes heads of the wrong size, silently; hold the local count (2) with per_rank('n_head') in its style, view with -1 heads of the head size, or hand it DTensors with colwise(local=False).
    """
    if world_size == 1:
        return []
    found = []
    for fqn, sub in module.named_modules():
        children = _local_children(sub, fqn, mounts)
        if not children:
            continue
        widths = {name: part_widths(child, core)[0] for name, child, core in children}
        cores = {name: core for name, _, core in children}
        size = next((v for _, v in _held(sub, HEAD_SIZES)), None)
        local_here = {path for path, _ in getattr(mounts.get(fqn), "sizes", ())}  # per_rank(...)
        found += _ratios(sub, fqn, world_size, cores, shown, local_here)
        ranks = named_ranks(world_size, shown)
        for names, kv in ((HEADS, False), (KV_HEADS, True)):
            for attr, value in _held(sub, names):
                members = [] if attr in local_here else _global(sub, fqn, module, value, kv, widths, size)
                if not members:
                    continue
                what = "KV head count" if kv else "head count"
                whose = ", ".join(map(repr, members))
                style = " and ".join(dict.fromkeys(repr(cores[n]) for n in members))
                start = (f"{describe(sub, fqn)} holds {attr} = {value}, the global {what} of {whose}, "
                         f"whose {style} hand{'s' if len(members) == 1 else ''} on local shards: ")
                view = (f"so a view by {attr} heads (view(B, T, self.{attr}, -1)) makes heads of the "
                        "wrong size, silently; hold the local count ({}) with {!r} in its style, view "
                        "with -1 heads of the head size")
                if value < world_size and all(cores[n].heads is not None for n in members):
                    problem = (f"each of {ranks} holds 1 of the {value} heads (each held by "
                               f"{world_size // value} ranks), {view.format(1, per_rank(attr, heads=value))}.")
                elif value % world_size == 0:
                    problem = (f"each of {ranks} holds {value // world_size} of the {value} heads, "
                               f"{view.format(value // world_size, per_rank(attr))}, or hand it DTensors "
                               "with colwise(local=False).")
                elif size is None:  # with a head size, heads() says it
                    problem = (f"{ranks} cannot split {value} heads into whole heads each; choose a mesh "
                               f"size that divides {value}.")
                else:
                    continue
                found.append((generalize(fqn) + "." + attr, start + problem))
    return once(found)


def ratios(module: nn.Module, world_size: int, mounts: dict, shown=None) -> list:
    """The query heads per KV head of the whole model held where KV heads are replicated over
    groups of ranks (``_ratios``), for every module: a warning beside the analysis' findings,
    whose sentence names the ratio and its fix."""
    found = []
    for fqn, sub in module.named_modules():
        children = _local_children(sub, fqn, mounts)
        if children and world_size > 1:
            local_here = {path for path, _ in getattr(mounts.get(fqn), "sizes", ())}
            found += _ratios(sub, fqn, world_size, {name: core for name, _, core in children}, shown, local_here)
    return once(found)


def _ratios(sub: nn.Module, fqn: str, world_size: int, cores: dict, shown, local_here: set) -> list:
    """A module that holds the query heads per KV head (``num_key_value_groups``) of the
    whole model while its KV heads are replicated over groups of ranks: each rank then holds
    one KV head and fewer query heads, so the ratio it computes with is smaller."""
    kv = sorted(name for name, core in cores.items() if core.heads is not None
                and core.heads < world_size)
    if not kv:
        return []
    h = cores[kv[0]].heads
    found = []
    for attr, value in _held(sub, GROUPS):
        local = value * h // world_size
        if local == value or attr in local_here:
            continue
        whose = ", ".join(map(repr, kv))
        found.append((generalize(fqn) + "." + attr, (
            f"{describe(sub, fqn)} holds {attr} = {value}, the query heads per KV head of the "
            f"whole model, but {whose} replicate{'s' if len(kv) == 1 else ''} each of their {h} "
            f"KV heads over a group of {world_size // h} of {named_ranks(world_size, shown)}: each "
            f"rank computes {local} query head{'s' * (local != 1)} against 1 KV head, so "
            f"repeating the KV heads by {attr} (transformers' eager attention, or its sdpa with "
            f"a mask) makes {value} KV heads for {local}; take the ratio from the local shapes "
            f"(q.shape[1] // k.shape[1]), as transformers' sdpa does without a mask (enable_gqa), "
            f"or hold the local ratio ({local}) with {per_rank(attr, per_head=h)!r} in its style.")))
    return found


def fused(module: nn.Module, world_size: int, mounts: dict) -> list:
    """Fused q, k, v projections (``out_features == (heads + 2 * kv_heads) * head_dim`` by the
    attributes or the config of their module) whose colwise() cuts across the three parts:
    contiguous shards of one fused output, or parts other than q, k and v (equal parts of a
    GQA q wider than k and v); ``colwise(parts=(q, k, v))`` gives each rank its slice of each.

    >>> attention = nn.Module()
    >>> attention.num_heads, attention.num_key_value_heads, attention.head_dim = 8, 2, 16
    >>> attention.qkv = nn.Linear(128, 192)
    >>> print(tpfn.explain(attention, {"qkv": colwise()}, world_size=2).lints[0])
    'qkv' of '<root>' (Module) fuses q, k and v of unequal sizes (8 heads and 2 + 2 KV heads of 16 features: 128 + 32 + 32 = 192 features), and colwise() cuts its output into 2 contiguous shards of 96 features, across q, k and v, so each rank computes attention on the wrong features, silently; use colwise(parts=(128, 32, 32)), which gives each rank its slice of q, of k and of v.
    >>> report = tpfn.explain(attention, {"qkv": colwise(parts=(128, 32, 32))}, world_size=2)
    >>> [lint for lint in report.lints if "fuses" in lint]
    []
    """
    if world_size == 1:
        return []
    found = []
    for fqn, sub in module.named_modules():
        children = _local_children(sub, fqn, mounts)
        if not children or not _held(sub, HEADS + KV_HEADS + HEAD_SIZES):
            continue  # not an attention module (an MLP's widths may match by chance)
        held = next((v for _, v in _held(sub, HEADS)), None)
        heads = held if held is not None else _config(module, fqn, HEADS)
        if heads is None:
            continue
        kv = next((v for _, v in _held(sub, KV_HEADS)), None) or (
            _config(module, fqn, KV_HEADS) if held is None else None) or heads
        size = next((v for _, v in _held(sub, HEAD_SIZES)), None) or _config(module, fqn, HEAD_SIZES)
        width = next((v for _, v in _held(sub, WIDTHS)), None)
        if size is None and width is not None and width % heads == 0:
            size = width // heads
        if size is None or kv > heads:
            continue
        q, total = heads * size, (heads + 2 * kv) * size
        right = (q, kv * size, kv * size)
        for name, child, core in children:
            if linear_width(child) != total or Shard(0, core.parts).sizes(total) == right:
                continue
            cut = (f"cuts its output into {world_size} contiguous shards of {total // world_size} "
                   "features, across q, k and v" if core.parts == 1 else
                   f"cuts it into parts of {' + '.join(map(str, Shard(0, core.parts).sizes(total)))}"
                   " features, not q, k and v")
            what = (f"q, k and v of unequal sizes ({heads} heads and {kv} + {kv} KV heads of "
                    f"{size} features: {q} + {kv * size} + {kv * size} = {total} features)"
                    if kv < heads else
                    f"q, k and v ({heads} heads of {size} features each: 3 x {q} = {total} features)")
            fix = f"colwise(parts={right!r})" if kv < heads else "colwise(parts=3)"
            sentence = (
                f"{name!r} of {describe(sub, fqn)} fuses {what}, and {core!r} {cut}, so each rank "
                f"computes attention on the wrong features, silently; use {fix}, which gives each "
                "rank its slice of q, of k and of v.")
            found.append((generalize(fqn) + "." + name, sentence))
    return once(found)


def _sharded(module: nn.Module, prefix: str, rows: dict) -> dict:
    """``{relative name: placement}`` of every parameter under ``module`` (None: unsharded)."""
    out = {}
    for name, p in module.named_parameters():
        owner, _, leaf = f"{prefix}.{name}".lstrip(".").rpartition(".")
        placement = next((q.placement for q in rows[owner].params if q.name == leaf), None)
        out[name] = placement if isinstance(placement, Shard) else None
    return out


def siblings(module: nn.Module, rows) -> list:
    """Parameters left unsharded where a sibling module of the same type and shapes shards them.

    >>> pair = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})
    >>> siblings(pair, tpfn.explain(pair, {"a": colwise()}, world_size=2).rows)
    ["'b' (Linear) keeps weight, bias whole on every rank while its sibling 'a' shards them (weight Shard(dim=0), bias Shard(dim=0)); bind 'b' in the plan too, or leave both unsharded."]
    """
    by_fqn = {r.fqn: r for r in rows}
    found = []
    for fqn, parent in module.named_modules():
        groups: dict = {}
        for name, child in parent.named_children():
            shapes = tuple((n, tuple(p.shape)) for n, p in child.named_parameters())
            if shapes:
                groups.setdefault((type(child), shapes), []).append(join(fqn, name))
        for members in groups.values():
            placed = {m: _sharded(module.get_submodule(m), m, by_fqn) for m in members}
            for m in members:
                if by_fqn[m].style is not None:
                    continue  # bound in the plan: its style says how it is sharded
                other = next((o for o in members if any(
                    placed[o][n] is not None and placed[m][n] is None for n in placed[m])), None)
                if other is None:
                    continue
                names = [n for n in placed[m] if placed[other][n] is not None and placed[m][n] is None]
                how = ", ".join(f"{n} {placed[other][n]!r}" for n in names)
                found.append((generalize(m) + "|" + generalize(other), (
                    f"{describe(module.get_submodule(m), m)} keeps {', '.join(names)} whole on every "
                    f"rank while its sibling {other!r} shards {'it' if len(names) == 1 else 'them'} "
                    f"({how}); bind {m!r} in the plan too, or leave both unsharded.")))
    return once(found)


def _reader(exc: BaseException) -> str:
    """``'find_packed_sequence_indices' (transformers/masking_utils.py:761)``: the innermost frame
    of the traceback outside torch and tpfn, the code that asked for a value."""
    skip = tuple(sys.modules[name].__file__.rpartition("/")[0] + "/" for name in ("torch", "tpfn"))
    tb, found = exc.__traceback__, None
    while tb is not None:
        code = tb.tb_frame.f_code
        if not code.co_filename.startswith(skip):
            found = (code.co_name, code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    if found is None:
        return "the forward"
    name, path, line = found
    return f"{name!r} ({path.rpartition('site-packages/')[2]}:{line})"


def _unpack_hint(sub, fqn: str, mounts: dict, world_size: int, text: str):
    """nanoGPT's ``q, k, v = self.c_attn(x).split(self.n_embd, dim=2)`` on a local shard."""
    children = _local_children(sub, fqn, mounts)
    counts = re.search(r"expected (\d+), got (\d+)", text)
    if not children or counts is None:
        return None
    expected, got = map(int, counts.groups())
    name, child, core = next((c for c in children if c[2].parts == expected), children[0])
    out, parts = linear_width(child), len(part_widths(child, core))
    part = out // (parts if parts > 1 else expected)
    width = next((n for n, v in _held(sub, WIDTHS) if v == part), None)
    attr, hold = ("", "") if width is None else (f" ({width} = {part})", f" with {per_rank(width)!r} in its style")
    pieces = f"{got} piece{'s' if got != 1 else ''}"
    held, who = f"{out // world_size} of its {out} features", repr(fqn or "<root>")
    if parts == 1:
        return (f"{who} splits the local output of its colwise() {name!r}: each of the {world_size} "
                f"ranks holds {held}, so a split by the global size{attr} gives {pieces}, not "
                f"{expected}; bind it to colwise(parts={expected}), so that each rank holds its slice "
                f"of every part, and split by the local size{hold} or with .chunk({expected}, dim=-1).")
    return (f"{who} splits the local output of its {core!r} {name!r}: each of the {world_size} ranks "
            f"holds {held} (1/{world_size} of each of its {parts} parts), so a split by the global "
            f"size{attr} gives {pieces}, not {expected}; split by the local size ({out // parts} // "
            f"{world_size} = {out // parts // world_size}){hold}, or with .chunk({parts}, dim=-1), or "
            "hand it DTensors with colwise(local=False).")


def _rowwise_hint(sub, fqn: str, mounts: dict, text: str):
    """A rowwise() linear handed a whole input: no colwise() module before it."""
    core = mounts[fqn].style.core if fqn in mounts else None
    if getattr(core, "kind", None) != "rowwise" or not isinstance(sub, nn.Linear):
        return None
    dims = re.search(r"\[(?:\d+, )*(\d+)\] X \[(\d+), \d+\]", text) or re.search(
        r"\(\d+x(\d+) and (\d+)x\d+\)", text)
    if dims is None:
        return None
    got, local = map(int, dims.groups())
    if got != sub.in_features or local == got:
        return None
    return (f"{fqn or '<root>'!r} is rowwise(): each rank holds {local} of its {got} input features, so "
            f"it takes the local shard that a colwise() module hands on, but its input has all {got} "
            "(the global in_features): no colwise() module feeds it; bind the projection before it to "
            "colwise(), or split a replicated input with prepare_in(Replicate()) >> rowwise().")


def _meta_hint(module: nn.Module, exc: BaseException):
    """A value read from a meta tensor (``.item()``, ``bool()``): the dry run has none where a
    value is computed from the weights (its inputs and buffers keep theirs)."""
    return (f"{_reader(exc)} reads the value of a tensor computed from the weights (.item(), bool(), "
            "a branch on it), but the dry run's parameters are meta tensors, which hold no values; "
            "make that value a Python number (an attribute or an argument), or leave out the "
            "example inputs for placements and declared layouts only.")


def failure(exc: BaseException, module: nn.Module, mounts: dict, world_size: int, phase: str,
            stand_ins: dict | None = None) -> str:
    """Where a dry run failed (the innermost module of ``module`` in the traceback) and why;
    ``stand_ins`` (symbol -> value) names the stand-in sizes of a symbolic dry run.

    >>> linear = nn.Linear(2, 2)
    >>> try:
    ...     linear(torch.ones(3))
    ... except RuntimeError as e:
    ...     print(failure(e, linear, {}, 2, "forward"))
    the dry run's forward failed in '<root>' (Linear): RuntimeError: mat1 and mat2 shapes cannot be multiplied (1x3 and 2x2)
    """
    fqn = failing_module(exc, module)
    where = f" in {describe(module.get_submodule(fqn), fqn)}" if fqn is not None else ""
    if stand_ins:
        where += " at the stand-in sizes " + ", ".join(
            f"{x}={v}" for x, v in sorted(stand_ins.items(), key=lambda kv: str(kv[0])))
    text = str(exc)
    message = f"the dry run's {phase} failed{where}: {type(exc).__name__}: {text}"
    sub = module.get_submodule(fqn) if fqn is not None else None
    local = [name for name, _ in sub.named_children() if local_colwise(mounts, join(fqn, name))] \
        if sub is not None else []
    split = sub is not None and all(n % world_size == 0 for n, replicated in projected_heads(sub, fqn, mounts)
                                    if not replicated)
    sep = " " if message[-1] in ".!?" else ". "
    name, hint = fqn or "<root>", None
    if fqn is not None and "got mixed torch.Tensor and DTensor" in text:
        hint = (f"{name!r} computes on DTensors it is handed, but holds plain parameters: bind it in "
                "the plan (colwise(), rowwise(), replicate(), ...), or hand it local tensors.")
    elif local and split and "is invalid for input of size" in text:
        hint = (f"{name!r} reshapes the local outputs of its colwise() {', '.join(map(repr, local))}: "
                f"each of the {world_size} ranks holds 1/{world_size} of their features (of the heads), "
                "so a view with the global head count fails; hold the local count (heads // "
                f"{world_size}) with per_rank('n_heads') (the attribute it views by) in its style, "
                "view with -1, or hand it DTensors with colwise(local=False).")
    elif sub is not None and isinstance(exc, ValueError) and "values to unpack" in text:
        hint = _unpack_hint(sub, fqn, mounts, world_size, text)
    elif sub is not None and isinstance(exc, RuntimeError) and (
            "same reduction dim" in text or "cannot be multiplied" in text):
        hint = _rowwise_hint(sub, fqn, mounts, text)
    elif "meta tensor" in text and ("item()" in text or "no data" in text):
        hint = _meta_hint(module, exc)
    return message if hint is None else f"{message}{sep}Hint: {hint}"
