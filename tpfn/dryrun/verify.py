"""``verify``: run a plan on N real ranks in one call and compare every number with one device.

The parent process runs the unsharded model; ``world_size`` forked child processes, one per rank
(``tpfn.dryrun.forked``), each parallelize its own copy of the model (the parent's weights, so
``src_rank=None``) and run the same forward and backward. Forward hooks on every module record what
it takes and hands on (a local shard in the layout its style declares, a DTensor in its own); the
parent puts the shards together and compares each module's output and each parameter's gradient
with one device's. The first module whose inputs agree and whose output does not is named.
``exact=True`` compares bits instead: both sides in invariant mode (``parallelize(...,
invariant=True)``), one rank against ``world_size``, no tolerance.
"""

from __future__ import annotations

import copy
import os
import traceback

import attrs
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from tpfn._fqn import describe, generalize, join, within
from tpfn.analysis.check import analysed
from tpfn.analysis.fake import new_fake_mesh, release
from tpfn.analysis.hybrid import real
from tpfn.analysis.inputs import floats, split_inputs, tensors
from tpfn.analysis.where import failing_module
from tpfn.dryrun.forked import on_ranks
from tpfn.dryrun.lints import local_colwise
from tpfn.dryrun.table import cell, checked_width, prose, render
from tpfn.interpret.layouts import assemble, layouts
from tpfn.interpret.parallelize import mounted, parallelize
from tpfn.layout import Partial, Replicate, Shard, from_torch, to_torch
from tpfn.plans.plan import Plan, resolve
from tpfn.style.style import Style
from tpfn.training.progress import Progress, enabled, log
from tpfn.tree import total

__all__ = ["verify", "Verification", "Check"]

TOLERANCE = 1e-4
"""float32 keeps 24 bits (eps 1.2e-7). A sharded matmul sums its products in another order
and an all-reduce adds partial sums, so each element moves by a few eps times the square
root of the reduction length: about 1e-6 of the tensor's norm for reductions of 10^4 terms,
through a few layers. A plan that splits heads, packs or places anything wrongly moves the
numbers by 1e-2 to 1. 1e-4 sits between the two; bfloat16 models need about 1e-2."""


@attrs.frozen
class Check:
    """One module: its style, and the largest relative error (``||a - b|| / ||b||``) of its
    output and of each of its own parameters' gradients against one device (None: not compared)."""

    fqn: str
    kind: str
    style: object = None
    output: float | None = None
    grads: tuple = ()
    ran: bool = True

    @property
    def grad(self) -> float | None:
        return max((e for _, e in self.grads if e is not None), default=None)

    def diverges(self, tolerance: float) -> bool:
        return any(e is not None and not e <= tolerance for e in (self.output, self.grad))


@attrs.frozen
class Verification:
    """What ``verify`` found; ``ok`` when every output and gradient is within ``tolerance``
    (``exact``: has one rank's bits in invariant mode; the tolerance is 0).

    ``checks`` are per module in execution order; ``culprit`` names the first module whose
    inputs agree with one device and whose output does not (or, if every output agrees, the
    last one whose gradients do not); ``failure`` says which rank raised, where and what;
    ``notes``, what the numbers do not show (an output each rank holds a shard of)."""

    world_size: int
    tolerance: float
    inputs: tuple
    checks: tuple = ()
    culprit: str | None = None
    hint: str | None = None
    failure: str | None = None
    notes: tuple = ()
    trace: str | None = attrs.field(default=None, repr=False)  # the failing rank's traceback
    exact: bool = False

    @property
    def ok(self) -> bool:
        return self.failure is None and not any(c.diverges(self.tolerance) for c in self.checks)

    def text(self, width: int | None = 80) -> str:
        """The report for a terminal ``width`` columns wide (None: no limit): the outcome, then a
        line per module (repeated blocks once, with their count and their worst errors; the
        module that diverges first on its own) with its style, the relative error of its output
        and the worst of its parameters' gradients. ``str(report)`` is ``report.text()``."""
        checked_width(width)
        shown = ", ".join(f"{name} {tuple(shape)} {dtype}" for name, shape, dtype in self.inputs)
        against = ("one rank in invariant mode, bit for bit" if self.exact else
                   f"one device: {shown or 'no inputs'}; tolerance {self.tolerance:g} (relative)")
        lines = prose(f"tpfn.verify on {self.world_size} ranks against {against}"
                      + (f": {shown or 'no inputs'}" if self.exact else ""), width)
        outcome = (f"FAILED: {self.failure}" if self.failure is not None else
                   f"ok: every output and parameter gradient {'has its bits' if self.exact else 'agrees'} "
                   f"{'on one rank' if self.exact else 'with one device'}" if self.ok else f"DIVERGES: {self.hint}")
        lines += prose(outcome, width)
        lines += [line for note in self.notes for line in prose(f"note: {note}", width)]
        if self.checks:
            rows = [[cell("module"), cell("style"), cell("output"), cell("gradients")]]
            for name, n, group in _groups(self.checks, self.culprit):
                c = group[0]
                outputs = [g.output for g in group if g.ran and g.output is not None]
                worst = max((g for c_ in group for g in c_.grads if g[1] is not None),
                            key=lambda g: g[1], default=None)
                grads = ["-"] if worst is None else [_fmt(worst[1]), worst[0]]
                mark = ["<- diverges here"] if c.fqn == self.culprit else []
                rows.append([("", [name, f"({c.kind})" + (f" x{n}" if n > 1 else "")]),
                             cell("-" if c.style is None else repr(c.style)),
                             cell(_fmt(max(outputs)) if outputs else "-" if any(g.ran for g in group)
                                  else "not run"),
                             ("", grads + mark)])
            lines += ["", *render(rows, width)]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()


def _groups(checks, culprit) -> list:
    """``(name, count, checks)`` of each line of the table: the checks of one repeated block
    (same generalized FQN, kind, style and whether it ran) together, the culprit alone."""
    groups: dict = {}
    for c in checks:
        alone = c.fqn if c.fqn == culprit else None
        key = (generalize(c.fqn), c.kind, repr(c.style), c.ran, alone)
        groups.setdefault(key, []).append(c)
    return [(generalize(g[0].fqn) if len(g) > 1 else (g[0].fqn or "<root>"), len(g), g)
            for g in groups.values()]


def _fmt(e: float | None) -> str:
    return "-" if e is None else "0" if e == 0 else f"{e:.1e}"


# -- what a module takes and hands on ------------------------------------------------------


def _slot(module: nn.Module, side: str, i: int):
    """Slot ``i`` of the ``"inputs"`` or ``"outputs"`` of the style bound to ``module``, or None."""
    mount = mounted(module)
    slots = () if mount is None else getattr(mount, side).slots
    return slots[i] if i < len(slots) else None


def _layout(x, slot):
    """(local value, layout or None) of one tensor: a DTensor's own layout, else the slot's."""
    if isinstance(x, DTensor):
        return x.to_local().detach().clone(), from_torch(x.placements)[0]
    layout = None if slot is None or slot.untouched else slot.out if slot.desired is not None \
        else slot.given
    return x.detach().clone(), layout


def _record(model: nn.Module, seen: dict, order: list) -> None:
    """Hooks on every module: ``seen[fqn]`` gets ``(inputs, outputs)`` per call."""
    for fqn, sub in model.named_modules():
        def pre(module, args, kwargs, fqn=fqn):
            if fqn not in seen:
                order.append(fqn)
            ins = [_layout(x, _slot(module, "inputs", i)) for i, x in enumerate(tensors((args, kwargs)))]
            seen.setdefault(fqn, []).append([ins, None])
        pre.observes_only = True  # (changes no module: see tpfn._torch.hooked)

        def post(module, args, kwargs, out, fqn=fqn):
            seen[fqn][-1][1] = [_layout(x, _slot(module, "outputs", i)) for i, x in enumerate(tensors(out))]

        post.observes_only = True
        sub.register_forward_pre_hook(pre, with_kwargs=True, prepend=True)
        sub.register_forward_hook(post, with_kwargs=True)


def _grads(model: nn.Module) -> dict:
    """``{name: (local gradient, layout) or None}`` of every parameter: a DTensor gradient laid
    out as its parameter is in the parameter's layout (which holds what DTensor cannot say, packed
    parts), else in its own (DTensor's embedding with a ``padding_idx`` hands back a replicated
    gradient of a row-sharded weight)."""
    out, placed = {}, layouts(model)
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            out[name] = None
        elif not isinstance(g, DTensor):
            out[name] = (g.clone(), Replicate())
        else:
            same = isinstance(p, DTensor) and tuple(g.placements) == tuple(p.placements)
            own = from_torch(g.placements)[0]
            out[name] = (g.to_local().clone(), placed.get(name, own) if same else own)
    return out


def _assemble(pieces: list, ref: torch.Tensor, exact: bool = False):
    """The global values the ranks' pieces stand for (one per rank when replicated), or None;
    ``exact``: partial sums added by the canonical tree (``tpfn.tree``), as invariant mode adds them."""
    if ref is None or any(p is None for p in pieces):
        return None
    local, layout = [p[0] for p in pieces], pieces[0][1]
    if layout is None:  # a plain tensor of no declared layout: whole, or one dim split
        if all(t.shape == ref.shape for t in local):
            return local
        dims = [d for d in range(ref.ndim) if local[0].ndim == ref.ndim and local[0].shape[d] != ref.shape[d]]
        whole = torch.cat(local, dims[0]) if len(dims) == 1 else None
        return [whole] if whole is not None and whole.shape == ref.shape else None
    if isinstance(layout, Replicate):
        return local
    if isinstance(layout, Partial):
        if exact and layout.op == "sum":
            return [total(local)]
        stack = torch.stack(local)
        return [{"sum": stack.sum, "avg": stack.mean, "max": stack.amax, "min": stack.amin}[layout.op](0)]
    return assemble(local, layout, tuple(ref.shape))


def _error(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """``||a - b|| / ||b||``, with ``||b||`` at least ``floor`` per element (see ``_checks``)."""
    if a.shape != b.shape:
        return float("inf")
    a, b = a.detach().double(), b.detach().double()
    diff, norm = (a - b).norm().item(), max(b.norm().item(), floor * b.numel() ** 0.5)
    err = diff / norm if norm > 0 else (0.0 if diff == 0 else float("inf"))
    return err if err == err else float("inf")  # NaN: diverged


def _worst(ranks: list, ref: torch.Tensor | None, floor: float = 0.0, exact: bool = False) -> float | None:
    found = _assemble(ranks, ref, exact)
    return None if found is None else max(_error(x, ref, floor) for x in found)


# -- one run (the parent's reference, and each rank's) -------------------------------------


@attrs.frozen
class _Job:
    """What every rank runs: the model, the plan, the inputs and the backward's cotangents."""

    model: nn.Module
    plan: object
    args: tuple
    kwargs: dict
    cotangents: tuple
    rng: torch.Tensor  # the CPU generator's state when the reference began
    exact: bool = False  # in invariant mode


def _rank_inputs(job: _Job, model: nn.Module, rank: int, n: int):
    """The inputs a rank passes: its shard where the root's style declares the input sharded."""
    def mine(x, i):
        given = getattr(_slot(model, "inputs", i), "given", None)
        x = x.detach().clone().requires_grad_(x.requires_grad)
        if isinstance(given, Shard):
            d, k = given.dim % x.ndim, given.parts
            return torch.cat([p.chunk(n, d)[rank] for p in x.chunk(k, d)], d).detach() \
                .requires_grad_(x.requires_grad)
        if isinstance(given, Partial) and rank:
            return torch.zeros_like(x).requires_grad_(x.requires_grad)
        return x

    args = tuple(mine(x, i) if isinstance(x, torch.Tensor) else x for i, x in enumerate(job.args))
    return args, dict(job.kwargs)


def _whole(t, model, mesh, ref):
    """A rank's output as one differentiable global tensor, for the backward."""
    if isinstance(t, DTensor):
        return t.full_tensor()
    slot = _slot(model, "outputs", 0)
    layout = None if slot is None or slot.untouched else slot.out
    if layout is None and t.shape != ref.shape:  # a shard of no declared layout: one dim split
        dims = [d for d in range(t.ndim) if t.ndim == ref.ndim and t.shape[d] != ref.shape[d]]
        layout = Shard(dims[0]) if len(dims) == 1 else None
    if layout is None or isinstance(layout, Replicate):
        return t
    return DTensor.from_local(t, mesh, to_torch(layout, t.ndim), run_check=False, shape=ref.shape,
                              stride=torch.empty(ref.shape).stride()).full_tensor()


def _cotangents(outputs: list, how: str, seed: int) -> tuple:
    """The backward's seed for each output: random values from ``seed``, or ones (a sum)."""
    gen = torch.Generator().manual_seed(seed + 1)
    return tuple(torch.randn(t.shape, generator=gen).to(t.dtype) if how == "random"
                 else torch.ones(t.shape, dtype=t.dtype) for t in outputs)


def _run(model: nn.Module, args, kwargs, cotangents, mesh=None, phase=None) -> dict:
    """Forward and backward of ``model`` with hooks on: what every module saw, the grads.
    ``cotangents``: the backward's seeds, or a function making them from the outputs;
    ``phase``: a list whose first item says how far the run got."""
    phase = [None] if phase is None else phase
    phase[0] = "forward"
    seen, order = {}, []
    _record(model, seen, order)
    outs = floats(model(*args, **kwargs))
    if callable(cotangents):
        cotangents = cotangents(outs)
    if len(outs) != len(cotangents):
        raise RuntimeError(f"the model hands on {len(outs)} floating-point outputs that need "
                           f"a gradient, {len(cotangents)} on one device")
    if outs:
        phase[0] = "backward"
        whole = outs if mesh is None else [_whole(t, model, mesh, c) for t, c in zip(outs, cotangents)]
        torch.autograd.backward(sum((w * c).sum() for w, c in zip(whole, cotangents)))
    shapes = [None if isinstance(t, DTensor) else tuple(t.shape) for t in outs]  # local ones
    return {"seen": seen, "order": order, "grads": _grads(model), "cotangents": cotangents,
            "shapes": shapes}


# -- verify ---------------------------------------------------------------------------------


def _on_ranks(job: _Job, n: int, timeout: float) -> dict:
    """One rank's run of ``job`` on each of ``n`` forked ranks (``tpfn.dryrun.forked``)."""
    phase, models = ["start"], {}

    def run(rank, mesh):
        torch.set_rng_state(job.rng)
        phase[0], model = "parallelize", copy.deepcopy(job.model)
        models[rank] = model
        parallelize(model, mesh, job.plan, src_rank=None, invariant=job.exact)  # the parent's weights everywhere
        args, kwargs = _rank_inputs(job, model, rank, n)
        return _run(model, args, kwargs, job.cotangents, mesh, phase)

    def fail(rank, exc):
        found = failing_module(exc, models[rank]) if rank in models else None  # innermost in the traceback
        where = "" if found is None else f" in {describe(models[rank].get_submodule(found), found)}"
        return (f"rank {rank}: the {phase[0]} failed{where}: {type(exc).__name__}: {exc}",
                traceback.format_exc())

    return on_ranks(run, fail, n, timeout=timeout)


def _sharded_outputs(ref: dict, ranks: list) -> tuple:
    """A note per output that each rank returns a local shard of (compared here as a whole,
    but what a caller's loss takes as it is)."""
    notes = []
    for i, whole in enumerate(ref["shapes"]):
        local = [r["shapes"][i] for r in ranks]
        if any(shape is not None and shape != whole for shape in local):
            notes.append(
                f"output {i} of the model is each rank's local shard (rank 0: {local[0]} of {whole}): "
                "a loss that takes it as it is (labels=...) sees a part of it; end the plan with "
                "prepare_out(Replicate()) on the module that makes it, or take the loss with "
                "tpfn.cross_entropy(..., mesh=mesh) on the shards.")
    return tuple(notes)


def _inputs(example_inputs, dtype, model: nn.Module, seed: int):
    """``(args, kwargs)`` of tensors: shapes become random values from ``seed`` (token ids
    below the smallest embedding's vocabulary for integer dtypes)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = min((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), default=2)

    def tensor(x):
        if isinstance(x, DTensor):
            raise TypeError("example inputs are the whole inputs one device takes: give tensors "
                            "or shapes, not a DTensor.")
        if isinstance(x, torch.Tensor):
            return x.detach().clone().requires_grad_(x.requires_grad)
        if isinstance(x, (tuple, list, torch.Size)) and all(
                isinstance(d, int) and not isinstance(d, bool) for d in x):
            if dtype.is_floating_point:
                return torch.randn(tuple(x), generator=gen).to(dtype)
            return torch.randint(0, vocab, tuple(x), generator=gen, dtype=dtype)
        return x

    return split_inputs(example_inputs, tensor,
                        lambda x: isinstance(x, (tuple, list)) and all(isinstance(d, int) for d in x))


def _analysis(model: nn.Module, plan, n: int, args: tuple, kwargs: dict) -> tuple:
    """``(trace, findings)`` of ``tpfn.check``'s analysis on these inputs (``(None, [])`` where
    the model cannot run with its parameters on meta)."""
    try:
        return analysed(model, plan, n, tuple(map(real, args)), {k: real(v) for k, v in kwargs.items()})
    except RuntimeError:
        return None, []


def _named(finding, model: nn.Module, mounts: dict, checks: list) -> str:
    """The hint where the analysis names the op that computes other numbers: the module, its
    style, its output's error here, and the finding."""
    fqn = finding.fqn
    style = f" ({mounts[fqn].style!r})" if fqn in mounts else ""
    err = next((c.output for c in checks if c.fqn == fqn and c.output is not None), None)
    measured = "" if err is None else f" (its output's relative error {err:.1e})"
    at = f" {finding.op}" + (f" ({finding.line})" if finding.line else "")
    return (f"{describe(model.get_submodule(fqn), fqn)}{style} computes other numbers than one "
            f"device{measured}; tpfn.check names the op:{at}: {finding.why}")


def _laid_out(ranks: list, trace) -> None:
    """Each module's inputs and outputs that no style lays out, in the layouts the analysis
    gives them (a partial sum handed on through modules outside the plan is summed)."""
    for r in ranks:
        for fqn, calls in r["seen"].items():
            for i, (ins, outs) in enumerate(calls):
                for side, known in ((ins, trace.arrivals.get(fqn, [])), (outs or [], trace.layouts.get(fqn, []))):
                    given = known[i] if i < len(known) else []
                    for j, (local, layout) in enumerate(side):
                        if layout is None and j < len(given) and given[j] is not None:
                            side[j] = (local, given[j])


def _check_plan(model: nn.Module, plan, n: int, exact: bool = False) -> None:
    """The ``PlanError`` that ``parallelize`` raises for this plan on ``n`` ranks, if any."""
    mesh = new_fake_mesh(n)
    try:
        parallelize(copy.deepcopy(model), mesh, plan, src_rank=None, invariant=exact)
    finally:
        release(mesh)


def _hint(fqn: str, module: nn.Module, mounts: dict, n: int, err: float, forward: bool) -> str:
    where = describe(module, fqn)
    style = mounts[fqn].style if fqn in mounts else None
    styled = f" ({style!r})" if style is not None else ""
    if not forward:
        return (f"{where}{styled} is the last module, in execution order, whose parameter "
                f"gradients diverge (relative error {err:.1e}) while every output agrees: the "
                "gradient flowing back into it is wrong; check the grads= the styles after it declare.")
    head = (f"{where}{styled} diverges first: its inputs agree with one device and its output "
            f"does not (relative error {err:.1e}).")
    local = [(name, local_colwise(mounts, join(fqn, name))) for name, _ in module.named_children()]
    local = [(name, core.parts) for name, core in local if core is not None]  # colwise(), local shards
    names = ", ".join(repr(name) for name, _ in local)
    if len(local) == 1 and local[0][1] == 1:
        return (f"{head} Hint: it splits the local output of its colwise() {names}, and each of the {n} "
                f"ranks holds one contiguous 1/{n} of its features; a projection that packs q, k and v "
                "(or gate and up) side by side needs colwise(parts=k), k equal parts (for q wider than "
                "k and v: n_heads // n_kv_heads + 2 parts of n_kv_heads heads, so that each rank holds "
                "its share of each), or a layout that groups each KV head with its queries.")
    attr = next((a for a in ("n_head", "n_heads", "num_heads", "num_attention_heads")
                 if isinstance(getattr(module, a, None), int)), None)
    if local and (attr or len(local) > 1):
        return (f"{head} Hint: it computes on the local outputs of its colwise() {names}: each of "
                f"the {n} ranks holds 1/{n} of their features, so a view with the global head "
                f"count (view(B, T, n_head, -1)) makes heads of 1/{n} of their features; hold the "
                f"local count ({attr or 'n_head'} // {n}) with per_rank({attr or 'n_head'!r}) in its "
                "style, view as (-1, head_dim), or hand it DTensors with colwise(local=False).")
    if local:
        return (f"{head} Hint: it computes on the local outputs of its colwise() {names}: check "
                "that what each rank holds is what its forward expects (a packed output, "
                "colwise(parts=k), goes to rowwise(parts=k)).")
    return (f"{head} Hint: check what its style declares (input, output and gradient layouts) "
            "against what its forward computes on each rank.")


def _exact_hint(fqn: str, module: nn.Module, mounts: dict, err: float, forward: bool) -> str:
    where = describe(module, fqn)
    styled = f" ({mounts[fqn].style!r})" if fqn in mounts else ""
    if forward:
        return (f"{where}{styled} differs first: its inputs have one rank's bits and its output does not "
                f"(relative error {err:.1e}): what it computes depends on the degree, a sum of the model's own "
                "over a dim the ranks split, or an op that takes another route on the narrower operands of "
                "more ranks; invariant mode orders tpfn's sums alone (docs/invariance.md).")
    return (f"{where}{styled} is the last module, in execution order, whose parameter gradients' bits differ "
            f"from one rank's (relative error {err:.1e}) while every output has them: the gradient flowing "
            "back into it is summed in another order by the model's own code after it (a sum over query heads "
            "of a replicated key head, an op that takes another route on narrower operands; docs/invariance.md).")


def _floor(ref: dict) -> float:
    """A gradient that is zero on one device up to rounding (a key's bias, under a softmax)
    is measured against 1e-3 of the model's root-mean-square gradient, not its own noise."""
    given = [g[0].double() for g in ref["grads"].values() if g is not None]
    numel = sum(g.numel() for g in given)
    return 1e-3 * (sum(g.square().sum().item() for g in given) / numel) ** 0.5 if numel else 0.0


def _partial_sums(ref: dict, ranks: list, tolerance: float) -> dict:
    """``{module: (parameter, ...)}``: the replicated parameters whose gradient differs from
    one device's on the ranks while the ranks' sum equals it: each rank's covers only its
    shard of the activations (a norm over local heads, an activation's parameters between
    column-wise and row-wise layers), and nothing sums them."""
    floor, found = _floor(ref), {}
    for name, g in ref["grads"].items():
        pieces = [r["grads"].get(name) for r in ranks]
        if g is None or any(p is None or p[1] != Replicate() for p in pieces):
            continue
        alone = max(_error(p[0], g[0], floor) for p in pieces)
        summed = _error(torch.stack([p[0] for p in pieces]).sum(0), g[0], floor)
        if not alone <= tolerance and summed <= tolerance:
            owner, _, leaf = name.rpartition(".")
            found[owner] = (*found.get(owner, ()), leaf)
    return found


def _lacking(partial: dict, model: nn.Module) -> str:
    """The hint for parameters whose gradients are partial sums: the rule the plan lacks."""
    fqn, names = list(partial.items())[-1]
    patterns = list(dict.fromkeys(generalize(f) for f in partial))
    rule = f"replicate() >> on_shards(param_grads={ {n: Partial() for n in names}!r})"
    return (f"{describe(model.get_submodule(fqn), fqn)}: the gradients of its replicated "
            f"{', '.join(map(repr, names))} differ from rank to rank and their sum is one "
            "device's: each rank's covers only its shard of the activations. The plan lacks "
            f"{rule} (transformers: 'replicated_with_grad_allreduce'), which sums them, on "
            f"{' and '.join(map(repr, patterns))}.")


def _checks(model: nn.Module, mounts: dict, ref: dict, ranks: list, exact: bool = False) -> list:
    """One ``Check`` per module, in execution order (modules that did not run last)."""
    order = ref["order"] + [f for f, _ in model.named_modules() if f not in ref["seen"]]
    owner: dict = {}
    for name in ref["grads"]:
        owner.setdefault(name.rpartition(".")[0], []).append(name)
    floor = _floor(ref)
    checks = []
    for fqn in order:
        errs = []
        for i, (_, outs) in enumerate(ref["seen"].get(fqn, [])):
            for j, o in enumerate(outs or ()):
                pieces = [(r["seen"].get(fqn) or [[None, None]] * (i + 1))[i][1] for r in ranks]
                pieces = [p[j] if p is not None and j < len(p) else None for p in pieces]
                errs.append(_worst(pieces, o[0], exact=exact) if all(pieces) else float("inf"))
        grads = []
        for name in owner.get(fqn, ()):
            g = ref["grads"][name]
            pieces = [r["grads"].get(name) for r in ranks]
            if g is None and all(p is None for p in pieces):
                continue
            grads.append((name.rpartition(".")[2], float("inf") if g is None or not all(pieces)
                           else _worst(pieces, g[0], floor, exact)))
        style = mounts[fqn].style if fqn in mounts else None
        checks.append(Check(fqn, type(model.get_submodule(fqn)).__name__, style,
                            max((e for e in errs if e is not None), default=None), tuple(grads),
                            fqn in ref["seen"]))
    return checks


def _inputs_agree(fqn: str, ref: dict, ranks: list, tolerance: float, exact: bool = False) -> bool:
    for i, (ins, _) in enumerate(ref["seen"][fqn]):
        for j, x in enumerate(ins):
            pieces = [r["seen"][fqn][i][0][j] for r in ranks]
            err = _worst(pieces, x[0], exact=exact)
            if err is not None and not err <= tolerance:
                return False
    return True


def _culprit(checks: list, ref: dict, ranks: list, tolerance: float, exact: bool = False):
    """The innermost module whose inputs agree and whose output does not; else the last whose
    gradients diverge. ``(fqn, error, forward)`` or None."""
    sources = [c for c in checks if c.ran and c.output is not None and not c.output <= tolerance
               and _inputs_agree(c.fqn, ref, ranks, tolerance, exact)]
    inner = [c for c in sources if not any(o.fqn != c.fqn and within(o.fqn, c.fqn) for o in sources if o is not c)]
    if inner:
        return inner[0].fqn, inner[0].output, True
    wrong = [c for c in checks if c.grad is not None and not c.grad <= tolerance]
    if wrong:
        return wrong[-1].fqn, wrong[-1].grad, False
    return None


def verify(model: nn.Module, plan: Plan | dict | Style, example_inputs: object, *, world_size: int = 2,
           tolerance: float = TOLERANCE, dtype: torch.dtype = torch.long, seed: int = 0,
           cotangent: str = "random", timeout: float = 120.0,
           progress: bool | None = None, exact: bool = False) -> Verification:
    """Run ``plan`` on ``model`` over ``world_size`` real ranks (forked processes, gloo) and
    compare every module's output and every parameter's gradient with one device.

    - ``model``: never changed; every rank gets a copy with its weights.
    - ``plan``: what ``parallelize`` takes; a plan it cannot apply raises the same ``PlanError``.
    - ``example_inputs``: a tensor or a shape, a tuple of them (positional) or a dict (keyword);
      shapes become random values from ``seed`` in ``dtype`` (integer dtypes: token ids below
      the smallest ``nn.Embedding``'s vocabulary). Each rank passes the whole inputs, or its
      shard where the root module's style declares an input sharded.
    - The backward runs from a random cotangent of each floating-point output that needs a
      gradient (``cotangent="sum"``: the sum of the outputs).
    - ``tolerance``: the largest relative error ``||a - b|| / ||b||`` allowed (see ``TOLERANCE``).
    - ``timeout``: seconds the ranks may take; a rank that raises or outlasts it is reported in
      ``failure`` (its rank, module and exception), never a hang.
    - ``progress``: a bar of its three steps (one device, the ranks, the comparison); default:
      shown unless ``TPFN_PROGRESS=0`` (``tpfn.training.progress``).
    - ``exact``: bits, not a tolerance: the plan in invariant mode (``parallelize(...,
      invariant=True)``) on ``world_size`` ranks against the same on one rank, every output and
      gradient equal bit for bit (docs/invariance.md), the first module whose bits differ named.

    >>> mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    >>> report = tpfn.verify(mlp, {"0": colwise(), "2": rowwise()}, (4, 8), dtype=torch.float32)
    >>> report.ok, report.checks[1].fqn, report.checks[1].output < 1e-6
    (True, '0', True)
    >>> tpfn.verify(mlp, {"0": colwise(), "2": rowwise()}, (4, 8), dtype=torch.float32, exact=True).ok
    True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"'model' must be an nn.Module (got {model!r} that is a {type(model)!r}).")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise TypeError(f"'world_size' must be a positive int (got {world_size!r}).")
    if cotangent not in ("random", "sum"):
        raise ValueError(f"'cotangent' must be 'random' or 'sum' (got {cotangent!r}).")
    if not hasattr(os, "fork"):
        raise RuntimeError("verify forks its ranks, and this platform has no fork; run the plan "
                           "under torchrun and compare with one device instead.")
    if exact:
        tolerance = 0.0
    _check_plan(model, plan, world_size, exact)
    with Progress("verify", 4 if exact else 3, unit="step", enabled=enabled(progress)) as bar:
        report = _verify(model, plan, example_inputs, world_size, tolerance, dtype, seed, cotangent,
                         timeout, bar, exact)
    outcome = ("failed" if report.failure else "ok" if report.ok else
               f"diverges at {report.culprit or '<root>'!r}")
    log.info("verify: %d modules on %d ranks against one device: %s, in %.2f s",
             len(report.checks), world_size, outcome, bar.seconds)
    return report


def _verify(model, plan, example_inputs, world_size, tolerance, dtype, seed, cotangent, timeout,
            bar: Progress, exact: bool = False) -> Verification:
    args, kwargs = _inputs(example_inputs, dtype, model, seed)
    mounts = {m.fqn: m for m in resolve(plan, model)}
    trace, findings = _analysis(model, plan, world_size, args, kwargs)
    reference, rng = copy.deepcopy(model), torch.get_rng_state()
    ref = _run(reference, *copy.deepcopy((args, kwargs)), lambda outs: _cotangents(outs, cotangent, seed))
    shown = tuple((f"input {k}" if isinstance(k, int) else repr(k), tuple(x.shape),
                   str(x.dtype).removeprefix("torch."))
                  for k, x in [*enumerate(args), *kwargs.items()] if isinstance(x, torch.Tensor))
    report = Verification(world_size, tolerance, shown, exact=exact)
    bar.update(1, "one device")
    job = _Job(model, plan, args, kwargs, ref["cotangents"], rng, exact)
    if exact:  # the reference: the plan on one rank in invariant mode (its local tensors are whole)
        one = _on_ranks(job, 1, timeout)[0]
        if one[0] == "error":
            return attrs.evolve(report, failure=one[1][0], trace=one[1][1] or None)
        ref = one[1]
        bar.update(1, "one rank")
    results = _on_ranks(job, world_size, timeout)
    bar.update(1, f"{world_size} ranks")
    errors = [v for s, v in results.values() if s == "error"]
    if errors:
        message, trace = errors[0]
        return attrs.evolve(report, failure=message, trace=trace or None)
    ranks = [results[r][1] for r in range(world_size)]
    report = attrs.evolve(report, notes=_sharded_outputs(ref, ranks))
    if trace is not None:
        _laid_out(ranks, trace)
    checks = _checks(model, mounts, ref, ranks, exact)
    found = _culprit(checks, ref, ranks, tolerance, exact)
    bar.update(1, f"{len(checks)} modules compared")
    wrong = [f for f in findings if f.kind == "wrong"]
    if found is None:
        told = tuple(f"tpfn.check finds, where these numbers agree: {f}" for f in wrong)
        return attrs.evolve(report, checks=tuple(checks), notes=report.notes + told)
    fqn, err, forward = found
    if exact:
        return attrs.evolve(report, checks=tuple(checks), culprit=fqn,
                            hint=_exact_hint(fqn, model.get_submodule(fqn), mounts, err, forward))
    partial = {} if forward else _partial_sums(ref, ranks, tolerance)
    if wrong and not partial:  # the analysis names the op: the first it finds wrong
        first = wrong[0]
        return attrs.evolve(report, checks=tuple(checks), culprit=first.fqn,
                            hint=_named(first, model, mounts, checks))
    hint = _lacking(partial, model) if partial else _hint(
        fqn, model.get_submodule(fqn), mounts, world_size, err, forward)
    return attrs.evolve(report, checks=tuple(checks), culprit=list(partial)[-1] if partial else fqn,
                        hint=hint)
