"""What the check finds: one op (or one slot) of the model that a plan makes compute other
numbers than one device, or that no rule proves.

A ``Finding`` names the module whose code ran the op (its FQN), the op as ATen names it (or
the slot, ``input 0``), the line of the model's source that called it, and why, in a
sentence. ``kind`` is ``"wrong"`` (the numbers differ from one device's) or ``"unproven"``
(an op on sharded values that no rule says how to treat). ``once`` folds the findings of
repeated blocks into one, with their count.

>>> f = Finding("layers.0.attn", "aten.view.default", "model.py:12", "views ...")
>>> g = Finding("layers.1.attn", "aten.view.default", "model.py:12", "views ...")
>>> [(x.fqn, n) for x, n in once([f, g])]
[('layers.*.attn', 2)]
>>> print(f)
'layers.0.attn' aten.view.default (model.py:12): views ...
"""

from __future__ import annotations

import attrs

from tpfn._fqn import generalize

__all__ = ["Finding", "once"]


@attrs.frozen
class Finding:
    """One op or slot that makes other numbers than one device (``kind="wrong"``) or that no
    rule proves (``kind="unproven"``): the module, the op, the source line and why."""

    fqn: str
    op: str
    line: str
    why: str
    kind: str = "wrong"

    def __str__(self) -> str:
        line = f"({self.line})" if self.line else ""
        where = " ".join(x for x in (repr(self.fqn or "<root>"), self.op, line) if x)
        return f"{where}: {self.why}"

    def to_dict(self) -> dict:
        return {"module": self.fqn, "op": self.op, "line": self.line, "why": self.why, "kind": self.kind}


def once(findings) -> list:
    """``[(finding, count), ...]``: findings that differ only by a block's index as one, whose
    FQN is the pattern of the blocks (``layers.*.attn``), in the order first found."""
    groups: dict = {}
    for f in findings:
        key = (generalize(f.fqn), f.op, f.line, generalize(f.why), f.kind)
        groups.setdefault(key, []).append(f)
    out = []
    for (pattern, *_), found in groups.items():
        first = found[0]
        out.append((first if len(found) == 1 else attrs.evolve(
            first, fqn=pattern, why=generalize(first.why)), len(found)))
    return out
