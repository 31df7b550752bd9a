"""A stack of equal blocks is one block: what the dry runs need of a deep model.

A model's layers are most often an ``nn.ModuleList`` (or ``nn.Sequential``) of blocks built
alike: the same module kinds, parameter shapes and settings, only their index differs (an int
attribute equal to each block's position in every block, transformers' ``layer_idx``). ``distinct(model)``
finds every such stack (the outermost ones) and returns a structural copy of ``model`` that
keeps, of each, the shortest run of leading blocks holding every kind of block it has twice
where it repeats (two blocks for Llama's 32, three for T5's, whose first block holds the
relative position bias), sharing the modules it keeps; and a ``Repeats`` that names, for
each block kept, the blocks of the whole model it stands for: the second of each kind stands
for the later ones. Two of a kind show what passes from one block to the next: where a group
of features spans two blocks (a stack of linears and activations, one pair in each two),
suggest analyses every block (``tpfn.suggest``).
Tracing and checking the copy sees every distinct block once, so a plan for 80 layers costs
what one for a few costs; what the copy found is said of the whole model through
``Repeats.expand`` (its rules and notes) and ``Repeats.weight`` (its collectives).

Blocks whose parameters are shared with another block, whose buffers hold other values, or
that are single modules (a stack of linears and activations) are not merged.

>>> import torch.nn as nn
>>> stack = nn.Sequential(nn.Linear(4, 4), nn.ModuleList(nn.Sequential(nn.Linear(4, 8), nn.ReLU(),
...                                                            nn.Linear(8, 4)) for _ in range(5)))
>>> small, repeats = distinct(stack)
>>> len(small[1]), len(stack[1]), repeats.expand("1.1.2")
(2, 5, ['1.1.2', '1.2.2', '1.3.2', '1.4.2'])
>>> repeats.weight("1.0"), repeats.weight("1.1"), repeats.weight("0"), repeats.weight(None)
(1, 4, 1, 1)
"""

from __future__ import annotations

import attrs
import torch
import torch.nn as nn

from tpfn._fqn import join, within
from tpfn._torch import with_children

__all__ = ["Repeats", "distinct"]

_PLAIN = (int, float, str, bool, type(None))


@attrs.frozen
class Repeats:
    """``fqns``: every module name of the whole model; ``kept``: each block kept (its name, the
    same in both) -> the whole model's blocks it stands for, itself first."""

    fqns: tuple
    kept: dict = attrs.field(factory=dict)

    def expand(self, fqn: str) -> list:
        """The whole model's modules that ``fqn`` (a module of the copy) stands for."""
        for block, copies in self.kept.items():
            if within(fqn, block):
                rest = fqn[len(block):]
                return [c + rest for c in copies]
        return [fqn]

    def weight(self, fqn: str | None) -> int:
        """How many of the whole model's modules ``fqn`` stands for (None: outside every module, 1)."""
        return 1 if fqn is None else len(self.expand(fqn))


def _plain(value) -> bool:
    return isinstance(value, _PLAIN) or isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value)


def _settings(block: nn.Module) -> dict:
    """``{(module, attribute): value}`` of the plain settings of a block's modules."""
    return {(name, k): v for name, m in block.named_modules() for k, v in vars(m).items()
            if not k.startswith("_") and _plain(v)}


def _signature(block: nn.Module, settings: dict, index: set) -> tuple:
    """What makes two blocks of a stack compute alike: module kinds, settings (those equal to
    the block's index in every block left out), parameter and buffer shapes."""
    mods = tuple((name, type(m)) for name, m in block.named_modules())
    kept = tuple(sorted((k, v) for k, v in settings.items() if k not in index))
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters())
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in block.named_buffers())
    return mods, kept, params, buffers


def _same_values(a: nn.Module, b: nn.Module) -> bool:
    return all(x.is_meta or y.is_meta or torch.equal(x, y) for x, y in zip(a.buffers(), b.buffers()))


def _kept(stack: nn.Module) -> tuple:
    """``(k, {i: [j, ...]})``: the leading blocks of ``stack`` to keep, and the blocks each
    stands for; ``(None, {})`` where the stack is not merged."""
    blocks = list(stack.children())
    if len(blocks) < 2 or not all(any(True for _ in b.children()) and any(True for _ in b.parameters())
                                  for b in blocks):
        return None, {}
    owners: dict = {}
    for i, b in enumerate(blocks):
        for p in b.parameters():
            if owners.setdefault(id(p), i) != i:
                return None, {}  # blocks sharing parameters
    settings = [_settings(b) for b in blocks]
    index = {k for k, v in settings[0].items() if all(type(s.get(k)) is int and s[k] == i  # (layer_idx)
                                                       for i, s in enumerate(settings))}
    seen: dict = {}  # signature -> the blocks that have it
    for i, b in enumerate(blocks):
        alike = seen.setdefault(_signature(b, settings[i], index), [])
        if alike and not _same_values(blocks[alike[0]], b):
            return None, {}
        alike.append(i)
    k = max(alike[:2][-1] for alike in seen.values()) + 1  # each kind of block twice, where it repeats
    if k >= len(blocks):
        return None, {}
    stands = {i: [i] for i in range(k)}
    for alike in seen.values():
        stands[alike[1] if len(alike) > 1 else alike[0]] += [j for j in alike[2:]]
    return k, stands


def distinct(model: nn.Module) -> tuple:
    """``(small, Repeats)``: a structural copy of ``model`` with each stack of equal blocks cut
    to the blocks that differ (the modules it keeps are ``model``'s own), and what each kept
    block stands for (see the module docstring)."""
    fqns = tuple(f for f, _ in model.named_modules())
    cuts: dict = {}   # stack fqn -> blocks kept
    kept: dict = {}
    for fqn, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or any(
                within(fqn, s) for s in cuts):
            continue
        k, stands = _kept(module)
        if k is None:
            continue
        names = [name for name, _ in module.named_children()]
        cuts[fqn] = k
        kept.update({join(fqn, names[i]): tuple(join(fqn, names[j]) for j in js) for i, js in stands.items()})
    if not cuts:
        return model, Repeats(fqns)
    return _cut(model, "", cuts), Repeats(fqns, kept)


def _cut(module: nn.Module, fqn: str, cuts: dict) -> nn.Module:
    """A shallow copy of ``module`` whose stacks under it (``cuts``: fqn -> blocks kept) are cut;
    modules off the paths to them are shared."""
    if not any(within(s, fqn) for s in cuts):
        return module
    children = list(module.named_children())
    if fqn in cuts:
        return with_children(module, dict(children[:cuts[fqn]]))
    return with_children(module, {name: _cut(child, join(fqn, name), cuts) for name, child in children})
