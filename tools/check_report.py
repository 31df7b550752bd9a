"""Render the dry-run report of a known plan in headless Chromium and check what it shows.

The plan: examples/llama.py's Llama with its sequence-parallel plan on 2 ranks, beside
PyTorch's own Megatron plan for it (``ColwiseParallel``/``RowwiseParallel`` through
``tpfn.from_torch``). The script writes ``report.html``, then has Chromium (no network, a
fresh profile) take ``report.png``, a screenshot, and dump the DOM it built,
``report.dom.html``, and checks that the DOM holds every part of the page: every module,
the pictures of every tensor, each slot's collectives forward and backward, the timeline of
the step's collectives in order, the fraction of parameters sharded, what each rank holds,
and the comparison. It exits with 1 and names what is missing, else prints where the files are.

    python tools/check_report.py [--out DIR] [--chromium PATH]

Chromium: ``apt-get install -y chromium`` on Debian. The test suite checks the same parts of
the page as Python's ``html.parser`` reads it, with no browser (``tests/test_html.py``).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
from html.parser import HTMLParser

ROOT = pathlib.Path(__file__).resolve().parent.parent
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars"]
VOID = {"meta", "br", "hr", "img", "input", "link", "col", "wbr"}


class Page(HTMLParser):
    """A page as the checks read it: the text inside each element with an id, the links
    inside each module (its own, not its submodules'), each figure's tensor, the tags."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.open: list = []  # (tag, id) of the elements open
        self.texts: dict = {}  # id -> its text
        self.links: dict = {}  # module id -> the hrefs of its own rows
        self.tensors: list = []  # data-tensor of each figure
        self.closed: list = []  # the ids of the modules that start closed
        self.tags: set = set()
        self.ids: list = []
        self.feed(text)
        self.close()

    def close(self):
        super().close()
        self.texts = {i: " ".join(text.split()) for i, text in self.texts.items()}

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.add(tag)
        self.handle_data(" ")  # a tag parts words
        if "id" in attrs:
            self.ids.append(attrs["id"])
        if tag == "figure":
            self.tensors.append(attrs.get("data-tensor", ""))
        if tag == "details" and "open" not in attrs and attrs.get("id", "").startswith("m-"):
            self.closed.append(attrs["id"])
        if tag == "a" and "href" in attrs:
            module = next((i for t, i in reversed(self.open) if t == "details" and i), None)
            self.links.setdefault(module, []).append(attrs["href"])
        if tag not in VOID:
            self.open.append((tag, attrs.get("id")))

    def handle_startendtag(self, tag, attrs):
        self.tags.add(tag)

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        while self.open:  # a DOM dump closes what the source left implied
            if self.open.pop()[0] == tag:
                break

    def handle_data(self, data):
        for _, i in self.open:
            if i:
                self.texts[i] = self.texts.get(i, "") + data


def missing(page: str, report, baseline=None, names: tuple = ("this plan", "baseline")) -> list:
    """What of ``report``'s page (its HTML, or the DOM a browser built from it) is not
    there: an empty list when every part is."""
    from tpfn._fqn import generalize, join
    from tpfn.dryrun import figures

    dom, problems = Page(page), []
    ids = set(dom.ids)

    def need(ok, what):
        if not ok:
            problems.append(what)

    fetched = re.findall(r"(?:src|href)=\"(?!#)[^\"]*\"|<script|<link|<iframe|<img|@import|url\(",
                         page)
    need(not fetched, f"the page fetches or runs something: {fetched[:3]}")
    for row in report.rows:  # every module reachable
        need(f"m-{row.fqn or 'root'}" in ids, f"module {row.fqn or '<root>'!r}")
    drawn = {generalize(t) for t in dom.tensors}
    for row in report.rows:  # a picture of every parameter and slot tensor
        for p in row.params:
            if p.tied is None:
                name = join(row.fqn, p.name)
                need(generalize(name) in drawn, f"the picture of parameter {name!r}")
    for f in report.flows:
        if f.shape is not None:
            need(generalize(f"{f.fqn} {f.slot}") in drawn, f"the picture of {f.fqn!r} {f.slot}")
    for f in report.flows:  # each slot's collectives, forward and backward, in its module
        for j in (*f.forward, *f.backward):
            need(f"#c{j + 1}" in dom.links.get(f"m-{f.fqn or 'root'}", []),
                 f"collective #{j + 1} in the row of {f.fqn!r} {f.slot}")
    for j in figures.ending(report):
        need(f"#c{j + 1}" in dom.links.get("m-end", []), f"collective #{j + 1} at the end of the backward")
    rows = [i for i in dom.ids if re.fullmatch(r"c\d+", i)]  # the timeline, in order
    need(rows == [f"c{j + 1}" for j in range(len(report.comms))],
         f"the timeline's {len(report.comms)} collectives in order (found {len(rows)})")
    for j, c in enumerate(report.comms):
        text = dom.texts.get(f"c{j + 1}", "")
        module = "(end of the backward)" if c.fqn is None else (c.fqn or "<root>")
        need(c.phase in text and c.kind in text and module in text,
             f"collective #{j + 1}'s phase, module and kind in the timeline")
    shares = figures.sharded(report)
    share = "-" if shares.fraction is None else f"{100 * float(shares.fraction):.1f}%"
    need(share in dom.texts.get("cards", "") and share in dom.texts.get("sharded", ""),
         f"the fraction sharded, {share}")
    whole = dom.texts.get("sharded", "")
    for name, _ in shares.whole:
        need(generalize(name) in whole or name in whole, f"{name!r} among the parameters left whole")
    held = dom.texts.get("ranks", "")
    for a, b, _, _ in figures.held(report):
        need((f"rank {a}" if a == b else f"ranks {a}-{b}") in held, f"the row of ranks {a}-{b}")
    need("Activations at the slots" in held or "activations at the slots" in held,
         "what the memory view counts")
    if baseline is not None:
        text = dom.texts.get("compare", "")
        need(all(n in text for n in names), f"the comparison with {names[1]!r}")
        need("compare-modules" in ids, "the comparison per module")
    return problems


def known():
    """The report of the known plan and of its baseline."""
    import tpfn
    from examples.llama import Llama, llama_plan
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    b = "blocks.*."
    native = {"embed": RowwiseParallel(input_layouts=Replicate()),
              **{b + f"attn.{p}": ColwiseParallel() for p in "qkv"},
              b + "attn.o": RowwiseParallel(),
              b + "mlp.gate": ColwiseParallel(), b + "mlp.up": ColwiseParallel(),
              b + "mlp.down": RowwiseParallel(),
              "head": ColwiseParallel(output_layouts=Replicate())}
    report = tpfn.explain(Llama(), llama_plan(sequence_parallel_=True), world_size=2,
                          example_inputs=(2, 16))
    baseline = tpfn.explain(Llama(), tpfn.from_torch(native), world_size=2, example_inputs=(2, 16))
    return report, baseline


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder for the page, its screenshot and its DOM (a new "
                        "temporary folder by default)")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "chromium",
                        help="the browser to run (chromium)")
    args = parser.parse_args(argv)
    if shutil.which(args.chromium) is None and not os.path.exists(args.chromium):
        print(f"check_report: no browser {args.chromium!r}: apt-get install -y chromium, or "
              "--chromium PATH", file=sys.stderr)
        return 2
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="tpfn-report-"))
    out.mkdir(parents=True, exist_ok=True)
    names = ("tpfn, sequence parallel", "PyTorch's Megatron plan")
    report, baseline = known()
    page = out / "report.html"
    page.write_text(report.to_html(baseline, name=names[0], baseline_name=names[1]), "utf-8")
    with tempfile.TemporaryDirectory(prefix="tpfn-chromium-") as profile:
        run = [args.chromium, *FLAGS, f"--user-data-dir={profile}"]
        subprocess.run([*run, "--window-size=1280,2200", f"--screenshot={out / 'report.png'}",
                        page.as_uri()], check=True, capture_output=True, timeout=180)
        dom = subprocess.run([*run, "--dump-dom", page.as_uri()], check=True,
                             capture_output=True, text=True, timeout=180).stdout
    (out / "report.dom.html").write_text(dom, "utf-8")
    problems = missing(dom, report, baseline, names)
    if not (out / "report.png").stat().st_size:
        problems.append("an empty screenshot")
    for problem in problems:
        print(f"check_report: missing {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"check_report: every part is there; {page}, {out / 'report.png'}, "
          f"{out / 'report.dom.html'}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # tpfn and examples/ from this checkout
    sys.exit(main())
