"""A report as one self-contained HTML page: no script, no style sheet, font or image fetched.

From the top: the totals and the fraction of the parameters the plan shards (and the ones
every rank holds whole); what each rank holds, parameters and activations; the step's
collectives in the order they ran, forward then backward, each with its module, slot, kind
and bytes; with a baseline (another plan's report), the two plans side by side
(``tpfn.dryrun.compare``); then every module (``<details>``, open but for repeats of an
earlier block), each parameter and slot with its forward and backward steps and a picture
of which rank holds which block (``tpfn.dryrun.picture``).

>>> mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
>>> plan = {"0": colwise(), "2": rowwise()}
>>> page = html(tpfn.explain(mlp, plan, world_size=2, example_inputs=torch.ones(2, 4)))
>>> page.startswith("<!doctype html>") and "Shard(dim=0)" in page and "http" not in page
True
>>> "94.7%" in page and "75.0%" in page    # sharded: all but 2's bias, by bytes and by tensors
True
"""

from __future__ import annotations

from html import escape

import sympy

from tpfn._fqn import join
from tpfn.dryrun import figures
from tpfn.dryrun.compare import comparison
from tpfn.dryrun.picture import colour, picture
from tpfn.dryrun.units import fmt_bytes, fmt_pct, fmt_ranks, fmt_ratio, grouped
from tpfn.layout import Partial, Replicate, Shard

__all__ = ["html", "STYLE", "KINDS"]

KINDS = {"all_gather": "#2563eb", "reduce_scatter": "#7c3aed", "all_reduce": "#dc2626",
         "all_to_all": "#059669"}  # each collective's colour
END = "(end of the backward)"

STYLE = """
:root { --ink: #1d2430; --muted: #667085; --line: #e2e6ec; --soft: #f5f7fa; --accent: #0b5cad; }
* { box-sizing: border-box; }
body { font: 14px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 0;
       color: var(--ink); background: #eef1f5; }
main { max-width: 1240px; margin: 0 auto; padding: 22px 26px 60px; }
h1 { font-size: 21px; margin: 0 0 2px; } h2 { font-size: 16px; margin: 0 0 10px; }
h3 { font-size: 13px; margin: 14px 0 6px; color: var(--muted); text-transform: uppercase;
     letter-spacing: .04em; }
code, .mono { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 12.5px; }
.sub, .note { color: var(--muted); } .note { font-size: 12.5px; margin: 4px 0 10px; }
section { background: #fff; border: 1px solid var(--line); border-radius: 12px; padding: 16px 20px;
          margin: 14px 0; box-shadow: 0 1px 2px rgba(16, 24, 40, .04); }
.cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(210px, 1fr)); gap: 12px;
         margin: 16px 0; }
.card { background: #fff; border: 1px solid var(--line); border-radius: 12px; padding: 12px 16px; }
.card .label { color: var(--muted); font-size: 11.5px; text-transform: uppercase; letter-spacing: .05em; }
.card .big { font-size: 27px; font-weight: 650; line-height: 1.25; }
.card.hero { border-color: #9cc3ee; background: linear-gradient(180deg, #f2f8ff, #fff); }
.card.hero .big { color: var(--accent); font-size: 34px; }
table { border-collapse: collapse; }
table.grid { width: 100%; }
table.grid th { text-align: left; font-weight: 600; color: var(--muted); font-size: 12px;
                border-bottom: 1px solid var(--line); padding: 4px 10px 4px 0; }
table.grid td { border-bottom: 1px solid var(--soft); padding: 3px 10px 3px 0; vertical-align: top; }
td.num, th.num { text-align: right; white-space: nowrap; }
.meter { height: 12px; background: var(--soft); border-radius: 6px; overflow: hidden; width: 320px;
         display: inline-block; vertical-align: middle; margin-right: 8px; }
.meter span { display: block; height: 100%; background: var(--accent); }
.stack { display: inline-flex; height: 12px; border-radius: 4px; overflow: hidden;
         vertical-align: middle; min-width: 2px; }
.stack .p { background: #4e79a7; } .stack .a { background: #f2a65a; }
.key { display: inline-block; width: 10px; height: 10px; border-radius: 2px; margin: 0 4px 0 10px; }
.strip { display: flex; gap: 2px; height: 26px; margin: 4px 0 10px; padding: 3px;
         background: var(--soft); border-radius: 6px; }
.strip a { display: block; min-width: 4px; border-radius: 3px; }
.kind { padding: 0 7px; border-radius: 9px; color: #fff; font-family: ui-monospace, monospace;
        font-size: 12px; white-space: nowrap; }
.bar { display: inline-block; height: 8px; border-radius: 2px; vertical-align: middle; }
details { margin-left: 1.1em; border-left: 1px solid var(--line); padding-left: .7em; }
details.root { margin-left: 0; border-left: 0; padding-left: 0; }
summary { cursor: pointer; padding: 3px 0; }
summary:hover { background: var(--soft); }
.type { color: var(--muted); } .style { color: #7a3e9d; } .moves { color: var(--accent); }
.same { color: var(--muted); font-style: italic; }
table.inner { margin: 4px 0 10px .6em; width: calc(100% - .6em); }
table.inner th { text-align: left; font-weight: 600; color: var(--muted); font-size: 12px; }
table.inner th.f { width: 250px; } table.inner th.b { width: 290px; }
.pics { display: flex; align-items: flex-start; margin-top: 4px; }
table.inner td { padding: 4px 14px 4px 0; vertical-align: top; border-top: 1px solid var(--soft); }
table.inner td.what { white-space: nowrap; }
.badge { padding: 1px 7px; border-radius: 9px; font-family: ui-monospace, monospace; font-size: 12px;
         white-space: nowrap; }
.shard { background: #dbeafe; } .replicate { background: #e5e7eb; } .partial { background: #fde68a; }
.plain { background: #fff; border: 1px dashed #9aa3b2; }
.step { display: block; white-space: nowrap; } .none { color: var(--muted); }
figure.pic { display: inline-block; margin: 2px 14px 4px 0; vertical-align: top; }
figure.pic svg { display: block; } figure.pic svg text { font: 600 11px system-ui, sans-serif;
  text-anchor: middle; pointer-events: none; }
figcaption { color: var(--muted); font-size: 11.5px; max-width: 210px; }
figcaption span { display: block; }
.arrow { margin: 8px 14px 0 0; color: var(--muted); font-size: 18px; }
.lints li.warning { color: #b42318; font-weight: 600; } .lints li.note { color: #9a3412; }
.better { color: #067647; } .worse { color: #b42318; }
"""


def _badge(placement) -> str:
    kind = {Shard: "shard", Replicate: "replicate", Partial: "partial"}.get(type(placement), "plain")
    text = "plain (every rank holds it whole)" if placement is None else repr(placement)
    return f'<span class="badge {kind}">{escape(text)}</span>'


def _kind(kind: str) -> str:
    return f'<span class="kind" style="background:{KINDS.get(kind, "#475467")}">{escape(kind)}</span>'


def _number(x):
    x = sympy.sympify(x)
    return None if x.free_symbols else float(x)


def _id(fqn) -> str:
    return "m-" + (escape(fqn) if fqn else "root")


def _comm(report, j: int) -> str:
    """A link to collective ``j`` in the timeline: its number, kind and bytes."""
    c = report.comms[j]
    return (f'<span class="step"><a href="#c{j + 1}">#{j + 1}</a> {_kind(c.kind)} '
            f'{escape(fmt_bytes(c.bytes))}</span>')


def _where(report, j: int, slots: dict) -> tuple:
    """(module, slot) of collective ``j`` for the timeline."""
    c = report.comms[j]
    if c.fqn is None:
        names = ", ".join(report.partial_grads) or "-"
        return END, f"partial gradients of {names}" if c.phase == "backward" else "outside every module"
    return c.fqn or "<root>", slots.get(j, "own computation")


def _cards(report, shares: figures.Sharded, held: list) -> str:
    counts = lambda ph: sum(report.count(ph).values())  # noqa: E731
    p0, a0 = held[0][2], held[0][3]
    cards = [
        ("hero", "parameters sharded", fmt_pct(shares.fraction),
         f"of the parameter bytes · {shares.tensors} of {shares.of_tensors} tensors · "
         f"{len(shares.whole)} whole on every rank"),
        ("", "sent per rank per step", fmt_bytes(report.bytes),
         f"forward {fmt_bytes(report.phase_bytes('forward'))} · backward "
         f"{fmt_bytes(report.phase_bytes('backward'))}"),
        ("", "collectives per step", str(len(report.comms)),
         f"forward {counts('forward')} · backward {counts('backward')}"),
        ("", "held by rank 0",
         fmt_bytes(sympy.sympify(p0) + (a0 if report.kept is None else report.kept)),
         f"parameters {fmt_bytes(p0)} · activations " + (
             f"at the slots {fmt_bytes(a0)}" if report.kept is None
             else f"saved for the backward {fmt_bytes(report.kept)}")),
    ]
    if report.megatron is not None and report.megatron_bytes:
        cards.append(("", f"Megatron ratio, {len(report.megatron.blocks)} blocks",
                      fmt_ratio(report.blocks_bytes / report.megatron_bytes),
                      f"the blocks send {fmt_bytes(report.blocks_bytes)}; the minimum is "
                      f"{fmt_bytes(report.megatron_bytes)}"))
    return '<div class="cards" id="cards">' + "".join(
        f'<div class="card {k}"><div class="label">{escape(label)}</div><div class="big">'
        f'{escape(big)}</div><div class="sub">{escape(small)}</div></div>'
        for k, label, big, small in cards) + "</div>"


def _sharded(report, shares: figures.Sharded) -> str:
    by_count = shares.tensors / shares.of_tensors if shares.of_tensors else None
    meters = "".join(
        f'<p><span class="meter"><span style="width:{100 * (_number(x) or 0):.1f}%"></span></span>'
        f'<b>{fmt_pct(x)}</b> {escape(text)}</p>'
        for x, text in ((shares.fraction, f"of the parameter bytes ({fmt_bytes(shares.bytes)} of "
                         f"{fmt_bytes(shares.of_bytes)})"),
                        (by_count, f"of the parameter tensors ({shares.tensors} of "
                         f"{shares.of_tensors})")))
    rows = "".join(
        f"<tr><td><code>{escape(name)}</code>{f' &times;{k}' if k > 1 else ''}</td>"
        f"<td>{_badge(p.placement)}</td><td class=mono>{escape(p.text)}</td>"
        f'<td class="num">{escape(fmt_bytes(figures.nbytes(p.shape, p.itemsize)))}'
        f"{' each' if k > 1 else ''}</td></tr>"
        for name, k, p in grouped(list(shares.whole)))
    whole = (f'<h3>Whole on every rank ({len(shares.whole)})</h3><table class="grid" id="whole">'
             '<tr><th>parameter</th><th>layout</th><th>shape</th><th class="num">bytes</th></tr>'
             f"{rows}</table>") if shares.whole else "<p>Every parameter is sharded.</p>"
    return (f'<section id="sharded"><h2>Parameters sharded</h2>{meters}<p class="note">Sharded: laid '
            "out Shard(...), each rank holding a slice. Bytes are of the whole (global) tensors; a tied "
            f"parameter counts once.</p>{whole}</section>")


def _ranks(report, held: list) -> str:
    top = max((_number(p + a) or 0 for _, _, p, a in held), default=0) or 1
    rows = []
    for a, b, p, act in held:
        bars = "".join(f'<span class="{k}" style="width:{300 * (_number(x) or 0) / top:.1f}px"></span>'
                       for k, x in (("p", p), ("a", act)))
        rows.append(f"<tr><td>{fmt_ranks(a, b)}</td><td class=num>{escape(fmt_bytes(p))}</td>"
                    f"<td class=num>{escape(fmt_bytes(act))}</td><td class=num>"
                    f"{escape(fmt_bytes(sympy.sympify(p) + act))}</td><td><span class=stack>{bars}"
                    "</span></td></tr>")
    acts, n = figures.activations(report), report.world_size
    listed = "".join(
        f"<tr><td><code>{escape(f.fqn or '<root>')}</code> {escape(f.slot)}</td>"
        f"<td class=mono>{escape(str(tuple(f.shape)))}</td><td>{_badge(layout)}</td><td class=num>"
        f"{escape(fmt_bytes(figures.nbytes(figures.local(f.shape, layout, n, 0), f.itemsize)))}"
        "</td></tr>" for f, layout in acts)
    counted = (f'<details class="root"><summary>The {len(acts)} activations counted</summary>'
               '<table class="grid"><tr><th>handed on by</th><th>global shape</th><th>layout</th>'
               f'<th class="num">on rank 0</th></tr>{listed}</table></details>') if acts else ""
    if report.kept is not None:
        kept = (f'<p id="kept">Saved for the backward on rank 0: <b>{escape(fmt_bytes(report.kept))}</b>'
                '<span class="note">: every tensor autograd saved in the dry run\'s forward, each '
                "storage once, the model's parameters and buffers left out; what rank 0 keeps "
                "between forward and backward, inside modules too (no other rank keeps more: rank "
                "0 holds the largest shards).</span></p>")
    elif report.inputs:
        kept = '<p id="kept" class="note">Saved for the backward: no one formula of the sizes.</p>'
    else:
        kept = ""
    return (
        '<section id="ranks"><h2>What each rank holds</h2>'
        '<p class="note">Parameters: each rank\'s shards (a tied parameter once). Activations at the '
        "slots: each distinct tensor a bound module's slot handed on in the dry run (an input after its "
        "move, an output after its move), at its layout on that rank, counted once where slots hand on "
        "one tensor's memory; modules the plan leaves alone add none. Not counted: gradients, optimizer "
        'state.<span class="key" style="background:#4e79a7"></span>parameters'
        '<span class="key" style="background:#f2a65a"></span>activations at the slots</p>'
        '<table class="grid"><tr><th>ranks</th><th class="num">parameters</th>'
        '<th class="num">activations at the slots</th><th class="num">total</th><th></th></tr>'
        f'{"".join(rows)}</table>{kept}{counted}</section>')


def _timeline(report, slots: dict) -> str:
    if not report.comms:
        ran = "the plan communicates nothing" if report.inputs else "no example inputs: nothing ran"
        return f'<section id="timeline"><h2>The step\'s collectives</h2><p>None ({ran}).</p></section>'
    top = max((_number(c.bytes) or 0 for c in report.comms), default=0) or 1
    strips = []
    for phase in ("forward", "backward"):
        js = [(j, c) for j, c in enumerate(report.comms) if c.phase == phase]
        segs = "".join(
            f'<a href="#c{j + 1}" style="flex-grow:{max(_number(c.bytes) or 1, 1):g};'
            f'background:{KINDS.get(c.kind, "#475467")}" title="#{j + 1} '
            f'{escape(" ".join(_where(report, j, slots)))}: {c.kind} {escape(fmt_bytes(c.bytes))}"></a>'
            for j, c in js)
        strips.append(f"<h3>{phase}: {len(js)} collectives, "
                      f"{escape(fmt_bytes(report.phase_bytes(phase)))}</h3>"
                      + (f'<div class="strip">{segs}</div>' if js else '<p class="none">none</p>'))
    rows = []
    for j, c in enumerate(report.comms):
        module, slot = _where(report, j, slots)
        link = f'<a href="#{_id(c.fqn)}">{escape(module)}</a>' if c.fqn is not None else escape(module)
        width = 160 * (_number(c.bytes) or 0) / top
        rows.append(
            f'<tr id="c{j + 1}"><td class=num>{j + 1}</td><td>{c.phase}</td><td><code>{link}</code>'
            f"</td><td>{escape(slot)}</td><td>{_kind(c.kind)}</td>"
            f"<td class=num>{escape(str(c.numel))}</td><td class=num>{escape(fmt_bytes(c.bytes))}</td>"
            f'<td><span class="bar" style="width:{width:.1f}px;background:'
            f'{KINDS.get(c.kind, "#475467")}"></span></td></tr>')
    opened = " open" if len(rows) <= 80 else ""
    legend = "".join(f'<span class="key" style="background:{v}"></span>{k}' for k, v in KINDS.items())
    return (
        f'<section id="timeline"><h2>The step\'s collectives, in order</h2>'
        f'<p class="note">As they ran on rank 0: the forward, then the backward; each segment\'s '
        f"width is its bytes.{legend}</p>{''.join(strips)}"
        f'<details class="root"{opened}><summary>All {len(rows)} collectives</summary>'
        '<table class="grid"><tr><th class="num">#</th><th>phase</th><th>module</th><th>slot</th>'
        '<th>kind</th><th class="num">elements</th><th class="num">bytes sent</th><th></th></tr>'
        f'{"".join(rows)}</table></details></section>')


def _steps(report, js) -> str:
    return "".join(_comm(report, j) for j in js) or '<span class="none">no collective</span>'


def _as_in(like: str) -> str:
    return f'<span class="none">pictures: as in <a href="#{_id(like)}">{escape(like)}</a></span>'


def _param(report, row, p, shares: dict, own: list, like: str | None) -> str:
    """A parameter's row; ``like``: the module this one repeats, whose pictures stand for it."""
    fqn = join(row.fqn, p.name)
    if p.tied is not None:
        pic = f'<span class="none">the tensor of {escape(p.tied)}</span>'
    else:
        pic = (f'<div class="pics">{picture(p.shape, p.placement, report.world_size, name=fqn)}</div>'
               if like is None else _as_in(like))
    forward = '<span class="none">none: each rank computes on what it holds</span>'
    if fqn in report.partial_grads:
        share = shares.get(fqn)
        where = (f"{_comm(report, share[0])} its share {escape(fmt_bytes(share[1]))}"
                 if share else _steps(report, figures.ending(report)))
        backward = (f'{_badge(Partial())} gradient, summed at the end of the backward with the '
                    f"other partial gradients: {where}")
    elif any(report.comms[j].phase == "backward" for j in own):
        backward = '<span class="none">as DTensor computes it: see own computation</span>'
    else:
        backward = '<span class="none">no collective</span>'
    return (f'<tr id="p-{escape(fqn)}"><td class="what"><code>{escape(p.name)}</code></td>'
            f'<td>{_badge(p.placement)}<div class="mono">{escape(p.text)}</div>{pic}</td>'
            f"<td>{forward}</td><td>{backward}</td></tr>")


def _slot(report, fqn: str, t, flow, like: str | None) -> str:
    """A slot's row: its layouts, pictures, and its steps forward and backward."""
    n, name = report.world_size, f"{fqn} {t.slot}"
    if flow is None or flow.shape is None:
        pic = ""
    elif like is not None:
        pic = _as_in(like)
    elif t.given == t.desired:
        pic = f'<div class="pics">{picture(flow.shape, t.desired, n, name=name)}</div>'
    else:
        pic = (f'<div class="pics">{picture(flow.shape, t.given, n, name=name)}<span class="arrow">'
               f"&rarr;</span>{picture(flow.shape, t.desired, n, name=name)}</div>")
    steps = "".join(f'<span class="step mono">{escape(repr(s))}</span>' for s in t.steps)
    moved = "" if flow is None else "".join(_comm(report, j) for j in flow.forward)
    forward = (steps + moved) or '<span class="none">nothing moves</span>'
    ran = report.inputs or report.comms
    backward = _steps(report, flow.backward) if flow is not None else \
        '<span class="none">not run' + ("" if ran else " (no example inputs)") + "</span>"
    shape = "" if flow is None or flow.shape is None else \
        f'<div class="mono">{escape(str(tuple(flow.shape)))}</div>'
    return (f'<tr id="s-{escape(fqn or "root")}/{escape(t.slot.replace(" ", "_"))}"><td class="what">'
            f'{escape(t.slot)}</td><td>{_badge(t.given)} &rarr; '
            f"{_badge(t.desired)}{shape}{pic}</td><td>{forward}</td><td>{backward}</td></tr>")


def _signature(report, fqn: str, tree) -> str:
    """What a module and its submodules do, their names relative to it: equal for repeats of
    one block."""
    def walk(f, rel):
        row = tree.rows[f]
        slots = [(x.slot, x.shape, [(report.comms[j].kind, tree.sizes[j])
                                    for j in (*x.forward, *x.backward)])
                 for x in tree.by_module.get(f, ())]
        params = [(p.name, p.placement, p.shape, p.local, p.tied is None) for p in row.params]
        mine = (rel, row.type, repr(row.style), params, row.transitions, slots,
                tree.traffic.get((f, "forward")), tree.traffic.get((f, "backward")))
        return [mine] + [x for c in tree.children.get(f, ()) for x in walk(c, rel + c[len(f):])]
    return repr(walk(fqn, ""))


class _Tree:
    """The module tree: every module a ``<details>``, open but for the repeats of a block."""

    def __init__(self, report):
        self.report, self.rows = report, {r.fqn: r for r in report.rows}
        self.children: dict = {}
        for fqn in self.rows:
            if fqn:
                self.children.setdefault(fqn.rpartition(".")[0], []).append(fqn)
        self.flows, self.traffic = figures.flows(report), report.traffic()
        self.sizes = [c.bytes for c in report.comms]
        self.own: dict = {}  # module -> the bytes it sends itself
        for c, size in zip(report.comms, self.sizes):
            self.own[c.fqn] = self.own.get(c.fqn, 0) + size
        self.total = sum(self.sizes, sympy.Integer(0))
        self.by_module: dict = {}
        for f in report.flows:
            self.by_module.setdefault(f.fqn, []).append(f)
        self.shares = figures.shares(report)
        self.firsts: dict = {}  # a repeated block -> the first block like it
        for kids in self.children.values():
            seen: dict = {}
            for kid in kids:
                if kid.rpartition(".")[2].isdigit():
                    first = seen.setdefault(_signature(report, kid, self), kid)
                    if first != kid:
                        self.firsts[kid] = first

    def node(self, fqn: str, like: str | None = None) -> str:
        """``like``: the module this one repeats (its pictures are drawn there)."""
        report, row = self.report, self.rows[fqn]
        repeat = self.firsts.get(fqn)
        like = repeat if like is None else like
        own, within = self.own.get(fqn, 0), self.within(fqn)
        bar, share = "", (_number(within) or 0) / (_number(self.total) or 1)
        if share:
            bar = (f' <span class="bar" style="width:{max(2, 200 * share):.1f}px;'
                   'background:var(--accent)"></span>')
        moves = [f"sends {fmt_bytes(own)}"] * bool(own) + [f"with submodules {fmt_bytes(within)}"] * (
            within != own)
        moves = escape(" " + ", ".join(moves)) if moves else ""
        name = fqn.rpartition(".")[2] if fqn else "<root>"
        same = f' <span class="same">same as {escape(repeat)}</span>' if repeat else ""
        head = (f'<summary><code>{escape(name)}</code> <span class="type">{escape(row.type)}</span>'
                + (f' <span class="style mono">{escape(repr(row.style))}</span>' if row.style else "")
                + f'<span class="moves">{moves}</span>{bar}{same}</summary>')
        mine = figures.own(report, fqn)
        cells = [_param(report, row, p, self.shares, mine, like) for p in row.params]
        cells += [_slot(report, fqn, t, self.flows.get((fqn, t.slot)), like) for t in row.transitions]
        if mine:
            forward, backward = ([j for j in mine if report.comms[j].phase == phase]
                                 for phase in ("forward", "backward"))
            cells.append('<tr><td class="what">own computation</td><td><span class="none">on '
                         f"DTensors, outside its slots</span></td><td>{_steps(report, forward)}"
                         f"</td><td>{_steps(report, backward)}</td></tr>")
        body = ('<table class="inner"><tr><th></th><th>layout</th><th class="f">forward</th>'
                f'<th class="b">backward</th></tr>{"".join(cells)}</table>') if cells else ""
        kids = "".join(self.node(c, None if like is None else like + c[len(fqn):])
                       for c in self.children.get(fqn, ()))
        opened = "" if repeat else " open"
        root = ' class="root"' if fqn == "" else ""
        return f'<details id="{_id(fqn)}"{root}{opened}>{head}{body}{kids}</details>'

    def within(self, fqn: str):
        """The bytes ``fqn`` and its submodules send."""
        total = sum((self.within(c) for c in self.children.get(fqn, ())), sympy.Integer(0))
        total += self.own.get(fqn, 0)
        return sympy.factor(total) if total.free_symbols else total


def _tree(report) -> str:
    tree = _Tree(report)
    ends = figures.ending(report)
    end = (f'<details id="m-end" open><summary><code>{END}</code> <span class="type">'
           "the partial gradients of replicated parameters, summed in bulk</span></summary>"
           f'<table class="inner"><tr><td class="what">parameters</td><td class="mono">'
           f'{escape(", ".join(report.partial_grads) or "-")}</td><td></td><td>'
           f"{_steps(report, ends)}</td></tr></table></details>") if ends else ""
    legend = " ".join(_badge(p) for p in (Shard(0), Replicate(), Partial(), None))
    count = report.world_size if not isinstance(report.world_size, sympy.Basic) else 4
    keys = "".join(f'<span class="key" style="background:{colour(r)[0]}"></span>rank {r}'
                   for r in range(min(count, 8)))
    return (f'<section id="modules"><h2>Modules</h2><p class="note">{legend}{keys}. Each slot: '
            "the layout it arrives in &rarr; the one it hands on, the algebra's steps and the "
            "collectives they ran forward, and those its gradient ran backward (numbers link to "
            "the timeline). Repeats of a block are closed; open one to see it.</p>"
            f'{tree.node("") if "" in tree.rows else ""}{end}</section>')


def html(report, baseline=None, *, name: str = "this plan", baseline_name: str = "baseline") -> str:
    """The page of ``report`` (with ``baseline``, another plan's report, side by side)."""
    shares, held = figures.sharded(report), figures.held(report)
    slots = {j: f.slot for f in report.flows for j in (*f.forward, *f.backward)}
    lints = "".join(f'<li class="{"warning" if lint in report.warnings else "note"}">'
                    f'{"warning" if lint in report.warnings else "note"}: {escape(lint)}</li>'
                    for lint in report.lints)
    totals = "".join(f"<tr><td>{escape(label)}</td><td>{escape(text)}</td></tr>"
                     for label, text in report.totals())
    return (
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{escape(report.title())}</title><style>{STYLE}</style></head><body><main>"
        f"<header><h1>{escape(report.title())}</h1><div class=\"sub\">the plan's dry run on fake "
        f"ranks, seen from rank 0</div></header>{_cards(report, shares, held)}"
        + (f'<section id="lints"><h2>Lints</h2><ul class="lints">{lints}</ul></section>' if lints else "")
        + _sharded(report, shares) + _ranks(report, held) + _timeline(report, slots)
        + (comparison(report, baseline, name, baseline_name) if baseline is not None else "")
        + _tree(report)
        + f'<section id="totals"><h2>Totals</h2><table class="totals">{totals}</table></section>'
        + "</main></body></html>\n"
    )
