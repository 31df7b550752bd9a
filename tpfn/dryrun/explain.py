"""``explain``: a dry run of a plan on any world size, in one process, before any GPU is used.

The real interpreter runs on a copy of the module whose parameters are meta tensors (no
memory), over a fake process group of ``world_size`` ranks (collectives do nothing). The
run is seen from rank 0. With example inputs it runs one forward and the backward of the
sum of every floating-point output that needs a gradient, and ``tpfn.record`` measures
each collective. The user's module is never changed.

Each dry run makes its own fake mesh (``tpfn.analysis.fake``) and unregisters its group at
the end, so ``explain`` runs inside a job whose default group is initialized, and after the
user's own ``init_process_group``/``destroy_process_group``.

Sizes may be sympy symbols (batch, sequence, the mesh size). The dry run then runs three
times with stand-in sizes ``v``, ``v*r`` and ``v*r**2`` (``r`` a distinct prime per symbol,
2 for the mesh size), fits each collective's size as ``c * prod(symbol**k)`` from the first
two runs and checks the fit against the third; a size that is no such product is an error.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import warnings
from fractions import Fraction

import attrs
import sympy
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from tpfn._fqn import join
from tpfn._torch import parameters_of
from tpfn.algebra import local_shape, transition
from tpfn.analysis.fake import new_fake_mesh, release
from tpfn.analysis.findings import once
from tpfn.analysis.hybrid import Hybrid, hybrid_copy, meta_copy, real
from tpfn.analysis.inputs import ExampleInput, floats, is_shape, split_inputs, vocabulary
from tpfn.analysis.ranks import watch
from tpfn.analysis.typed import typed
from tpfn.dryrun import lints as lint
from tpfn.dryrun import units
from tpfn.dryrun.collectives import record
from tpfn.dryrun.cost import Machine, predict
from tpfn.dryrun.report import Megatron, Param, Report, Row, Transition
from tpfn.dryrun.slots import Slots, storage_of
from tpfn.dryrun.work import count
from tpfn.errors import PlanError
from tpfn.interpret.invariant import caveats, problems
from tpfn.interpret.layouts import layouts
from tpfn.interpret.parallelize import mounted, parallelize, runtime
from tpfn.layout import Shard, from_torch, normalize
from tpfn.plans.mount import local_sizes
from tpfn.plans.plan import Plan, resolve
from tpfn.style.style import Style
from tpfn.tree import CHUNKS, chunks_of

__all__ = ["explain"]


def _input(x, dtype):
    if isinstance(x, DTensor):
        raise TypeError("example inputs are local values as a rank passes them: give a tensor, "
                        f"a meta tensor or a shape, not a DTensor (got one of shape {tuple(x.shape)}).")
    if isinstance(x, torch.Tensor):
        return ExampleInput(tuple(x.shape), x.dtype, x.requires_grad, x)
    if is_shape(x):
        return ExampleInput(tuple(x), dtype)
    return x


def _local(shape: tuple, placement, shown, n: int) -> tuple:
    """``((local shape, first rank, last rank), ...)`` for runs of ranks holding one shape."""
    if not isinstance(placement, Shard):
        return ((shape, 0, shown - 1),)
    if isinstance(shown, sympy.Basic):  # nominal: the mesh size divides it
        nominal = list(shape)
        nominal[placement.dim] = sympy.sympify(shape[placement.dim]) / shown
        return ((tuple(nominal), 0, shown - 1),)
    if placement.heads is None and all(part % n == 0 for part in placement.sizes(shape[placement.dim])):
        return ((local_shape(shape, placement, (n,), (0,)), 0, n - 1),)  # even: one run, one call
    return tuple(units.runs([local_shape(shape, placement, (n,), (c,)) for c in range(n)]))


def _rows(module: nn.Module, shown, n: int) -> list:
    """A row per module with its own parameters (a tied one names its first owner)."""
    first: dict = {}
    rows, placed = [], layouts(module)
    for fqn, sub in module.named_modules():
        params = []
        for name, p in parameters_of(sub).items():
            if p is None:
                continue
            full = join(fqn, name)
            owner = first.setdefault(id(p), full)
            placement = placed.get(full) or (from_torch(p.placements)[0] if isinstance(p, DTensor) else None)
            shape = tuple(p.shape)
            params.append(Param(name, placement, shape, _local(shape, placement, shown, n),
                                p.dtype.itemsize, None if owner == full else owner))
        m = mounted(sub)
        sizes = () if m is None else (*local_sizes(m, sub, n)[0], *(
            (f"input {k!r}", f"{h} heads", f"{h // n} heads") for k, h in m.per_head))
        rows.append(Row(fqn, type(sub).__name__, getattr(m, "style", None), tuple(params), (), sizes))
    return rows


def _slots(mount) -> list:
    """(label, slot) of every input and output slot a mount prepares."""
    spec_in, spec_out = mount.inputs, mount.outputs
    return [*((f"input {i}", s) for i, s in enumerate(spec_in.slots)),
            *((f"input {k!r}", s) for k, s in spec_in.kwargs),
            *((f"output {i}", s) for i, s in enumerate(spec_out.slots)),
            *((f"output {k!r}", s) for k, s in spec_out.keys)]


def _transitions(mount, seen, ran: bool) -> tuple:
    """The transition of each slot, from the layouts seen in the run (else as declared)."""
    out = []
    for label, slot in _slots(mount):
        if slot.untouched or (ran and label not in seen):
            continue  # left alone, or not passed in the run
        layout, ndim = seen.get(label, (None, None))
        given = layout[0] if layout is not None else slot.source
        desired = slot.desired if slot.desired is not None else given
        if ndim is not None:
            given, desired = normalize(given, ndim)[0], normalize(desired, ndim)[0]
        out.append(Transition(label, given, desired, transition(given, desired)))
    return tuple(out)


def _watch(module: nn.Module, seen: dict, block) -> None:
    """Note the width and element size of ``block``'s input in ``seen[None]``."""
    def block_input(m, args, kwargs):
        if None not in seen:
            x = next(x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor))
            seen[None] = (x.shape[-1], x.dtype.itemsize)

    block_input.observes_only = True  # (see tpfn._torch.hooked)
    if block is not None:
        module.get_submodule(block).register_forward_pre_hook(block_input, prepend=True, with_kwargs=True)


def _blocks(module: nn.Module) -> tuple:
    """The FQNs of the longest ``nn.ModuleList`` of two or more modules of one type."""
    lists = [(len(m), fqn) for fqn, m in module.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(c) for c in m}) == 1]
    n, fqn = max(lists, key=lambda x: x[0], default=(0, ""))
    return tuple(join(fqn, str(i)) for i in range(n))


def _tokens(x: ExampleInput):
    """b*s of the first input: its elements (token ids), or per last dim for embeddings."""
    dims = x.shape[:-1] if x.dtype.is_floating_point else x.shape
    return sympy.Mul(*map(sympy.sympify, dims))


def _kept(model: nn.Module, saved: list) -> int:
    """Bytes of the distinct storages of ``saved`` (what autograd saved for the backward),
    the model's own parameters and buffers left out: the activations a rank keeps."""
    own = {id(storage_of(t)) for t in itertools.chain(model.parameters(), model.buffers())}
    distinct = {id(s): s for s in map(storage_of, saved) if id(s) not in own}
    return sum(s.nbytes() for s in distinct.values())


def _run(model: nn.Module, mounts: dict, lints: list, n: int, inputs: tuple, values: dict, block, ranks):
    """One forward and backward of ``model`` on ``inputs`` (``(args, kwargs)``, real, run under
    ``Hybrid``): the collectives, what ``_watch`` saw, the ``Slots`` that watched each slot, the
    bytes saved for the backward, and each phase's work; ``ranks``, where the analysis runs, the
    mode that follows the forward against one device's (``tpfn.analysis.ranks.watch``)."""
    seen: dict = {}
    _watch(model, seen, block)
    nodes: list = []
    slots = Slots(model, {fqn: [label for label, slot in _slots(m) if not slot.untouched]
                          for fqn, m in mounts.items()}, nodes, seen)
    args, kwargs = inputs
    phase, saved, hybrid = "forward", [], Hybrid()

    def pack(x):
        saved.append(x)
        return x

    try:
        with record(model, nodes=nodes) as comms, hybrid, count() as work:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x), ranks or contextlib.nullcontext():
                out = model(*args, **kwargs)
                if ranks is not None:
                    ranks.rest()
                    ranks.done = True
            phase = work.phase = "backward"
            hybrid.values = False
            grads = [t.sum() for t in floats(out)]
            if grads:
                torch.autograd.backward(grads)
    except PlanError as exc:  # a module the plan refuses when it runs: its problems as they are
        raise PlanError([*exc.problems, *lints, *_lints(ranks.findings if ranks else ())]) from exc
    except Exception as exc:
        raise PlanError([lint.failure(exc, model, mounts, n, phase, values), *lints,
                         *_lints(ranks.findings if ranks else ())]) from exc
    return comms, seen, slots, _kept(model, saved), tuple((p, work.of(p)) for p in ("forward", "backward"))


def _lints(findings) -> list:
    """The analysis' findings as warnings: one per kind, repeated blocks once with their count."""
    return [f"{f}" + (f" (and {k - 1} more like it)" if k > 1 else "") for f, k in once(findings)]


def _made(module: nn.Module, args, kwargs, values: dict) -> tuple:
    """``(args, kwargs)`` real (``ExampleInput.real``): the same tensors for every run of one dry run."""
    vocab, gen = vocabulary(module), torch.Generator().manual_seed(0)
    make = lambda x: x.real(values, vocab, gen) if isinstance(x, ExampleInput) else real(x)  # noqa: E731
    return tuple(make(x) for x in args), {k: make(x) for k, x in kwargs.items()}


def _dry_run(module, plan, n: int, shown, args, kwargs, values: dict, options: dict, analysed: bool) -> Report:
    """One dry run on ``n`` fake ranks; sizes and the mesh size shown as ``shown`` and ``values``;
    ``analysed``: with the analysis (``tpfn.check``'s) beside it."""
    ran = args is not None
    model, mesh = (hybrid_copy(module, who="explain") if ran else meta_copy(module)), new_fake_mesh(n)
    inputs = _made(module, args, kwargs, values) if ran else None
    try:
        return _report(model, mesh, plan, n, shown, args, kwargs, values, options,
                       module if ran and analysed else None, inputs)
    finally:
        release(mesh)


def _traced(module: nn.Module, plan, n: int, inputs: tuple):
    """One device's typed forward (``tpfn.analysis.typed``) on the inputs the ranks' pieces make
    (explain's are a rank's: where the root's style declares one sharded, its ``n`` pieces are
    rank 0's, repeated), or None where it cannot run (the dry run then says why)."""
    one = hybrid_copy(module, who="explain")
    mounts = {m.fqn: m for m in resolve(plan, one)}
    slots = mounts[""].inputs.slots if "" in mounts else ()
    args = tuple(torch.cat([x] * n, slots[i].given.dim) if i < len(slots) and isinstance(slots[i].given, Shard)
                 and isinstance(x, torch.Tensor) else x for i, x in enumerate(inputs[0]))
    try:
        return typed(one, mounts, args, inputs[1], n)
    except RuntimeError:
        return None


def _report(model, mesh, plan, n: int, shown, args, kwargs, values: dict, options: dict, module=None,
            inputs=None) -> Report:
    symbol = shown if isinstance(shown, sympy.Basic) else None
    with warnings.catch_warnings():  # an empty plan: the whole model, on purpose (a baseline)
        warnings.filterwarnings("ignore", "the plan binds no module", UserWarning)
        try:
            parallelize(model, mesh, plan, src_rank=None, **options)
        except PlanError as e:  # its refusals, naming the stand-in world size
            if symbol is None:
                raise
            raise PlanError([p.replace(f"the {n} ranks", lint.named_ranks(n, symbol)) for p in e.problems]) from e
    mounts = {fqn: mounted(m) for fqn, m in model.named_modules() if mounted(m) is not None}
    rows = _rows(model, shown, n)
    trace = None if module is None or n == 1 else _traced(module, plan, n, inputs)
    # the warnings: the analysis' findings where it ran, else what the names of attributes say
    wrong = [*_lints(trace.findings), *lint.ratios(model, n, mounts, symbol)] if trace is not None else [
        *lint.head_counts(model, n, mounts, symbol), *lint.fused(model, n, mounts)]
    notes = [*lint.replicated_heads(model, n, mounts, symbol), *lint.uneven(rows, n), *lint.siblings(model, rows)]
    ran, blocks = args is not None, _blocks(model)
    ranks = None if trace is None else watch(model, trace, n)
    block = blocks[0] if blocks else None
    comms, seen, slots, kept, work = _run(model, mounts, [*wrong, *notes], n, inputs, values, block,
                                          ranks) if ran else ([], {}, None, None, ())
    if ranks is not None:
        wrong += [w for w in _lints(ranks.findings) if w not in wrong]
    lints = [*wrong, *notes]
    rows = [attrs.evolve(r, transitions=_transitions(mounts[r.fqn], seen.get(r.fqn, {}), ran))
            if r.fqn in mounts else r for r in rows]
    flows = () if slots is None else slots.flows(
        tuple(comms), mesh, {r.fqn: {t.slot: t for t in r.transitions} for r in rows})
    partial = tuple(fqn for m in model.modules() if runtime(m) is not None for fqn in runtime(m).partial.fqns)
    described = [(f"input {i}", x) for i, x in enumerate(args or ())] + list((kwargs or {}).items())
    examples = [(name, x) for name, x in described if isinstance(x, ExampleInput)]
    inputs = tuple((name, x.shape, str(x.dtype).removeprefix("torch.")) for name, x in examples)
    megatron = Megatron(blocks, _tokens(examples[0][1]), *seen[None]) if None in seen and examples else None
    chunks = chunks_of(options.get("invariant", False))
    bound = tuple(mounts.values())  # what invariant mode would refuse, or leave to the model
    invariance = (*problems(dict(model.named_modules()), bound, n, chunks or CHUNKS), *caveats(bound, n))
    return Report(shown, inputs, tuple(rows), tuple(comms), tuple(lints), megatron, flows, partial, kept, work,
                  warnings=tuple(wrong), invariance=invariance, chunks=chunks)


def _monomial(sizes: list, runs: list, symbols: list, what: str):
    """``c * prod(x**k)`` through the sizes of the first two runs, checked against the third."""
    (a, b, c), (va, vb, vc) = sizes, runs
    if a == 0 or b == 0:
        expr = sympy.Integer(0) if a == b == 0 else None
    else:
        ratio, powers = Fraction(b, a), {}
        for x in symbols:
            r, k = vb[x] // va[x], 0
            while ratio.numerator % r == 0:
                ratio, k = ratio / r, k + 1
            while ratio.denominator % r == 0:
                ratio, k = ratio * r, k - 1
            powers[x] = k
        coefficient = Fraction(a) / math.prod(Fraction(va[x]) ** k for x, k in powers.items())
        expr = None if ratio != 1 else sympy.Rational(coefficient.numerator, coefficient.denominator) \
            * sympy.Mul(*(x ** k for x, k in powers.items()))
    if expr is None or expr.subs(vc) != c:
        raise ValueError(
            f"the {what} moves {a}, {b} and {c} elements at {_at(symbols, runs)}: not a product of "
            f"powers of {', '.join(map(str, symbols))}, so no formula in them is exact; give these "
            "sizes as numbers, or other stand-ins with sizes=.")
    return expr


def _at(symbols: list, runs: list) -> str:
    """``'(b, s) = (2, 2), (6, 10), (18, 50)'``: the stand-in sizes of the runs."""
    names = ", ".join(map(str, symbols))
    return f"({names}) = " + ", ".join("(" + ", ".join(str(v[x]) for x in symbols) + ")" for v in runs)


def _symbolic(module, plan, world_size, args, kwargs, symbols: list, sizes: dict,
              options: dict) -> Report:
    """Three dry runs at stand-in sizes; collective sizes fitted as formulas in the symbols."""
    mesh_symbol = world_size if isinstance(world_size, sympy.Basic) else None
    t0 = sizes.get(mesh_symbol, 2)
    default = 4 * t0 if mesh_symbol is not None else world_size
    primes = iter(sympy.primerange(3, 10**6))
    factor = {x: 2 if x == mesh_symbol else next(primes) for x in symbols}
    base = {x: sizes.get(x, t0 if x == mesh_symbol else default) for x in symbols}
    runs = [{x: v * factor[x] ** j for x, v in base.items()} for j in range(3)]
    reports = [_dry_run(module, plan, int(sympy.sympify(world_size).subs(v)), world_size,
                        args, kwargs, v, options, analysed=j == 0) for j, v in enumerate(runs)]
    shapes = [[(c.fqn, c.phase, c.kind, c.itemsize) for c in r.comms] for r in reports]
    if not shapes[0] == shapes[1] == shapes[2]:
        raise ValueError(f"the collectives differ between the stand-in sizes {_at(symbols, runs)}: "
                         f"{', '.join(map(str, (r.collectives for r in reports)))}; give these sizes "
                         "as numbers.")
    comms = tuple(
        attrs.evolve(c, numel=_monomial([r.comms[i].numel for r in reports], runs, symbols,
                                        f"{c.phase} {c.kind} of {c.fqn!r}"), group_size=world_size)
        for i, c in enumerate(reports[0].comms))
    flows = tuple(attrs.evolve(f, shape=_shape([r.flows[i].shape for r in reports], runs, symbols))
                  for i, f in enumerate(reports[0].flows))
    kept = None if reports[0].kept is None else _shape([(r.kept,) for r in reports], runs, symbols)
    return attrs.evolve(reports[0], comms=comms, flows=flows, kept=None if kept is None else kept[0],
                        work=())  # (a phase's work is a sum of terms, no monomial: counted at numbers only)


def _shape(shapes: list, runs: list, symbols: list):
    """A slot's tensor shape as formulas in the symbols (None where a size is no product of
    their powers: the page then draws no picture of it)."""
    if len({len(s) for s in shapes}) != 1:
        return None
    try:
        return tuple(_monomial(list(sizes), runs, symbols, "slot") for sizes in zip(*shapes))
    except ValueError:
        return None


def explain(module: nn.Module, plan: Plan | dict | Style, *, world_size: int | sympy.Symbol,
            example_inputs: object = None, dtype: torch.dtype = torch.long,
            sizes: dict | None = None, overlap: bool = True, kernels: bool = True,
            machine: Machine | None = None, invariant: bool | int = False) -> Report:
    """Dry-run ``plan`` on ``module`` over ``world_size`` fake ranks and report what happens.

    - ``module``: any module (on any device, or meta); it is copied to meta, never changed.
    - ``plan``: what ``parallelize`` takes; a ``PlanError`` lists what makes it unusable, and
      a forward or backward that fails in the dry run is a ``PlanError`` naming the module
      where it failed, with a hint where the cause is a usual one, and the lints.
    - ``world_size``: the number of ranks, or a sympy symbol for formulas in the mesh size.
    - ``example_inputs``: a tensor, a meta tensor or a shape (a tuple of ints or sympy
      expressions), a tuple of them (positional inputs) or a dict (keyword inputs); without
      them nothing runs and the report holds placements and declared layouts only.
    - ``dtype``: the dtype of inputs given as shapes (token ids by default).
    - ``sizes``: stand-in values for symbols (see the module docstring).
    - ``overlap``, ``kernels``: as ``parallelize`` takes them (the dry run takes the route a real
      run takes); the report counts the backward collectives that overlap weight gradients
      (``Comm.overlaps``).
    - ``machine``: a ``tpfn.dryrun.cost.Machine`` (measured by ``calibrate``, or given): the
      report then predicts a step's time on it, phase by phase (``report.step``; needs example
      inputs at numbers, not symbols).
    - ``invariant``: as ``parallelize`` takes it: the dry run of invariant mode (its collectives
      and bytes; docs/invariance.md). Either way ``report.invariance`` says what keeps the plan
      from the same bits at every degree (empty: nothing).

    >>> mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    >>> report = tpfn.explain(mlp, {"0": colwise(), "2": rowwise()}, world_size=4,
    ...                       example_inputs=(8, 16), dtype=torch.float32)
    >>> report.collectives, report.bytes      # the row-wise all-reduce of 8 x 16 floats
    ({'all_reduce': 1}, 768)
    >>> import sympy
    >>> b, t = sympy.symbols("b t", positive=True, integer=True)
    >>> tpfn.explain(mlp, {"0": colwise(), "2": rowwise()}, world_size=t,
    ...              example_inputs=(b, 16), dtype=torch.float32).bytes
    128*b*(t - 1)/t
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"'module' must be an nn.Module (got {module!r} that is a {type(module)!r}).")
    if not isinstance(world_size, sympy.Symbol) and (
            isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
        raise TypeError(f"'world_size' must be a positive int or a sympy Symbol (got {world_size!r} "
                        f"that is a {type(world_size)!r}).")
    options = {"overlap": overlap, "kernels": kernels, "invariant": invariant}
    args, kwargs = (None, None) if example_inputs is None else split_inputs(
        example_inputs, lambda x: _input(x, dtype))
    shapes = [x.shape for x in (*(args or ()), *(kwargs or {}).values()) if isinstance(x, ExampleInput)]
    symbols = sorted({s for shape in shapes for d in shape for s in sympy.sympify(d).free_symbols}
                     | ({world_size} if isinstance(world_size, sympy.Symbol) else set()), key=str)
    sizes = dict(sizes or {})
    for x, v in sizes.items():
        if x not in symbols:
            raise ValueError(f"sizes names {x!r}, which no example input shape nor the world size "
                             f"uses (symbols: {', '.join(map(str, symbols)) or 'none'}).")
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise TypeError(f"sizes[{x!r}] must be a positive int (got {v!r}).")
    if machine is not None and (symbols or example_inputs is None):
        raise ValueError("explain(..., machine=...) predicts the step time of a run: give example_inputs "
                         f"at numbers{' (not symbols: ' + ', '.join(map(str, symbols)) + ')' if symbols else ''}.")
    if not symbols:
        report = _dry_run(module, plan, world_size, world_size, args, kwargs, {}, options, analysed=True)
        return report if machine is None else attrs.evolve(report, step=predict(report, machine))
    return _symbolic(module, plan, world_size, args, kwargs, symbols, sizes, options)
