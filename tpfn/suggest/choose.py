"""The modules outside the Megatron pairs: embeddings, heads, lone linears, each by its cost.

An ``nn.MultiheadAttention`` is a Megatron pair in one module: ``colwise()`` shards its heads
and ``out_proj`` row-wise, wherever it mounts on the ranks (not weighed, as pairs are not).

A linear or embedding that no sharded group makes or contracts takes a replicated input
and must hand on a replicated output. It can be sharded on its own: an embedding
vocabulary-parallel (``rowwise()``, its output all-reduced) or on its features
(``colwise()``, its output gathered); a linear column-wise with its output gathered, or
row-wise on its input's local chunk. Or it stays whole. Each option moves bytes per step
and holds bytes per rank, weighed in bytes or, given a ``Machine``, in seconds per step
(``tpfn.suggest.cost``); the cheapest wins, and modules that share a weight (an embedding
tied to the head) choose together, so that the tie holds one layout.
``loss_parallel`` keeps the logits of a head that makes the model's output sharded
(``colwise(local=False)``), for ``tpfn.cross_entropy``.
"""

from __future__ import annotations

import attrs

from tpfn.dryrun.units import fmt_bytes, fmt_seconds
from tpfn.layout import Partial, Replicate, Shard
from tpfn.plans.kinds import meaning
from tpfn.plans.mount import try_mount
from tpfn.plans.refusals import split_heads
from tpfn.style.constructors import colwise, params, prepare_in, prepare_out, rowwise
from tpfn.style.style import Style
from tpfn.suggest.cost import cost, moved, say, seconds
from tpfn.suggest.emit import brief

__all__ = ["Choice", "standalone", "sequence_parallel"]


@attrs.frozen
class _Option:
    """One way to shard a module alone: its style, how its output is made whole and how its
    input's gradient is (``(src, dst)`` moves, None: no move), and whether it shards a bias."""

    name: str
    style: Style
    out: tuple | None
    grad: tuple | None
    bias: bool


_REDUCE, _GATHER = (Partial(), Replicate()), (Shard(-1), Replicate())
_OPTIONS = {
    "linear": (_Option("column-wise, its output gathered", colwise() >> prepare_out(Replicate()),
                       _GATHER, _REDUCE, True),
               _Option("row-wise on its input's local chunk", prepare_in(Replicate()) >> rowwise(),
                       _REDUCE, _GATHER, False)),
    "embedding": (_Option("vocabulary-parallel", rowwise(), _REDUCE, None, False),
                  _Option("sharded on its features, its output gathered",
                          colwise() >> prepare_out(Replicate()), _GATHER, None, True)),
}
_LOSS_PARALLEL = _Option("column-wise, its logits left sharded for tpfn.cross_entropy (loss parallel)",
                         colwise(local=False), None, _REDUCE, True)
# An embedding whose own forward computes on DTensors takes its vocabulary-parallel output as
# it comes (from_hf does the same).
_OWN_FORWARD = prepare_in(Replicate()) >> params(weight=Shard(0)) >> prepare_out(Replicate())


@attrs.frozen
class Choice:
    """A module's style (None: whole) and why, in words."""

    fqn: str
    style: object
    note: str


def _held(modules: list, options: list, n: int) -> tuple:
    """(bytes held whole, bytes held per rank) of the modules' distinct parameters, each
    module sharded by its option (None: whole)."""
    seen, whole, per_rank = set(), 0, 0
    for module, option in zip(modules, options):
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            b = p.numel() * p.element_size()
            whole += b
            sharded = option is not None and (name != "bias" or option.bias)
            per_rank += -(-b // n) if sharded else b
    return whole, per_rank


def _moves(calls: list, option) -> list:
    """The ``(src, dst, shape, itemsize)`` moves of ``option`` per step, on every call."""
    steps = []
    for call in calls:
        if option.out is not None:
            steps.append((*option.out, call.out_shape, call.itemsize))
        if option.grad is not None:
            steps.append((*option.grad, call.in_shape, call.itemsize))
    return steps


def standalone(model, flow, used: set, n: int, loss_parallel: bool, outputs: set, whole: dict,
               machine=None) -> list:
    """A ``Choice`` for every linear and embedding of ``flow`` not in ``used`` (the modules of
    the sharded groups); ``outputs``: the modules whose output is the model's; ``whole``: the
    modules that compute whole, and why; ``machine``: weigh in seconds on it."""
    calls: dict = {}
    attentions = []
    for call in flow.calls:
        if call.kind == "attention":
            attentions += [] if call.fqn in attentions else [call.fqn]
        elif call.fqn not in used and call.kind in _OPTIONS:  # (a convolution alone stays whole: unseen says why)
            calls.setdefault(call.fqn, []).append(call)
    tied: dict = {}
    for fqn in calls:
        w = getattr(model.get_submodule(fqn), "weight", None)
        tied.setdefault(id(w) if w is not None else fqn, []).append(fqn)
    out = []
    for fqns in tied.values():
        kept = [f for f in fqns if f in whole]
        out += ([Choice(f, None, f"left whole: {brief(whole[kept[0]])}") for f in fqns] if kept
                else _choose(model, fqns, calls, n, loss_parallel, outputs, machine))
    return out + [Choice(f, None, f"left whole: {brief(whole[f])}") if f in whole else _attention(model, f, n)
                  for f in attentions]


def _attention(model, fqn: str, n: int) -> Choice:
    """An ``nn.MultiheadAttention``: ``colwise()`` (its heads sharded, ``out_proj`` row-wise:
    a Megatron pair in one module, not weighed) where it mounts on ``n`` ranks, else whole."""
    module = model.get_submodule(fqn)
    mount = try_mount(colwise(), module, fqn, (), ())
    why = mount[0] if isinstance(mount, list) else (
        mount.row.fits(module, n) if mount.row is not None and mount.row.fits is not None else None)
    if why:
        return Choice(fqn, None, f"left whole: {brief(why)}")
    return Choice(fqn, colwise(), f"over {n} ranks: its {module.num_heads} heads column-wise, out_proj "
                                  "row-wise, one all-reduce (nn.MultiheadAttention's own forward on each rank's heads)")


def _options(fqns: list, kinds: dict, loss_parallel: bool, outputs: set) -> list:
    """The ways to shard modules that share one weight: ``[{fqn: option}, ...]``."""
    def linear(f):
        return [_LOSS_PARALLEL if loss_parallel and f in outputs and o.bias else o
                for o in _OPTIONS["linear"]]
    if len(fqns) == 1:
        f = fqns[0]
        return [{f: o} for o in (linear(f) if kinds[f] == "linear" else _OPTIONS["embedding"])]
    # embeddings and heads sharing one weight: vocabulary-parallel and column-wise, one Shard(0)
    return [{f: _OPTIONS["embedding"][0] if kinds[f] == "embedding" else linear(f)[0] for f in fqns}]


def _style(option, module):
    """The option's style on ``module`` (an embedding whose forward computes on DTensors takes
    its vocabulary-parallel output as it comes)."""
    if option is _OPTIONS["embedding"][0] and not meaning(rowwise().core, module, "", ()).local:
        return _OWN_FORWARD
    return option.style


def _refused(model, style, module, fqn: str, n: int) -> bool:
    """Whether ``parallelize`` would refuse ``style`` on ``module`` over ``n`` ranks: its row
    refuses it (an embedding whose own submodules compute), or it is a column-wise projection
    of an attention whose heads (by the attention's ``head_dim``) the ranks do not split."""
    mount = try_mount(style, module, fqn, (), ())
    if isinstance(mount, list):
        return True
    parent = fqn.rpartition(".")[0]
    return bool(split_heads({parent: model.get_submodule(parent)}, [mount], n))


def _choose(model, fqns: list, calls: dict, n: int, loss_parallel: bool, outputs: set, machine) -> list:
    """The cheapest option for modules that share one weight (each alone if they share none)."""
    modules = [model.get_submodule(f) for f in fqns]
    kinds = {f: calls[f][0].kind for f in fqns}
    whole = _held(modules, [None] * len(fqns), n)[0]
    best = None
    for pick in _options(fqns, kinds, loss_parallel, outputs):
        if any(_refused(model, _style(pick[f], module), module, f, n) for f, module in zip(fqns, modules)):
            continue
        steps = [s for f in fqns for s in _moves(calls[f], pick[f])]
        held = _held(modules, [pick[f] for f in fqns], n)[1]
        if best is None or cost(steps, held, n, machine) < cost(*best[:2], n, machine):
            best = (steps, held, pick)
    if best is None:
        return [Choice(f, None, "left whole: no way to shard it alone mounts") for f in fqns]
    steps, held, pick = best
    if cost([], whole, n, machine) <= cost(steps, held, n, machine):
        def why(f):
            others = ", ".join(repr(g) for g in fqns if g != f)
            tie = (f" with {others}, which share{'s' * (len(fqns) == 2)} its weight," if others else "")
            if machine is not None:
                return (f"left whole: its optimizer step takes {fmt_seconds(machine.optimizer(whole))}, "
                        f"sharding it{tie} {say(steps, held, n, machine)}")
            return (f"left whole: sharding it{tie} would move {fmt_bytes(moved(steps, n))} per step to save "
                    f"{fmt_bytes(whole - held)} per rank")
        return [Choice(f, None, why(f)) for f in fqns]
    figures = (f"{say(steps, held, n)} of {fmt_bytes(whole)}" if machine is None else
               f"{say(steps, held, n, machine)} against {fmt_seconds(machine.optimizer(whole))} whole")
    out = []
    for f, module in zip(fqns, modules):
        style = _style(pick[f], module)
        tie = f" (its weight tied to {', '.join(repr(g) for g in fqns if g != f)})" if len(fqns) > 1 else ""
        out.append(Choice(f, style, f"{pick[f].name}{tie}: {figures}"))
    return out


def sequence_parallel(groups: list, flow, n: int, machine=None, weight=lambda fqn: 1) -> str | None:
    """Whether to run what lies between the pairs (norms, residual sums, dropout) on a shard of
    the sequence: each row-wise exit's all-reduce then becomes a reduce-scatter, and the next
    pair gathers the sequence back. The same bytes in twice the collectives under the ring
    model, and on a ``machine`` the same ring steps, over the links of other kinds; the note
    says which costs less, with the figures. Suggest writes no sequence-parallel plan.
    ``weight``: how many modules of the whole model each of ``flow``'s stands for."""
    exits = {f for g in groups for f in g.exits}
    calls = [c for c in flow.calls if c.fqn in exits and c.role == "exit" and c.kind == "linear"
             and len(c.out_shape) >= 3 for _ in range(weight(c.fqn))]
    if not calls:
        return None
    plain = [(Partial(), Replicate(), c.out_shape, c.itemsize) for c in calls]
    split = [step for c in calls for step in ((Partial(), Shard(1), c.out_shape, c.itemsize),
                                              (Shard(1), Replicate(), c.out_shape, c.itemsize))]
    if machine is None:  # the same bytes, under the ring model
        return (f"sequence parallelism not used: it would move {fmt_bytes(moved(split, n))} per step in "
                f"{2 * len(calls)} collectives where the row-wise exits' {len(calls)} all-reduces move "
                f"{fmt_bytes(moved(plain, n))}")
    mine, theirs = seconds(split, n, machine), seconds(plain, n, machine)
    verdict = "would save" if mine < theirs else "would not save"
    return (f"sequence parallelism not used: on the given Machine its {2 * len(calls)} collectives "
            f"would take {fmt_seconds(mine)} per step where the row-wise exits' {len(calls)} all-reduces "
            f"take {fmt_seconds(theirs)} ({verdict} time; suggest writes no sequence-parallel plan)")
