"""Two plans' reports side by side: the totals, and each module's style and collectives
under either plan, with the difference in bytes.

>>> mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
>>> x = torch.ones(8, 16, requires_grad=True)
>>> ours = tpfn.explain(mlp, {"0": colwise(), "2": rowwise()}, world_size=4, example_inputs=x)
>>> whole = tpfn.explain(mlp, {}, world_size=4, example_inputs=x)
>>> section = comparison(ours, whole, "Megatron", "no TP")
>>> section.startswith('<section id="compare">') and "+1.5 KiB" in section
True
"""

from __future__ import annotations

from html import escape

import sympy

from tpfn.dryrun import figures
from tpfn.dryrun.units import fmt_bytes, fmt_pct, fmt_ratio, grouped, summary

__all__ = ["comparison", "difference"]


def difference(a, b) -> str:
    """Bytes ``a`` against ``b``: ``'+1.5 KiB'`` (``x0.50`` where both are numbers and ``b``
    is not 0), ``'same'``, or the formula of the difference, in a span marking fewer bytes
    better."""
    d = sympy.simplify(sympy.sympify(a) - b)
    if d == 0:
        return '<span class="same">same</span>'
    if d.free_symbols:
        return f'<span class="mono">{escape(str(d))}</span>'
    known = not sympy.sympify(a).free_symbols and not sympy.sympify(b).free_symbols
    ratio = f" (&times;{float(a) / float(b):.2f})" if known and a and b else ""
    sign, mark = ("+", "worse") if d > 0 else ("-", "better")
    return f'<span class="{mark}">{sign}{escape(fmt_bytes(abs(d)))}{ratio}</span>'


def _counts(report, phase: str) -> str:
    return ", ".join(f"{n} {k}" for k, n in report.count(phase).items()) or "none"


def _ratio(report):
    if report.megatron is None or not report.megatron_bytes:
        return None
    return report.blocks_bytes / report.megatron_bytes


def _totals(a, b) -> str:
    ha, hb = figures.held(a)[0], figures.held(b)[0]
    sa, sb = figures.sharded(a), figures.sharded(b)
    sizes = lambda label, x, y: (label, fmt_bytes(x), fmt_bytes(y), difference(x, y))  # noqa: E731
    rows = [
        *((f"collectives, {phase}", _counts(a, phase), _counts(b, phase), _count_diff(a, b, phase))
          for phase in ("forward", "backward")),
        *(sizes(f"bytes sent per rank, {phase}", a.phase_bytes(phase), b.phase_bytes(phase))
          for phase in ("forward", "backward")),
        sizes("bytes sent per rank per step", a.bytes, b.bytes),
        sizes("parameter bytes on rank 0", ha[2], hb[2]),
        sizes("activations at the slots, rank 0", ha[3], hb[3]),
        ("saved for the backward, rank 0", _bytes(a.kept), _bytes(b.kept),
         "" if a.kept is None or b.kept is None else difference(a.kept, b.kept)),
        ("parameters sharded (bytes)", fmt_pct(sa.fraction), fmt_pct(sb.fraction), ""),
    ]
    ra, rb = _ratio(a), _ratio(b)
    if ra is not None or rb is not None:
        rows.append(("Megatron ratio of the blocks", fmt_ratio(ra), fmt_ratio(rb), ""))
    return "".join(f"<tr><td>{escape(label)}</td><td>{escape(x)}</td><td>{escape(y)}</td>"
                   f"<td>{d}</td></tr>" for label, x, y, d in rows)


def _count_diff(a, b, phase: str) -> str:
    n, m = sum(a.count(phase).values()), sum(b.count(phase).values())
    if n == m:
        return ('<span class="same">same</span>' if a.count(phase) == b.count(phase)
                else "as many, of other kinds")
    return f'<span class="{"better" if n < m else "worse"}">{n - m:+d} collectives</span>'


def _bytes(x) -> str:
    return "-" if x is None else fmt_bytes(x)


def _module(report, fqn, traffic) -> tuple:
    """(style, forward, backward, bytes) of module ``fqn`` (None: the end of the backward)."""
    row = next((r for r in report.rows if r.fqn == fqn), None)
    style = "" if row is None or row.style is None else repr(row.style)
    return (style, summary(traffic.get((fqn, "forward"), {})),
            summary(traffic.get((fqn, "backward"), {})), report.moved(fqn))


def _modules(a, b, names: tuple) -> str:
    ta, tb = a.traffic(), b.traffic()
    order = list(dict.fromkeys([r.fqn for r in a.rows] + [r.fqn for r in b.rows]))
    named = []
    for fqn in [*order, None]:
        x, y = _module(a, fqn, ta), _module(b, fqn, tb)
        if x[0] or y[0] or x[3] or y[3]:  # in either plan, or sending under either
            named.append(("(end of the backward)" if fqn is None else fqn, (x, y)))
    rows = []
    for name, k, (x, y) in grouped(named):
        cells = "".join(f'<td class="mono">{escape(s)}</td><td>{escape(f)}</td><td>{escape(g)}</td>'
                        for s, f, g, _ in (x, y))
        rows.append(f"<tr><td><code>{escape(name or '<root>')}</code>{f' &times;{k}' if k > 1 else ''}</td>"
                    f"{cells}<td>{difference(x[3], y[3])}{' each' if k > 1 else ''}</td></tr>")
    head = "".join(f'<th colspan="3">{escape(n)}</th>' for n in names)
    sub = "<th>style</th><th>forward</th><th>backward</th>" * 2
    return (f'<table class="grid" id="compare-modules"><tr><th></th>{head}<th></th></tr>'
            f"<tr><th>module</th>{sub}<th>difference in bytes</th>"
            f"</tr>{''.join(rows)}</table>")


def comparison(report, baseline, name: str, baseline_name: str) -> str:
    """The ``<section>`` that sets ``report`` (called ``name``) beside ``baseline``."""
    names = (name, baseline_name)
    same = report.title() == baseline.title()
    note = "" if same else (f'<p class="note">The baseline ran otherwise: '
                            f"{escape(baseline.title())}.</p>")
    return (
        f'<section id="compare"><h2>{escape(name)} against {escape(baseline_name)}</h2>{note}'
        f'<table class="grid" id="compare-totals"><tr><th></th><th>{escape(name)}</th>'
        f"<th>{escape(baseline_name)}</th><th>difference</th></tr>{_totals(report, baseline)}"
        f"</table><h3>Per module</h3><p class=\"note\">Modules either plan binds or that send "
        "something under either; repeated blocks once. Bytes sent per rank, forward and "
        f"backward together.</p>{_modules(report, baseline, names)}</section>")
