"""Lints: what in a parallelized module works badly or not at all, found before it runs.

Each function takes the rows of a report (``tpfn.report.Row``) or the parallelized module
and returns sentences; repeated blocks say it once, with their count.

- ``uneven``: a sharded parameter dim the mesh size does not divide;
- ``heads``: column-wise projections with fewer heads (or KV heads) than ranks, or a head
  count the mesh size does not divide;
- ``siblings``: parameters left unsharded where a sibling of the same shape shards them;
- ``failure``: where a dry run failed, with a hint for the usual causes.
"""

from __future__ import annotations

import torch.nn as nn

from tpfn._fqn import describe, generalize
from tpfn.layout import Shard

__all__ = ["uneven", "heads", "siblings", "failure"]


def _join(fqn: str, name: str) -> str:
    return f"{fqn}.{name}" if fqn else name


def _colwise(mounts: dict, fqn: str):
    """The colwise() core bound at ``fqn`` with local outputs, or None."""
    mount = mounts.get(fqn)
    core = None if mount is None else mount.style.core
    return core if getattr(core, "kind", None) == "colwise" and mount.outputs.local else None


def _once(found: list) -> list:
    """One sentence per (generalized key), counting the modules behind it."""
    seen: dict = {}
    for key, sentence in found:
        seen.setdefault(key, [sentence, 0])[1] += 1
    return [s if n == 1 else f"{s[:-1]} (and {n - 1} more like it)." for s, n in seen.values()]


def uneven(rows, world_size: int) -> list:
    """Sharded parameters whose dim the mesh size does not divide.

    >>> uneven(tpfn.explain(nn.Embedding(10, 4), rowwise(), world_size=4).rows, 4)
    ["'weight' Shard(dim=0) is uneven over 4 ranks: (10, 4) -> (3, 4) on ranks 0-2, (1, 4) on rank 3; pad dim 0 (10) to a multiple of 4, or choose a mesh size that divides it."]
    """
    found = []
    for row in rows:
        for p in row.params:
            if p.tied is None and len(p.local) > 1:
                full, dim = _join(row.fqn, p.name), p.placement.dim
                found.append((generalize(full), (
                    f"{full!r} {p.placement!r} is uneven over {world_size} ranks: {p.text}; pad dim "
                    f"{dim} ({p.shape[dim]}) to a multiple of {world_size}, or choose a mesh size "
                    "that divides it.")))
    return _once(found)


def _heads(sub: nn.Module, fqn: str, mounts: dict) -> dict:
    """``{heads: [child names]}`` of the colwise() projections of an attention module (one
    with an int ``head_dim``): the heads each projects."""
    head_dim = getattr(sub, "head_dim", None)
    if not isinstance(head_dim, int) or head_dim < 1:
        return {}
    out: dict = {}
    for name, child in sub.named_children():
        core = _colwise(mounts, _join(fqn, name))
        if core is not None and isinstance(child, nn.Linear) and \
                (child.out_features // core.parts) % head_dim == 0:
            out.setdefault(child.out_features // core.parts // head_dim, []).append(name)
    return out


def heads(module: nn.Module, world_size: int, mounts: dict) -> list:
    """Column-wise projections of an attention module whose heads (or KV heads) the ranks
    cannot split into whole heads each; ``mounts`` maps FQNs to ``tpfn.mounted(...)``.

    >>> from tpfn.dryrun import fake_mesh
    >>> attention = nn.Module()
    >>> attention.head_dim, attention.q, attention.k = 4, nn.Linear(16, 16), nn.Linear(16, 8)
    >>> _ = tpfn.parallelize(attention, fake_mesh(4), {"q": colwise(), "k": colwise()}, src_rank=None)
    >>> heads(attention, 4, {"q": tpfn.mounted(attention.q), "k": tpfn.mounted(attention.k)})
    ["'k' of '<root>' (Module) projects 2 heads of 4 features: fewer heads than the 4 ranks, so colwise() cannot give each rank a whole head; use at most 2 ranks for tensor parallelism."]
    """
    found = []
    for fqn, sub in module.named_modules():
        for n, names in _heads(sub, fqn, mounts).items():
            if n < world_size:
                problem = (f"fewer heads than the {world_size} ranks, so colwise() cannot give each "
                           f"rank a whole head; use at most {n} ranks for tensor parallelism")
            elif n % world_size:
                problem = (f"the {world_size} ranks do not divide them, so ranks would hold parts of "
                           f"heads; choose a mesh size that divides {n}")
            else:
                continue
            verb = "projects" if len(names) == 1 else "project"
            found.append((generalize(fqn) + str(n), (
                f"{', '.join(map(repr, names))} of {describe(sub, fqn)} {verb} {n} heads of "
                f"{sub.head_dim} features: {problem}.")))
    return _once(found)


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
                groups.setdefault((type(child), shapes), []).append(_join(fqn, name))
        for members in groups.values():
            placed = {m: _sharded(module.get_submodule(m), m, by_fqn) for m in members}
            for m in members:
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
    return _once(found)


def failure(exc: BaseException, module: nn.Module, mounts: dict, world_size: int, phase: str) -> str:
    """Where a dry run failed (the innermost module of ``module`` in the traceback) and why.

    >>> linear = nn.Linear(2, 2)
    >>> try:
    ...     linear(torch.ones(3))
    ... except RuntimeError as e:
    ...     print(failure(e, linear, {}, 2, "forward"))
    the dry run's forward failed in '<root>' (Linear): RuntimeError: mat1 and mat2 shapes cannot be multiplied (1x3 and 2x2)
    """
    names = {id(m): fqn for fqn, m in module.named_modules()}
    fqn = None
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            fqn = names[id(owner)]
        tb = tb.tb_next
    where = f" in {describe(module.get_submodule(fqn), fqn)}" if fqn is not None else ""
    message = f"the dry run's {phase} failed{where}: {type(exc).__name__}: {exc}"
    children = module.get_submodule(fqn).named_children() if fqn is not None else ()
    local = [name for name, _ in children if _colwise(mounts, _join(fqn, name))]
    split = fqn is not None and all(
        n % world_size == 0 for n in _heads(module.get_submodule(fqn), fqn, mounts))
    sep = " " if message[-1] in ".!?" else ". "
    if fqn is not None and "got mixed torch.Tensor and DTensor" in str(exc):
        message += (
            f"{sep}Hint: {fqn!r} computes on DTensors it is handed, but holds plain parameters: bind "
            "it in the plan (colwise(), rowwise(), replicate(), ...), or hand it local tensors.")
    elif local and split and "is invalid for input of size" in str(exc):
        message += (
            f"{sep}Hint: {fqn!r} reshapes the local outputs of its colwise() "
            f"{', '.join(map(repr, local))}: each of the {world_size} ranks holds 1/{world_size} "
            f"of their features (of the heads), so a view with the global head count fails; view "
            f"with the local count (heads // {world_size}) or -1, or hand it DTensors with "
            "colwise(local=False).")
    return message
