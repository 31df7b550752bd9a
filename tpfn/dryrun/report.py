"""The report of a dry run: what every module holds, how its tensors move, what it communicates.

A ``Report`` is a value built by ``tpfn.explain``. ``str(report)`` is a table for an
80-column terminal (``report.text(width, wide=True)``: any width, every parameter and
slot), ``report.to_dict()`` is JSON-ready, ``report.to_html()`` is a page to look at.
Bytes follow the ring model of ``tpfn.algebra.comm_bytes`` applied to the tensor each
collective really moved; they are sympy expressions where sizes were given as symbols.

>>> c = Comm("layers.0.w2", "forward", "all_reduce", numel=4096, group_size=4, itemsize=2)
>>> c.bytes
12288
"""

from __future__ import annotations

from collections import Counter

import attrs
import sympy

from tpfn._fqn import generalize, within as inside  # (``within``: a parameter below)
from tpfn.algebra import AllGather, AllReduce, AllToAll, ReduceScatter, comm_bytes
from tpfn.dryrun.html import html
from tpfn.dryrun.table import EMPTY, cell, checked_width, flow, prose, render
from tpfn.dryrun.units import fmt_bytes, fmt_ranks, fmt_ratio, fmt_shape, summary
from tpfn.layout import Placement, Replicate, Shard
from tpfn.style.style import Style

__all__ = ["Comm", "Param", "Transition", "Flow", "Row", "Megatron", "Report", "fmt_bytes", "summary"]

# The one-step program whose ring cost is each kind's: sizes are of the whole tensor.
_STEPS = {"all_gather": AllGather(dim=0), "all_reduce": AllReduce(), "reduce_scatter": ReduceScatter(dim=0),
          "all_to_all": AllToAll(src_dim=0, dst_dim=0)}
KINDS = tuple(_STEPS)


def _number(x):
    """An int where the value is one, a float for another number, else the expression as text."""
    x = sympy.sympify(x)
    if x.free_symbols:
        return str(x)
    return int(x) if x.is_integer else float(x)


def _total(values):
    total = sum(values, sympy.Integer(0))
    return sympy.factor(total) if total.free_symbols else total


def _exact(n) -> str:
    """``'12,288 B (12.0 KiB)'``; a symbolic size as its formula."""
    n = sympy.sympify(n)
    if n.free_symbols:
        return str(n)
    return f"{int(n):,} B ({fmt_bytes(n)})" if n.is_integer and n >= 1024 else fmt_bytes(n)


@attrs.frozen
class Comm:
    """One collective as one rank issued it.

    ``fqn``: the innermost module running it (None: outside every module); ``phase``:
    ``"forward"`` or ``"backward"``; ``numel``: elements of the whole tensor it assembles or
    reduces (an all-gather's output, an all-reduce's or reduce-scatter's input, all ranks'
    inputs of an all-to-all); ``group_size``: ranks taking part; ``overlaps``: with
    ``parallelize(..., overlap=True)``, for a backward collective that a linear kernel starts
    before its weight gradients and waits for after, 1 (the linear's weight gradients run
    meanwhile); else 0.

    >>> Comm("w1", "backward", "all_gather", numel=1024, group_size=8, itemsize=4).bytes
    3584
    """

    fqn: str | None
    phase: str
    kind: str
    numel: int | sympy.Expr
    group_size: int | sympy.Expr
    itemsize: int
    overlaps: int = 0

    @property
    def bytes(self):
        """Bytes this rank sends, under the ring model."""
        return comm_bytes((_STEPS[self.kind],), (self.numel,), (self.group_size,), self.itemsize)


@attrs.frozen
class Param:
    """A parameter: its placement (None: a plain tensor every rank holds whole), its global
    shape, and ``local``: ``(shape, first rank, last rank)`` for each run of equal local shapes.

    >>> p = Param("weight", Shard(0), (10, 4), (((3, 4), 0, 2), ((1, 4), 3, 3)), itemsize=4)
    >>> p.text, p.bytes
    ('(10, 4) -> (3, 4) on ranks 0-2, (1, 4) on rank 3', 48)
    """

    name: str
    placement: Shard | Replicate | None
    shape: tuple
    local: tuple
    itemsize: int
    tied: str | None = None

    @property
    def bytes(self):
        """Bytes of the largest local shard (rank 0's)."""
        return sympy.Mul(*map(sympy.sympify, self.local[0][0])) * self.itemsize

    @property
    def text(self) -> str:
        """Global -> local shapes, and the owner of a tied parameter."""
        local = fmt_shape(self.local[0][0]) if len(self.local) == 1 else ", ".join(
            f"{fmt_shape(s)} on {fmt_ranks(a, b)}" for s, a, b in self.local)
        return f"{fmt_shape(self.shape)} -> {local}" + (f" (tied to {self.tied})" if self.tied else "")


@attrs.frozen
class Transition:
    """One input or output slot: the layout it arrives in, the one desired, and the steps between.

    >>> from tpfn.algebra import transition
    >>> Transition("output 0", Partial(), Replicate(), transition(Partial(), Replicate()))
    Transition(slot='output 0', given=Partial(), desired=Replicate(), steps=(AllReduce(),))
    """

    slot: str
    given: Placement
    desired: Placement
    steps: tuple


@attrs.frozen
class Flow:
    """What one slot of one module did in the dry run: the tensor it handed on (its global
    ``shape``, ``itemsize``, and ``storage``: one number for the slots that handed on one
    tensor's memory) and the collectives it ran, as positions in ``Report.comms``.

    >>> Flow("2", "output 0", (8, 16), 4, storage=3, forward=(0,))
    Flow(fqn='2', slot='output 0', shape=(8, 16), itemsize=4, storage=3, forward=(0,), backward=())
    """

    fqn: str
    slot: str
    shape: tuple | None
    itemsize: int
    storage: int
    forward: tuple = ()
    backward: tuple = ()


@attrs.frozen
class Row:
    """One module: its FQN, type, style (None: not in the plan), own parameters, slots, and
    what it holds per rank in its forward (``per_rank``): ``(attribute or input, global, local)``.

    >>> Row("layers.0.norm", "LayerNorm", None)
    Row(fqn='layers.0.norm', type='LayerNorm', style=None, params=(), transitions=(), sizes=())
    """

    fqn: str
    type: str
    style: Style | None
    params: tuple = ()
    transitions: tuple = ()
    sizes: tuple = ()


@attrs.frozen
class Megatron:
    """Megatron's per-block minimum, ``8(t-1)/t * b*s * h * e`` bytes per rank for one forward
    and backward, for the repeated ``blocks``: ``tokens`` is b*s, ``hidden`` h, ``itemsize`` e.

    >>> Megatron(("layers.0", "layers.1"), tokens=4096, hidden=8192, itemsize=2).minimum(8)
    939524096
    """

    blocks: tuple
    tokens: int | sympy.Expr
    hidden: int
    itemsize: int

    def minimum(self, world_size):
        """The bytes for all blocks on ``world_size`` ranks."""
        t = sympy.sympify(world_size)
        total = len(self.blocks) * 8 * (t - 1) / t * self.tokens * self.hidden * self.itemsize
        return sympy.factor(total) if total.free_symbols else total


@attrs.frozen
class Report:
    """What ``tpfn.explain`` found: a row per module, the collectives in the order they ran
    (the forward's, then the backward's), and the lints (``warnings``: those that say the numbers
    would be wrong, first; ``notes``: the others, a cost); ``flows``: what each slot handed on
    and which collectives it ran; ``partial_grads``: the parameters whose partial gradients
    are summed at the end of the backward (in the collectives of no module); ``kept``: the
    bytes of the tensors autograd saved for the backward on rank 0 (its activations; the
    model's parameters and buffers left out; None where nothing ran); ``work``: each phase's
    local work on rank 0 (``(phase, tpfn.dryrun.work.Work)`` pairs; none where nothing ran);
    ``step``: the step time predicted on a machine (``explain(..., machine=...)``), or None;
    ``invariance``: what keeps the plan from the same bits at every degree in invariant mode
    (what ``parallelize(..., invariant=True)`` refuses, or leaves to the model; empty: nothing);
    ``chunks``: the chunks of invariant mode where the dry run ran in it (None: the default mode).

    >>> mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    >>> report = tpfn.explain(mlp, {"0": colwise(), "2": rowwise()}, world_size=4,
    ...                       example_inputs=torch.ones(8, 16, requires_grad=True))
    >>> report.collectives, report.count("backward"), report.bytes, report.moved("2")
    ({'all_reduce': 2}, {'all_reduce': 1}, 1536, 768)
    >>> report.traffic()[("0", "backward")], report.moved("0", "forward"), report.param_bytes
    ({'all_reduce': (1, 768)}, 0, 2176)
    >>> report.to_dict()["modules"][1]["params"][0]["local"]
    [{'shape': [16, 16], 'ranks': [0, 3]}]
    """

    world_size: int | sympy.Symbol
    inputs: tuple
    rows: tuple
    comms: tuple
    lints: tuple = ()
    megatron: Megatron | None = None
    flows: tuple = ()
    partial_grads: tuple = ()
    kept: int | sympy.Expr | None = None
    work: tuple = ()
    step: object = None  # a tpfn.dryrun.cost.StepTime
    warnings: tuple = ()
    invariance: tuple = ()
    chunks: int | None = None

    @property
    def notes(self) -> tuple:
        """The lints that are not warnings: what works, at a cost in memory or bytes."""
        return tuple(lint for lint in self.lints if lint not in self.warnings)

    @property
    def collectives(self) -> dict:
        """Collectives of one forward and backward by kind: ``{"all_reduce": 11, ...}``."""
        return dict(Counter(c.kind for c in self.comms))

    def count(self, phase: str) -> dict:
        """Collectives of one phase (``"forward"`` or ``"backward"``) by kind."""
        return dict(Counter(c.kind for c in self.comms if c.phase == phase))

    @property
    def bytes(self):
        """Bytes each rank sends in one forward and backward."""
        return _total(c.bytes for c in self.comms)

    def phase_bytes(self, phase: str):
        """Bytes each rank sends in one phase (``"forward"`` or ``"backward"``)."""
        return _total(c.bytes for c in self.comms if c.phase == phase)

    def moved(self, fqn, phase=None, *, within: bool = False):
        """Bytes sent by module ``fqn`` (``within``: and its submodules; None: outside every
        module) in ``phase`` (None: both)."""
        def mine(c):
            here = c.fqn == fqn or (within and None not in (fqn, c.fqn) and inside(c.fqn, fqn))
            return here and phase in (None, c.phase)
        return _total(c.bytes for c in self.comms if mine(c))

    @property
    def param_bytes(self):
        """Bytes of parameters on each rank (rank 0 holds the largest shards)."""
        return _total(p.bytes for r in self.rows for p in r.params if p.tied is None)

    @property
    def blocks_bytes(self):
        """Bytes the Megatron blocks send (None without blocks)."""
        m = self.megatron
        return None if m is None else _total(self.moved(b, within=True) for b in m.blocks)

    @property
    def megatron_bytes(self):
        """Megatron's minimum for the blocks (None without blocks)."""
        return None if self.megatron is None else self.megatron.minimum(self.world_size)

    def to_dict(self) -> dict:
        """The report as JSON-ready data: every module, collective, total and lint."""
        place = lambda p: None if p is None else repr(p)  # noqa: E731
        dims = lambda shape: [_number(d) for d in shape]  # noqa: E731
        traffic = self.traffic()
        return {
            "world_size": _number(self.world_size),
            "inputs": [{"name": n, "shape": dims(s), "dtype": t} for n, s, t in self.inputs],
            "modules": [{
                "fqn": r.fqn, "type": r.type, "style": place(r.style),
                "params": [{
                    "name": p.name, "placement": place(p.placement), "shape": dims(p.shape),
                    "local": [{"shape": dims(s), "ranks": dims((a, b))} for s, a, b in p.local],
                    "bytes_per_rank": _number(p.bytes), "tied_to": p.tied,
                } for p in r.params],
                "transitions": [{"slot": t.slot, "given": place(t.given), "desired": place(t.desired),
                                 "steps": [repr(s) for s in t.steps]} for t in r.transitions],
                "per_rank": [{"name": n, "global": g, "local": v} for n, g, v in r.sizes],
                **{phase: {k: {"count": n, "bytes": _number(b)}
                           for k, (n, b) in traffic.get((r.fqn, phase), {}).items()}
                   for phase in ("forward", "backward")},
            } for r in self.rows],
            "comms": [{"fqn": c.fqn, "phase": c.phase, "kind": c.kind, "numel": _number(c.numel),
                       "group_size": _number(c.group_size), "itemsize": c.itemsize,
                       "bytes": _number(c.bytes), "overlaps": c.overlaps} for c in self.comms],
            "collectives": {"forward": self.count("forward"), "backward": self.count("backward"),
                            "total": self.collectives},
            "bytes_per_step": _number(self.bytes),
            "param_bytes_per_rank": _number(self.param_bytes),
            "megatron": None if self.megatron is None else {
                "blocks": len(self.megatron.blocks), "tokens": _number(self.megatron.tokens),
                "hidden": self.megatron.hidden, "itemsize": self.megatron.itemsize,
                "formula_bytes": _number(self.megatron_bytes),
                "measured_bytes": _number(self.blocks_bytes)},
            "lints": list(self.lints),
            "work": {phase: attrs.asdict(w) for phase, w in self.work},
            "step_time_s": None if self.step is None else {
                "forward": attrs.asdict(self.step.forward), "backward": attrs.asdict(self.step.backward),
                "optimizer": self.step.optimizer, "total": self.step.total},
            "warnings": list(self.warnings),
            "invariance": list(self.invariance),
            "invariant_chunks": self.chunks,
        }

    def to_html(self, baseline: Report | None = None, *, name: str = "this plan",
                baseline_name: str = "baseline") -> str:
        """A self-contained HTML page (``tpfn.dryrun.html``): totals, the fraction of
        parameters sharded, what each rank holds, the step's collectives in order, every
        module with its slots' steps and a picture of each tensor; with ``baseline`` (the
        report of another plan), the two side by side under their names."""
        return html(self, baseline, name=name, baseline_name=baseline_name)

    def traffic(self) -> dict:
        """``{(fqn, phase): {kind: (count, bytes)}}`` over the collectives."""
        out: dict = {}
        for c in self.comms:
            out.setdefault((c.fqn, c.phase), {}).setdefault(c.kind, []).append(c.bytes)
        return {key: {k: (len(b), _total(b)) for k, b in kinds.items()} for key, kinds in out.items()}

    def title(self) -> str:
        """What ran: ``'tpfn.explain on 8 ranks: one forward and backward of input 0 (8, 16) int64'``."""
        inputs = ", ".join(f"{n} {fmt_shape(s)} {t}" for n, s, t in self.inputs)
        run = f"one forward and backward of {inputs}" if inputs else "no inputs given, nothing ran"
        ranks = f"{self.world_size} rank{'s' * (self.world_size != 1)}"
        return f"tpfn.explain on {ranks}: {run}"

    def totals(self) -> list:
        """``(label, text)`` of every total: collectives, bytes, parameter bytes, Megatron."""
        counts = lambda c: ", ".join(f"{n} {k}" for k, n in c.items()) or "none"  # noqa: E731
        out = [
            ("collectives per step", f"forward {counts(self.count('forward'))}; backward "
             f"{counts(self.count('backward'))}; total {counts(self.collectives)}"),
            ("bytes per rank per step", f"forward {_exact(self.phase_bytes('forward'))}; backward "
             f"{_exact(self.phase_bytes('backward'))}; total {_exact(self.bytes)}"),
            ("parameter bytes per rank", _exact(self.param_bytes)),
        ]
        if self.step is not None:
            out.append(("predicted step time", str(self.step)))
        if self.chunks is not None:
            ranks = ", ".join(str(2 ** i) for i in range(self.chunks.bit_length()))
            out.append(("invariant mode", f"{self.chunks} chunks: the same bits on {ranks} ranks"
                        + "".join(f"; {line}" for line in self.invariance)))
        backward = [c for c in self.comms if c.phase == "backward"]
        if backward:
            out.insert(2, ("overlapping weight gradients",
                           f"{sum(c.overlaps > 0 for c in backward)} of {len(backward)} backward collectives"))
        m = self.megatron
        if m is not None:
            formula, measured = self.megatron_bytes, self.blocks_bytes
            ratio = "- (one rank moves nothing)" if formula == 0 else fmt_ratio(measured / formula)
            out.append((f"Megatron minimum, {len(m.blocks)} blocks",
                        f"8(t-1)/t*b*s*h*e each with b*s={m.tokens}, h={m.hidden}, e={m.itemsize}: "
                        f"{_exact(formula)}; measured in the blocks: {_exact(measured)}; ratio {ratio}"))
        return out

    def text(self, width: int | None = 80, *, wide: bool = False) -> str:
        """The table for a terminal ``width`` columns wide (None: no limit).

        By default one line per module (repeated blocks once, with their count): its style
        and the collectives it issues forward and backward; a cell too long for its column
        wraps onto the next line, a style between its ``>>``. ``wide``: also a line per
        parameter (placement, global -> local shape) and per input and output slot (layout
        given -> desired, the steps between). ``str(report)`` is ``report.text()``.

        >>> report = tpfn.explain(nn.Linear(16, 16), colwise() >> prepare_out(Replicate()),
        ...                       world_size=4, example_inputs=(8, 16), dtype=torch.float32)
        >>> print(report.text(width=60))
        tpfn.explain on 4 ranks: one forward and backward of input 0
          (8, 16) float32
        <BLANKLINE>
        module      style                     forward       backward
        <root>      colwise()                 1 all_gather  -
          (Linear)    >> prepare_out(           384 B
                      Replicate())
        <BLANKLINE>
        collectives per step: forward 1 all_gather; backward none;
          total 1 all_gather
        bytes per rank per step: forward 384 B; backward 0 B;
          total 384 B
        parameter bytes per rank: 272 B
        """
        return "\n".join(_table(self, checked_width(width), wide))

    def __str__(self) -> str:
        return self.text()


def _traffic_cells(traffic: dict, fqn) -> list:
    """The forward and backward cells of module ``fqn``: ``1 all_reduce``, ``28.0 KiB;``, ..."""
    cells = []
    for phase in ("forward", "backward"):
        kinds = list(traffic.get((fqn, phase), {}).items())
        tokens = [t for i, (k, (n, b)) in enumerate(kinds)
                  for t in (f"{n} {k}", fmt_bytes(b) + (";" if i < len(kinds) - 1 else ""))]
        cells.append(("", tokens or ["-"]))
    return cells


def _module_lines(row: Row, traffic: dict, wide: bool) -> list:
    style, moved = cell("" if row.style is None else repr(row.style)), _traffic_cells(traffic, row.fqn)
    if not wide:
        return [[None, style, *moved]]
    lines = [[None, style, EMPTY, *moved]]
    for p in row.params:
        lines.append([cell(f"  {p.name}"), cell("-" if p.placement is None else repr(p.placement)),
                      cell(p.text), EMPTY, EMPTY])
    for t in row.transitions:
        lines.append([cell(f"  {t.slot}"), cell(f"{t.given!r} -> {t.desired!r}"),
                      cell(", ".join(map(repr, t.steps)) or "-"), EMPTY, EMPTY])
    for name, whole, local in row.sizes:
        lines.append([cell(f"  {name}"), cell("per rank"), cell(f"{whole} -> {local}"), EMPTY, EMPTY])
    return lines


def _table(report: Report, width: int | None, wide: bool) -> list:
    traffic = report.traffic()
    groups: dict = {}
    for row in report.rows:  # modules in the plan or that communicate; repeated blocks once
        if row.style is None and not {(row.fqn, "forward"), (row.fqn, "backward")} & traffic.keys():
            continue
        full = _module_lines(row, traffic, True)
        key = (generalize(row.fqn), row.type, str([line[1:] for line in full]))
        groups.setdefault(key, [row, _module_lines(row, traffic, wide), 0])[2] += 1
    head = ["module", "style | layout", "global -> local | steps", "forward", "backward"]
    cells = [[cell(h) for h in (head if wide else [head[0], "style", *head[3:]])]]
    for row, lines, n in groups.values():
        name = generalize(row.fqn) if n > 1 else (row.fqn or "<root>")
        lines[0][0] = ("", [name, f"({row.type})" + (f" x{n}" if n > 1 else "")])
        cells.extend(lines)
    if {(None, "forward"), (None, "backward")} & traffic.keys():
        cells.append([("", ["(outside every module)"]), EMPTY, *([EMPTY] if wide else []),
                      *_traffic_cells(traffic, None)])
    out = [*prose(report.title(), width), "", *render(cells, width), ""]
    out += [line for label, text in report.totals() for line in flow(f"{label}: {text}", width)]
    for title, lints in (("warnings (the numbers would be wrong):", report.warnings),
                         ("notes:", report.notes)):
        if lints:
            out += ["", title, *(line for lint in lints for line in prose(lint, width, "  - ", "    "))]
    return out
