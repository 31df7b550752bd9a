"""Which groups of spaces to shard over ``n`` ranks: the Megatron pairs a trace found.

A group (spaces joined in one fate, ``tpfn.analysis.spaces``) is sharded when nothing broke
it, it ends in at least one row-wise exit, no module both makes and contracts sharded
features, and ``n`` splits every space into whole heads: ``n`` divides each size its
features split into (heads), or, for a space with fewer heads than ranks (KV heads), the
heads divide ``n`` and each head is held by a group of ranks (``colwise(heads=h)``) while
the group's other spaces split evenly. Anything else stays replicated, with the reason.

>>> import torch, torch.nn as nn
>>> from tpfn.analysis.trace import follow
>>> from tpfn.analysis.hybrid import hybrid_copy
>>> mlp = hybrid_copy(nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)))
>>> chosen, refused = decide(follow(mlp, (torch.ones(2, 8),), {}), 2)
>>> chosen[0].entries, chosen[0].exits, refused
({'0': Entry(kind='linear', parts=(), heads=None, width=32)}, ('2',), [])
"""

from __future__ import annotations

import attrs

from tpfn._fqn import within

__all__ = ["Entry", "Group", "Refused", "decide"]


@attrs.frozen
class Entry:
    """A module making a group's features: its kind, its parts (a packed q, k, v: their
    widths), the heads held by groups of ranks (None: split evenly) and its width."""

    kind: str
    parts: tuple
    heads: int | None
    width: int


@attrs.frozen
class Group:
    """A group to shard: the modules making its features, those contracting them, the
    head counts of its spaces (producer -> sizes), and the parameters whose gradients are
    partial sums (owner module -> names)."""

    entries: dict
    exits: tuple
    heads: dict
    partial: dict
    parents: tuple = ()  # ((parent, the inputs several makers read), ...)
    inputs: tuple = ()   # ((module, input name, heads), ...): inputs laid out per head
    random: tuple = ()   # modules where random numbers (dropout) meet its features
    channels: tuple = ()  # modules on its features' channels (norms, depthwise convolutions): colwise()

    @property
    def modules(self) -> set:
        """Every module the group's rules bind."""
        return {*self.entries, *self.exits, *self.partial, *(p for p, _ in self.parents), *self.channels}


def _units(spaces, s: int) -> set:
    return spaces.units.get(s, set())


@attrs.frozen
class Refused:
    """A group left whole: the modules making its features, those contracting them, and why."""

    makers: tuple
    exits: tuple
    why: str
    kinds: tuple = ()


def decide(flow, n: int) -> tuple:
    """``(groups to shard, [Refused, ...])`` of a traced ``flow`` over ``n`` ranks."""
    spaces = flow.spaces
    roles: dict = {}
    kinds: dict = {}
    for call in flow.calls:
        roles.setdefault(call.fqn, set()).add(call.role)
        kinds[call.fqn] = call.kind
    chosen, refused = [], []
    for root, members in spaces.groups().items():
        whole = [s for s in members if spaces.spaces[s].part_of is None]
        producers = sorted({spaces.spaces[s].producer for s in whole})
        exits = sorted({e for s in members for e in spaces.exits.get(s, ())})
        why = spaces.broken(root) or _problem(spaces, members, exits, roles, n)
        if why:
            refused.append(Refused(tuple(producers), tuple(exits), why, tuple(kinds[p] for p in producers)))
            continue
        entries, heads = {}, {}
        for s in whole:
            space = spaces.spaces[s]
            parts = [p for p in members if spaces.spaces[p].part_of == s]
            units = set().union(*(_units(spaces, p) for p in parts)) if parts else _units(spaces, s)
            few = min(units, default=n) < n
            entries[space.producer] = Entry(kinds[space.producer], space.parts,
                                            min(units) if few else None, space.width)
            heads[space.producer] = tuple(sorted(units))
        partial: dict = {}
        for name in sorted(spaces.partial.get(root, ())):
            owner, _, leaf = name.rpartition(".")
            partial.setdefault(owner, []).append(leaf)
        outside = _outside(partial, [*entries, *exits])
        if outside:
            refused.append(Refused(tuple(producers), tuple(exits), (
                f"a tensor {outside!r} computes outside the pair meets its sharded features: the gradients "
                f"of {outside!r}'s parameters would be one rank's share on that path and whole on the others"),
                tuple(kinds[p] for p in producers)))
            continue
        chosen.append(Group(entries, tuple(exits), heads, {k: tuple(v) for k, v in partial.items()},
                            _shared(entries, flow), tuple(sorted(spaces.inputs.get(root, ()))),
                            tuple(sorted(spaces.random.get(root, ()))),
                            tuple(sorted({f for f, _ in spaces.channels.get(root, ())}))))
    return chosen, refused


def _outside(partial: dict, members: list) -> str | None:
    """The first module of ``partial`` (the owners of parameters whose gradients a group makes
    partial sums) outside the innermost module holding the group's ``members``: where its
    replicated output meets the sharded features, only that path's gradient is a partial sum."""
    scope = members[0].split(".")[:-1]
    for m in members[1:]:
        parts = m.split(".")[:-1]
        while scope != parts[:len(scope)]:
            scope = scope[:-1]
    prefix = ".".join(scope)
    return next((o for o in sorted(partial) if prefix and not within(o, prefix)), None)


def _shared(entries: dict, flow) -> tuple:
    """``((parent, names), ...)``: each parent whose inputs two or more of ``entries``, its
    children, read (``names``: those inputs, the first of its forward's first): it takes each
    as one local replica, so that their input gradients are summed before one all-reduce."""
    readers: dict = {}
    for call in flow.calls:
        if call.fqn in entries and call.role == "entry":
            parent = call.fqn.rpartition(".")[0]
            name = flow.named.get(parent, {}).get(call.input) if parent else None
            if name is not None:
                readers.setdefault(parent, {}).setdefault(name, set()).add(call.fqn)
    out = []
    for parent, names in sorted(readers.items()):
        shared = [n for n, fqns in names.items() if len(fqns) > 1]
        if shared:
            first = flow.firsts.get(parent)
            out.append((parent, tuple(sorted(shared, key=lambda n: (n != first, n)))))
    return tuple(out)


def _problem(spaces, members: list, exits: list, roles: dict, n: int) -> str | None:
    """Why a group that nothing broke cannot be sharded over ``n`` ranks (None: it can)."""
    if not exits:
        return "its output features reach no linear that contracts them"
    mixed = sorted(f for s in members for f in (spaces.spaces[s].producer, *spaces.exits.get(s, ()))
                   if {"entry", "exit"} <= roles.get(f, set()))
    if mixed:
        return f"{mixed[0]!r} both makes and contracts sharded features"
    on = spaces.channels.get(spaces.find(members[0]), set())
    for fqn, groups in sorted(on, key=str):
        if len(roles.get(fqn, ())) > 1:
            return f"{fqn!r} computes on sharded channels in one call and on whole ones in another"
        if groups is not None and groups % n:
            return (f"{n} ranks do not split {fqn!r}'s {groups} groups of channels into whole groups "
                    "(each rank computes whole groups)")
    even, few = [], []
    for s in members:
        space = spaces.spaces[s]
        if space.parts:
            continue
        units = _units(spaces, s)
        if not units:
            if space.width < n:
                return f"its {space.width} features are fewer than the {n} ranks"
            continue
        (even if all(u % n == 0 for u in units) else few).append((s, units))
    for s, units in few:
        u = min(units)
        if spaces.spaces[s].part_of is not None:
            return (f"{n} ranks do not split the {u} heads of a part of {spaces.spaces[s].producer!r} "
                    "(packed parts hold whole heads on each rank)")
        if u >= n or n % u or len(units) > 1 or not even:
            return f"{n} ranks do not split {spaces.spaces[s].producer!r}'s {u} heads into whole heads"
    return None
