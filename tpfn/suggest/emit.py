"""The plan of the chosen groups and lone modules, spelled with patterns and noted.

Each group's makers are ``colwise()`` (``parts=`` for a packed output, ``heads=`` where KV
heads are held by groups of ranks) and its exits ``rowwise()``; where two or more makers
under one parent read the parent's input, the parent takes it as one local replica,
``prepare_in(Replicate(), local=True)``, so their input gradients are summed before one
all-reduce (as ``from_hf`` does); a module whose replicated parameters meet the sharded
features gets their gradients as partial sums, summed at the end of the backward. Rules
shared by every layer are one pattern (``layers.*``), and every rule and every module left
whole carries a note that says why.
"""

from __future__ import annotations

import re

from tpfn._fqn import generalize, matches, spell
from tpfn.layout import Partial, Replicate
from tpfn.plans.plan import plan as make_plan
from tpfn.style.constructors import colwise, on_shards, prepare_in, replicate, rowwise

__all__ = ["assemble", "brief", "general", "maker"]

SHARED = prepare_in(Replicate(), local=True)
BRIEF = 200  # the longest reason a note gives


def general(text: str) -> str:
    """``text`` with every quoted module name's layer numbers as ``*``."""
    return re.sub(r"'([\w.]*)'", lambda m: repr(generalize(m.group(1))), text)


def maker(entry):
    """The style of a module making a group's features."""
    if entry.parts:
        sizes = set(entry.parts)
        return colwise(parts=len(entry.parts) if len(sizes) == 1 else entry.parts)
    return colwise(heads=entry.heads) if entry.heads is not None else colwise()


def _common(fqns) -> str:
    """The innermost module holding all of ``fqns``."""
    parts = [f.split(".") for f in fqns]
    common = []
    for names in zip(*parts):
        if len(set(names)) > 1:
            break
        common.append(names[0])
    return ".".join(common)


def _short(fqn: str, parent: str) -> str:
    """``fqn`` named from ``parent``; in full where that would be a bare index (a child of an
    ``nn.Sequential``)."""
    short = fqn[len(parent) + 1:] if parent and fqn.startswith(parent + ".") else fqn
    return fqn if short.split(".")[0].isdigit() else short


def _replicas(names: tuple, first: str | None):
    """The parent's style: each input several makers read, one local replica."""
    if names == (first,):
        return SHARED
    kwargs = {n: Replicate() for n in names if n != first}
    return prepare_in(*([Replicate()] if first in names else []), kwargs=kwargs, local=True)


def _layers(name: str) -> str:
    """A relative module name with its layer numbers as ``*``, its own name (an
    ``nn.Sequential``'s child's index) as it is."""
    head, _, last = name.rpartition(".")
    return f"{generalize(head)}.{last}" if head else name


def _describe(group, n: int) -> str:
    """One line on a group: its makers with their heads, its exits (named from the module
    around them all, each layer's once)."""
    parent = _common([*group.entries, *group.exits])
    makers = {}
    for fqn, entry in sorted(group.entries.items()):
        heads = group.heads.get(fqn) or ()
        what = (f"{len(entry.parts)} parts of {entry.parts[0]}" if len(set(entry.parts)) == 1 else
                f"parts of {', '.join(map(str, entry.parts))}" if entry.parts else
                f"{heads[0]} heads held by groups of {n // heads[0]} ranks" if entry.heads else
                f"{heads[0]} heads" if heads else
                f"{entry.width} {'channels' if entry.kind == 'conv' else 'features'}")
        makers.setdefault(f"{_layers(_short(fqn, parent))} ({what})", None)
    exits = ", ".join(dict.fromkeys(_layers(_short(f, parent)) for f in group.exits))
    makers = list(makers)
    random = ""
    if group.random:
        where = ", ".join(sorted({repr(generalize(w)) for w in group.random}))
        random = (f"; dropout in {where} draws the same mask on every rank's features (in training, "
                  "tpfn.rng.sharded draws one per rank: docs/training.md)")
    channels = ", ".join(dict.fromkeys(_layers(_short(f, parent)) for f in group.channels))
    channels = f"; {channels} on each rank's channels" if channels else ""
    return (f"over {n} ranks: {', '.join(makers)} column-wise{channels}; {exits} row-wise, "
            f"{'one all-reduce each' if len(group.exits) > 1 else 'one all-reduce'}{random}")


def brief(why: str) -> str:
    """A reason in at most its first sentence of ``BRIEF`` characters."""
    first = re.split(r"(?<=[a-z)'])[.;] ", why.strip())[0].rstrip(".")
    return first if len(first) <= BRIEF else first[:BRIEF - 1].rstrip() + "…"


def assemble(model, flow, groups: list, choices: list, refused: list, n: int, extra: dict | None = None,
             repeats=None):
    """The plan (with its notes) of ``groups`` and lone ``choices``; ``refused``: the pairs
    left whole, and why; ``extra``: module -> a style to append (its sizes held per rank);
    ``repeats``: ``model`` is a stack cut short (``tpfn.analysis.repeats``), and the plan is the
    whole model's, each rule and note of a kept block said of every block it stands for."""
    styles, notes = {}, {}
    for group in groups:
        for fqn, entry in group.entries.items():
            styles[fqn] = maker(entry)
        for fqn in group.exits:
            styles[fqn] = rowwise()
        for fqn in group.channels:
            styles[fqn] = colwise()
        first = min(group.entries)
        for parent, names in group.parents:
            styles.setdefault(parent, _replicas(names, flow.firsts.get(parent)))
            first = min(first, parent)
        for owner, names in group.partial.items():
            style = replicate() >> on_shards(param_grads={n_: Partial() for n_ in names})
            styles[owner] = styles[owner] >> style if owner in styles else style
        notes[first] = _describe(group, n)
    for fqn, style in (extra or {}).items():
        styles[fqn] = styles[fqn] >> style if fqn in styles else style
    for choice in choices:
        if choice.style is not None:
            styles[choice.fqn] = choice.style
        if choice.note is not None:  # (None: a module its block's note speaks for)
            notes[choice.fqn] = choice.note
    for pair in refused:
        members = (*pair.makers, *pair.exits)
        if len(members) == 1:  # (a module chosen alone keeps its choice's note)
            if members[0] not in styles:
                notes[members[0]] = f"left whole: {brief(pair.why)}"
            continue
        parent = _common(members)
        names = ", ".join(_short(f, parent) for f in members)
        alone = any(f in styles for f in members)  # (sharded alone, by their own notes)
        text = f"{'no pair' if alone else 'left whole'}, {names}: {brief(pair.why)}"
        notes[parent] = f"{notes[parent]}; {text}" if parent in notes else text  # (a block's: why not one)
        for f in members:
            if notes.get(f, "").startswith("left whole"):
                del notes[f]
    fqns = [f for f, _ in model.named_modules()]
    if repeats is not None:
        styles = {f: style for fqn, style in styles.items() for f in repeats.expand(fqn)}
        notes = {f: text for fqn, text in notes.items() for f in repeats.expand(fqn)}
        fqns = repeats.fqns
    rules = spell(styles, fqns)
    kept = {}
    for fqn, text in sorted(notes.items()):
        pattern = next((p for p in rules if matches(p, fqn)), None)
        kept.setdefault(pattern if pattern is not None else generalize(fqn), general(text))
    return make_plan(rules, notes=kept)
