"""A report as one self-contained HTML page: the module tree, where each parameter lives, and
the bytes each module sends, with no script and no resource from the network.

Each module is a collapsible node (``<details>``): its style, its parameters with their
placement (coloured by kind) and global -> local shapes, its slots, its collectives; a bar
shows the share of the step's bytes sent within it.

>>> mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
>>> page = html(tpfn.explain(mlp, {"0": colwise(), "2": rowwise()}, world_size=2))
>>> page.startswith("<!doctype html>") and "Shard(dim=0)" in page and "http" not in page
True
"""

from __future__ import annotations

from html import escape

import sympy

from tpfn.layout import Partial, Replicate, Shard
from tpfn.dryrun.units import fmt_bytes, summary

__all__ = ["html"]

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em; color: #1d2430; }
h1 { font-size: 1.3em; } code, .mono { font-family: ui-monospace, monospace; font-size: 13px; }
table.totals td { padding: 2px 12px 2px 0; vertical-align: top; }
details { margin-left: 1.2em; border-left: 1px solid #d7dce3; padding-left: .6em; }
summary { cursor: pointer; padding: 2px 0; }
.type { color: #6b7687; } .style { color: #7a3e9d; } .moves { color: #0b5cad; }
.bar { display: inline-block; height: 8px; background: #0b5cad; vertical-align: middle;
       margin-left: 6px; border-radius: 2px; }
table.inner { margin: 2px 0 6px 1.2em; border-collapse: collapse; }
table.inner td { padding: 1px 10px 1px 0; }
.badge { padding: 0 6px; border-radius: 8px; font-family: ui-monospace, monospace; font-size: 12px; }
.shard { background: #dbeafe; } .replicate { background: #e5e7eb; } .partial { background: #fde68a; }
.plain { background: #fff; border: 1px dashed #9aa3b2; }
.lints li { color: #9a3412; }
"""


def _badge(placement) -> str:
    kind = {Shard: "shard", Replicate: "replicate", Partial: "partial"}.get(type(placement), "plain")
    text = "plain (every rank holds it whole)" if placement is None else repr(placement)
    return f'<span class="badge {kind}">{escape(text)}</span>'


def _node(report, fqn: str, rows: dict, children: dict, traffic: dict, total) -> str:
    row = rows[fqn]
    own, within = report.moved(fqn), report.moved(fqn, within=True)
    bar = ""
    if not within.free_symbols and not sympy.sympify(total).free_symbols and total:
        bar = f'<span class="bar" style="width:{max(1, round(200 * float(within / total)))}px"></span>'
    moves = [f"sends {fmt_bytes(own)}"] * bool(own) + [f"with submodules {fmt_bytes(within)}"] * (
        within != own)
    moves = escape(" " + ", ".join(moves)) if moves else ""
    name = fqn.rpartition(".")[2] if fqn else "<root>"
    head = (f'<summary><code>{escape(name)}</code> <span class="type">{escape(row.type)}</span>'
            + (f' <span class="style mono">{escape(repr(row.style))}</span>' if row.style else "")
            + f'<span class="moves">{moves}</span>{bar}</summary>')
    cells = [f"<tr><td><code>{escape(p.name)}</code></td><td>{_badge(p.placement)}</td>"
             f"<td class=mono>{escape(p.text)}</td></tr>" for p in row.params]
    cells += [f"<tr><td>{escape(t.slot)}</td><td>{_badge(t.given)} &rarr; {_badge(t.desired)}</td>"
              f"<td class=mono>{escape(', '.join(map(repr, t.steps)) or 'no communication')}</td></tr>"
              for t in row.transitions]
    cells += [f"<tr><td>{phase}</td><td colspan=2>{escape(summary(traffic[(fqn, phase)]))}</td></tr>"
              for phase in ("forward", "backward") if (fqn, phase) in traffic]
    body = f'<table class="inner">{"".join(cells)}</table>' if cells else ""
    kids = "".join(_node(report, c, rows, children, traffic, total) for c in children.get(fqn, ()))
    opened = " open" if fqn.count(".") < 1 else ""
    return f"<details{opened}>{head}{body}{kids}</details>"


def html(report) -> str:
    """The page of ``report``: totals, lints and the module tree."""
    rows = {r.fqn: r for r in report.rows}
    children: dict = {}
    for fqn in rows:
        if fqn:
            children.setdefault(fqn.rpartition(".")[0], []).append(fqn)
    totals = "".join(f"<tr><td>{escape(label)}</td><td>{escape(text)}</td></tr>"
                     for label, text in report.totals())
    lints = "".join(f"<li>{escape(lint)}</li>" for lint in report.lints)
    legend = " ".join(_badge(p) for p in (Shard(0), Replicate(), Partial(), None))
    tree = _node(report, "", rows, children, report.traffic(), report.bytes) if "" in rows else ""
    return (
        "<!doctype html>\n<html><head><meta charset=\"utf-8\">"
        f"<title>{escape(report.title())}</title><style>{_STYLE}</style></head><body>"
        f"<h1>{escape(report.title())}</h1><table class=\"totals\">{totals}</table>"
        + (f'<h2>Lints</h2><ul class="lints">{lints}</ul>' if lints else "")
        + f"<h2>Modules</h2><p>{legend}</p>{tree}</body></html>\n"
    )
