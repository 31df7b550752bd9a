"""Feature spaces: the output features of each column-wise candidate, and what binds them.

A space is made where a linear (or an embedding) computes from a replicated input: its
output features, which a column-wise plan would leave ``1/n`` on each rank. Spaces that
meet (q's heads against k's in attention, a gate against its up projection) must be
sharded alike: they are joined, and share one fate. A space is broken, with the reason,
where an op would need its features whole (a norm over them, a residual sum with a
replicated tensor, the model's output); it ends at each linear that contracts it (the
row-wise exits).

>>> s = Spaces()
>>> q, k = s.new("attn.q", 32), s.new("attn.k", 32)
>>> s.join(q, k)
>>> s.fail({k}, "a norm over them in 'attn'")
>>> s.broken(q)
"a norm over them in 'attn'"
"""

from __future__ import annotations

import attrs

__all__ = ["Space", "Spaces"]


@attrs.define
class Space:
    """One space: the module that makes it and its width; a part of a packed output
    (``split`` of a fused q, k, v) names the space it is part of, whose ``parts`` are the
    parts' widths."""

    producer: str
    width: int
    part_of: int | None = None
    parts: tuple = ()


class Spaces:
    """The spaces of one traced forward, joined into groups (union-find)."""

    def __init__(self):
        self.spaces: list = []
        self._parent: list = []
        self._broken: dict = {}   # root -> why
        self.units: dict = {}     # space -> {sizes its features split into: the mesh must divide them}
        self.exits: dict = {}     # space -> {fqn of a linear that contracts it}
        self.partial: dict = {}   # root -> {(owner fqn, parameter name)} whose gradient is partial
        self.inputs: dict = {}    # root -> {(module fqn, input name, heads)} laid out per head
        self.random: dict = {}    # root -> {module fqn where random numbers meet the features}
        self.channels: dict = {}  # root -> {(fqn, groups or None)}: modules on the features' channels
        self._made: dict = {}

    def _add(self, key, space: Space) -> int:
        if key not in self._made:
            self.spaces.append(space)
            self._parent.append(len(self._parent))
            self._made[key] = len(self.spaces) - 1
        return self._made[key]

    def new(self, producer: str, width: int) -> int:
        """The space of ``producer``'s ``width`` output features (one per producer: a module
        called twice makes one space)."""
        return self._add(producer, Space(producer, width))

    def part(self, space: int, sizes: tuple, index: int) -> int:
        """Part ``index`` of ``space`` split into parts of ``sizes`` (raises ValueError where
        the space was split otherwise before)."""
        whole = self.spaces[space]
        if whole.parts and whole.parts != tuple(sizes):
            raise ValueError(f"its features are split into parts of {whole.parts} and of {tuple(sizes)}")
        whole.parts = tuple(sizes)
        i = self._add((space, index), Space(whole.producer, sizes[index], space))
        self.join(space, i)
        return i

    def find(self, i: int) -> int:
        while self._parent[i] != i:
            self._parent[i] = self._parent[self._parent[i]]
            i = self._parent[i]
        return i

    def join(self, a: int, b: int) -> None:
        """One fate for the groups of ``a`` and ``b``."""
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        self._parent[rb] = ra
        if rb in self._broken:
            self._broken.setdefault(ra, self._broken.pop(rb))
        self.partial.setdefault(ra, set()).update(self.partial.pop(rb, set()))
        self.inputs.setdefault(ra, set()).update(self.inputs.pop(rb, set()))
        self.random.setdefault(ra, set()).update(self.random.pop(rb, set()))
        self.channels.setdefault(ra, set()).update(self.channels.pop(rb, set()))

    def fail(self, spaces, why: str) -> None:
        """Break the groups of ``spaces`` (the first reason stays)."""
        for s in spaces:
            self._broken.setdefault(self.find(s), why)

    def broken(self, i: int) -> str | None:
        return self._broken.get(self.find(i))

    def groups(self) -> dict:
        """root -> [space, ...] of every group."""
        out: dict = {}
        for i in range(len(self.spaces)):
            out.setdefault(self.find(i), []).append(i)
        return out
