"""``suggest``: a tensor-parallel plan for any module, from its structure and one dry run.

1. Follow one forward on meta tensors (``follow``): the output features of each linear or
   embedding that reads a replicated input form a space; ops carry, join or break spaces;
   a linear contracting a space ends it.
2. Shard the groups of spaces nothing broke, that end in a row-wise linear, and that the
   mesh splits into whole heads (``decide``); the makers of the others compute whole, and
   the trace runs again until no group breaks.
3. Choose for each remaining linear and embedding (vocabulary-parallel embeddings, the head)
   the option of least cost (``standalone``).
4. Run the plan on fake ranks against the trace, op by op (``replay``): a group whose ranks
   would not compute their share (a view by a global head count) computes whole, and so does
   a module whose run fails; then the analysis of ``tpfn.check`` proves the plan, and a module
   where it finds other numbers than one device's (a scale read from a local width) computes
   its groups whole.
5. Dry-run the plan as ``tpfn.explain`` does: a module it refuses computes whole, and the
   collectives it counts (the route a real step takes) are the header's.

Steps 1-5 run on the model with each stack of equal blocks cut to two of each kind
(``tpfn.analysis.repeats``): the plan and its notes are said of every block, and the header
counts each kept block's collectives once per block it stands for. Every module left whole
that holds a share of the parameter bytes says why (``tpfn.suggest.unseen``). The plan is
returned with notes that say why.
"""

from __future__ import annotations

import attrs

import torch.distributed as dist
import torch.nn as nn

from tpfn._fqn import generalize, join, within
from tpfn.analysis.hybrid import hybrid_copy
from tpfn.analysis.inputs import example
from tpfn.analysis.check import analysed
from tpfn.analysis.repeats import Repeats, distinct
from tpfn.analysis.replay import Failure, named_in, replay
from tpfn.analysis.trace import follow
from tpfn.dryrun.collectives import record
from tpfn.dryrun.cost import Machine
from tpfn.dryrun.explain import explain
from tpfn.errors import PlanError
from tpfn.dryrun.units import fmt_bytes
from tpfn.plans.mount import try_mount
from tpfn.plans.refusals import split_heads
from tpfn.layout import Shard
from tpfn.plans.plan import Plan, resolve
from tpfn.style.constructors import colwise, rowwise
from tpfn.suggest.channels import Block, blocks as channel_blocks
from tpfn.suggest.choose import Choice, sequence_parallel, standalone
from tpfn.suggest.emit import assemble, brief, general, maker
from tpfn.suggest.experts import experts
from tpfn.suggest.groups import Refused, decide
from tpfn.suggest.sizes import candidates, sizes, style
from tpfn.suggest.unseen import unseen

__all__ = ["suggest", "sharded_share", "step_counts"]

_REACHES_OUTPUT = "they reach the model's output"
_WEIGHED = ("all_reduce", "all_gather", "reduce_scatter")  # the collectives of the choices


def _world_size(world_size) -> int:
    if world_size is None:
        return dist.get_world_size() if dist.is_initialized() else 2
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise TypeError(f"'world_size' must be a positive int (got {world_size!r} that is a "
                        f"{type(world_size)!r}).")
    return world_size


def suggest(model: nn.Module, world_size: int | None = None, example_inputs: object = None, *,
            loss_parallel: bool = False, machine: Machine | None = None) -> Plan:
    """A tensor-parallel plan for ``model`` over ``world_size`` ranks, printed as the code
    that builds it, each rule with a comment that says why.

    - ``world_size``: the ranks (default: the default group's size, else 2).
    - ``example_inputs``: as ``tpfn.explain`` takes them; a transformers model defaults to one
      sequence of token ids. Sizes matter where suggest weighs bytes moved per step against
      bytes held per rank (``tpfn.suggest.cost``).
    - ``loss_parallel``: leave the logits of a head that makes the model's output sharded,
      for ``tpfn.cross_entropy`` (default: gathered, usable as they are).
    - ``machine``: a ``tpfn.dryrun.cost.Machine`` (``calibrate``, or given): the choices are
      weighed in seconds per step on it, as ``explain``'s predicted step time counts them
      (each collective over its link, the optimizer's step on the bytes held), instead of
      in bytes; the plan's header says which.

    What it cannot shard safely stays whole, with the reason in the plan's comments; the
    plan is dry-run on fake ranks, forward and backward, before it is returned.

    >>> mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    >>> print(tpfn.suggest(mlp, 2, example_inputs=torch.randn(8, 16)))  # doctest: +NORMALIZE_WHITESPACE
    plan({
        # tpfn.suggest over 2 ranks: 1 group sharded, 99% of the parameter bytes; per step 1
        # all_reduce, 512 B per rank
        # over 2 ranks: 0 (64 features) column-wise; 2 row-wise, one all-reduce
        '0': colwise(),
        '2': rowwise(),
    })

    Given a ``Machine``, a lone module (here an embedding) is sharded where that saves time
    per step: on links whose every ring step costs a second it is left whole (the pairs are
    sharded whatever the links, as they are not weighed).

    >>> from collections import OrderedDict
    >>> from tpfn.dryrun.cost import Link, Machine
    >>> slow = Machine(flops=1e11, bandwidth=2e10, op=5e-6, links=tuple(
    ...     (kind, Link(latency=1.0, bandwidth=1e9)) for kind in ("all_reduce", "all_gather", "reduce_scatter")))
    >>> lm = nn.Sequential(OrderedDict(embed=nn.Embedding(4096, 16), norm=nn.LayerNorm(16), mlp=mlp))
    >>> dict(tpfn.suggest(lm, 2, example_inputs=(1, 8)).notes)["embed"]
    'sharded on its features, its output gathered: moves 256 B per step, holds 128.0 KiB per rank of 256.0 KiB'
    >>> print(dict(tpfn.suggest(lm, 2, example_inputs=(1, 8), machine=slow).notes)["embed"])
    ... # doctest: +NORMALIZE_WHITESPACE
    left whole: its optimizer step takes 91.8 µs, sharding it takes 1 s per step
    (collectives 1 s, optimizer 45.9 µs)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"'model' must be an nn.Module (got {model!r} that is a {type(model)!r}).")
    if machine is not None and not isinstance(machine, Machine):
        raise TypeError(f"'machine' must be a tpfn.dryrun.cost.Machine (from calibrate(mesh), or "
                        f"given) or None (got {machine!r} that is a {type(machine)!r}).")
    missing = [k for k in _WEIGHED if machine is not None and k not in dict(machine.links)]
    if missing:
        raise ValueError(f"suggest weighs {', '.join(_WEIGHED)} on 'machine', which has no link figures "
                         f"for {', '.join(missing)}: calibrate it on a mesh, or give Link(latency, "
                         "bandwidth) for each.")
    n = _world_size(world_size)
    args, kwargs = example(model, example_inputs)
    meta = hybrid_copy(model)
    small, repeats = distinct(meta)
    try:
        found = _derive(small, n, args, kwargs, loss_parallel, machine, type(model).__name__)
    except Exception:  # noqa: BLE001 - the whole model says why, below
        if small is meta:
            raise
        found = None
    if small is not meta and (found is None or _spans(found.groups, repeats)):
        small, repeats = meta, Repeats(repeats.fqns)  # blocks that do not stand alone: every one
        found = _derive(meta, n, args, kwargs, loss_parallel, machine, type(model).__name__)
    mounts = resolve(found.plan, small)
    placed = {join(m.fqn, name) for m in mounts for name, _ in m.params}  # (a block places its children's)
    bound = {m.fqn for m in mounts} | {fqn for fqn, module in small.named_modules() if all(
        join(fqn, name) in placed for name, _ in module.named_parameters(recurse=False))}
    quiet = unseen(small, bound, {*dict(found.plan.notes), *(f for p in found.pairs for f in (*p.makers, *p.exits))})
    plan = assemble(small, found.flow, found.groups, found.choices + quiet, found.pairs, n, found.extra, repeats)
    sharded, total = sharded_share(meta, plan)
    counts, moved = step_counts(small, found.comms, found.partial, repeats)
    groups = sum(repeats.weight(min(g.entries)) for g in found.groups) + sum(  # and each attention sharded whole
        repeats.weight(c.fqn) for c in found.choices
        if c.style is not None and isinstance(small.get_submodule(c.fqn), nn.MultiheadAttention)) + sum(
        repeats.weight(b.fqn) for b in found.blocks)  # and each channel-parallel block
    header = (f"tpfn.suggest over {n} ranks: {groups} group{'s' * (groups != 1)} sharded, "
              f"{round(100 * sharded / total) if total else 0}% of the parameter bytes; per step "
              f"{_counts(counts)}, {fmt_bytes(moved)} per rank")
    sequence = sequence_parallel(found.groups, found.flow, n, machine, repeats.weight)
    weighed = machine and ("lone modules weighed in seconds per step on the given Machine: their "
                           "collectives over its links, and the optimizer's step on the bytes held")
    header += "".join(f"\n{note}" for note in (weighed, found.skipped, sequence) if note)
    return plan.noted({None: general(header)})  # (the plan the last check passed)


@attrs.frozen
class _Found:
    """What the dry runs of a model found: its plan (the last the checks passed), the traced
    forward, the groups sharded, the lone modules' choices, the pairs left whole, the sizes
    held per rank, the collectives of one step as explain counts them (the ranks' check's
    where explain's dry run fails and names no module) and the parameters whose gradients are
    summed at the end of the backward, and why the check's backward did not run."""

    plan: Plan
    flow: object
    groups: list
    choices: list
    pairs: list
    extra: dict
    comms: list
    partial: tuple
    skipped: str | None
    blocks: list = ()


def _derive(meta: nn.Module, n: int, args: tuple, kwargs: dict, loss_parallel: bool, machine, name: str) -> _Found:
    """Steps 1-5 of the module docstring on ``meta`` (a ``hybrid_copy``, or one cut short)."""
    excluded: dict = {}   # maker -> why its group computes whole
    pairs: dict = {}      # the makers of a pair left whole -> Refused
    whole: dict = {}      # lone module -> why it computes whole
    outputs: set = set()  # makers whose features are the model's output
    held: dict = {}       # module -> {(attribute, how)}: sizes it holds per rank (per_rank)
    tried: dict = {}      # modules (by pattern) whose sizes were looked for -> why they failed
    minimized = False
    found = channel_blocks(meta, n)
    live = {b.fqn: b for b in found if isinstance(b, Block)}  # channel-parallel blocks not (yet) failed
    said = {fqn: why for fqn, why in (b for b in found if not isinstance(b, Block))}  # block -> why whole
    sizes = dict.fromkeys(live, ())  # block -> attributes held per rank
    trimmed = False
    while True:
        flow = follow(meta, args, kwargs, {**excluded, **{f: "" for b in live.values() for f in b.linears}})
        groups, refused = decide(flow, n)
        refused = refused or _unmountable(meta, groups, n)
        if refused:
            for r in refused:
                if r.why == _REACHES_OUTPUT:
                    outputs.update(r.makers)
                excluded.update({f: r.why for f in r.makers if f not in excluded})
                if r.exits or r.why != _REACHES_OUTPUT and any(k in ("linear", "conv") for k in r.kinds):
                    pairs.setdefault(r.makers, r)
            continue
        used = {f for g in groups for f in (*g.entries, *g.exits)} | {f for b in live.values() for f in b.members}
        base = standalone(meta, flow, used, n, loss_parallel, outputs, whole, machine) + experts(meta, n, whole)
        choices = base + _blocks(live, sizes, said, flow, n)
        extra = _extra(held, groups)
        plan = assemble(meta, flow, groups, choices, list(pairs.values()), n, extra)
        failed, comms, skipped = replay(meta, plan, n, args, kwargs, flow, observe=record)
        if failed and _block_failed(failed, live, sizes, said):
            continue
        if not failed and any(sizes.values()) and not trimmed:
            _fewest_sizes(sizes, lambda trial: not replay(meta, assemble(
                meta, flow, groups, base + _blocks(live, trial, said, flow, n), list(pairs.values()), n, extra),
                n, args, kwargs, flow, backward=False)[0])
            trimmed = True
            continue
        if failed and _look_for_sizes(failed, groups, meta, held, tried):
            continue
        if not failed and held and not minimized:
            _fewest(held, lambda h: not replay(meta, assemble(meta, flow, groups, choices, [], n, _extra(
                h, groups)), n, args, kwargs, flow, backward=False)[0])
            minimized = True
            continue
        if not failed and plan.rules:  # the analysis: what no shape shows (a scale read from a local width)
            failed = {f.fqn: Failure(f.why, f.fqn) for f in analysed(meta, plan, n, args, kwargs)[1]
                      if f.kind == "wrong"}
        partial: tuple = ()
        if not failed:  # explain's dry run: it takes the plan, and counts what a real step issues
            try:
                report = explain(meta, plan, world_size=n, example_inputs=kwargs or args)
                comms, partial = report.comms, report.partial_grads
            except PlanError as e:  # the modules it names compute whole (else the ranks' check's counts)
                failed = named_in(e.problems, [m.fqn for m in resolve(plan, meta)])
        if failed and _block_failed(failed, live, sizes, said, sized=False):
            continue
        if not failed:
            return _Found(plan, flow, groups, choices, list(pairs.values()), extra, comms, partial, skipped,
                          list(live.values()))
        before = (len(excluded), len(whole))
        failed = {f: x if x.line else attrs.evolve(x, why=tried.get(generalize(x.where), x.why))
                  for f, x in failed.items()}  # (a line that fails says more than the first reason)
        _blame(failed, groups, excluded, pairs, whole, choices)
        if (len(excluded), len(whole)) == before:
            raise RuntimeError(f"suggest's dry run of {name} on {n} fake ranks fails where "
                               f"nothing is sharded: {next(iter(failed.values())).why}")


def _blocks(live: dict, sizes: dict, said: dict, flow, n: int) -> list:
    """The ``Choice`` of each channel-parallel block (``tpfn.suggest.channels``) and its children,
    with ``sizes``' attributes held per rank; a note on each block left whole."""
    called = set(flow.firsts)
    out = []
    for fqn, block in live.items():
        styles = block.styles(called, sizes[fqn])
        out += [Choice(f, style, block.describe(n) if f == fqn else None) for f, style in styles.items()]
    return out + [Choice(fqn, None, f"left whole: {brief(why)}") for fqn, why in said.items()]


def _block_failed(failed: dict, live: dict, sizes: dict, said: dict, sized: bool = True) -> bool:
    """Where a module of a channel-parallel block fails: first hold the block's sizes per rank
    (``sized``: where not held yet), else leave the block whole with the reason (its modules then
    planned as any others); whether any block changed."""
    changed = False
    for fqn, block in list(live.items()):
        mine = [x for f, x in failed.items() if f == fqn or within(f, fqn)]
        if not mine:
            continue
        if sized and not sizes[fqn] and block.sizes:
            sizes[fqn] = block.sizes
        else:
            said[fqn] = f"a channel-parallel block, but {mine[0].why}"
            del live[fqn]
        changed = True
    return changed


def _fewest_sizes(sizes: dict, passes) -> None:
    """Leave out of each block's ``sizes`` each attribute without which the check still ``passes``."""
    for fqn in sorted(sizes):
        for name in sizes[fqn]:
            trial = {**sizes, fqn: tuple(x for x in sizes[fqn] if x != name)}
            if passes(trial):
                sizes.update(trial)


def _spans(groups: list, repeats: Repeats) -> bool:
    """Whether a group's makers and exits lie in more than one block of a stack cut short (or
    in one and outside it): the whole model would pair them otherwise."""
    for group in groups:
        blocks = {next((b for b in repeats.kept if within(f, b)), None) for f in (*group.entries, *group.exits)}
        if len(blocks) > 1:
            return True
    return False


def step_counts(small: nn.Module, comms: list, partial: tuple, repeats: Repeats) -> tuple:
    """``({kind: count}, bytes per rank)`` of one forward and backward of the whole model's
    plan from ``comms``, the collectives ``tpfn.explain`` counts on ``small`` (the model with
    its stacks cut short, on the route a real step takes): each collective of a kept block
    once per block it stands for, the gradients summed at the end of the backward (``partial``:
    their parameters) by the parameters they sum."""
    sizes = {name: p.numel() for name, p in small.named_parameters()}
    ends = sum(sizes.get(p, 0) for p in partial)
    scale = sum(sizes.get(p, 0) * repeats.weight(p.rpartition(".")[0]) for p in partial) / ends if ends else 1
    counts: dict = {}
    moved = 0
    for c in comms:
        counts[c.kind] = counts.get(c.kind, 0) + repeats.weight(c.fqn)
        moved += c.bytes * (repeats.weight(c.fqn) if c.fqn is not None else scale)
    return counts, int(moved)


def _look_for_sizes(failed: dict, groups: list, model: nn.Module, held: dict, tried: dict) -> bool:
    """Where a group's module computes other shapes than its share, hold the attributes that
    may be its global sizes per rank (``tpfn.suggest.sizes``), on every module of its kind in
    the groups; whether any were found. ``tried``: the modules looked at, and the first
    reason each failed for."""
    found = False
    for fqn, failure in failed.items():
        for group in (g for g in groups if fqn in g.modules):
            pattern = generalize(failure.where)
            if not failure.where or pattern in tried:
                continue
            tried[pattern] = failure.why
            named = candidates(model.get_submodule(failure.where), sizes(group))
            if named or any(generalize(m) == pattern for m, _, _ in group.inputs):
                for m, _ in model.named_modules():
                    if generalize(m) == pattern:
                        held[m] = set(named)
                found = True
    return found


def _extra(held: dict, groups: list) -> dict:
    """The per_rank style of each module of (or around) a sharded group that holds sizes per
    rank (with the inputs its group found laid out per head)."""
    inputs: dict = {}
    for group in groups:
        for module, name, heads in group.inputs:
            inputs.setdefault(module, {})[name] = heads
    ours = {".".join(f.split(".")[:i]) for g in groups for f in g.modules
            for i in range(len(f.split(".")) + 1)} | set(inputs)  # the groups' modules and around them
    return {m: style(found, inputs.get(m)) for m, found in held.items()
            if m in ours and (found or inputs.get(m))}


def _fewest(held: dict, passes) -> None:
    """Leave out of ``held`` each attribute (on every module that holds it) without which the
    check still ``passes``."""
    for path, how in sorted({(p, h) for found in held.values() for p, h in found}, key=str):
        trial = {m: {x for x in found if x != (path, how)} for m, found in held.items()}
        if passes(trial):
            held.clear()
            held.update(trial)


def _blame(failed: dict, groups: list, excluded: dict, pairs: dict, whole: dict, choices: list) -> None:
    """Make the groups (or lone modules) of the failed modules compute whole; where a module
    the plan does not bind fails (its input an output of a lone module, written in place),
    every sharded lone module."""
    lone = {c.fqn for c in choices if c.style is not None}
    for fqn, failure in failed.items():
        why = failure.why
        mine = [g for g in groups if fqn in g.modules] or [   # or the groups inside it (its sizes held)
            g for g in groups if any(within(m, fqn) for m in g.modules)] or _around(fqn, groups, lone)
        if fqn not in lone and not mine:
            whole.update({f: why for f in lone if f not in whole})
        for group in mine:
            excluded.update({f: why for f in group.entries if f not in excluded})
            pairs.setdefault(tuple(sorted(group.entries)), Refused(tuple(sorted(group.entries)),
                                                                   group.exits, why))
        if not mine:
            whole.setdefault(fqn, why)


def _around(fqn: str, groups: list, lone: set) -> list:
    """The groups in the innermost module around ``fqn`` that holds any (a dropout between a
    pair's halves), where no sharded lone module is as near."""
    parts = fqn.split(".")
    for k in range(len(parts) - 1, 0, -1):
        scope = ".".join(parts[:k])
        found = [g for g in groups if any(within(m, scope) for m in g.modules)]
        if any(within(f, scope) for f in lone):
            return []
        if found:
            return found
    return []


def _unmountable(model: nn.Module, groups: list, n: int) -> list:
    """The groups with a module whose row refuses its style, or whose column-wise projections
    of an attention ``parallelize`` refuses on ``n`` ranks (heads its ranks do not split, by
    the attention's ``head_dim``), as ``Refused``."""
    modules = dict(model.named_modules())
    found = []
    for group in groups:
        styles = {**{f: maker(e) for f, e in group.entries.items()}, **dict.fromkeys(group.exits, rowwise()),
                  **dict.fromkeys(group.channels, colwise())}
        mounts = {fqn: try_mount(style, modules[fqn], fqn, (), ()) for fqn, style in styles.items()}
        problems = [p for m in mounts.values() if isinstance(m, list) for p in m] or split_heads(
            modules, list(mounts.values()), n)
        if problems:
            found.append(Refused(tuple(group.entries), group.exits, problems[0]))
    return found


def _counts(counts: dict) -> str:
    return ", ".join(f"{k} {kind}" for kind, k in counts.items()) or "no collective"


def sharded_share(model: nn.Module, plan) -> tuple:
    """(bytes of the parameters ``plan`` shards, bytes of all parameters) of ``model``."""
    placed = {join(m.fqn, name): p for m in resolve(plan, model) for name, p in m.params}
    sharded = total = 0
    for name, p in model.named_parameters():
        b = p.numel() * p.element_size()
        total += b
        sharded += b if isinstance(placed.get(name), Shard) else 0
    return sharded, total
