"""Every text model type transformers builds tiny from its config, with tpfn.suggest's plan,
on 2 gloo ranks and on 4 where its heads allow: at parity, the share of parameter bytes
sharded, and the collectives of one step beside from_hf's where the model declares a plan
(``tests/suggest_zoo.py``).

    python tools/suggest_sweep.py                 # every model type
    python tools/suggest_sweep.py gpt2 bert       # some of them
    python tools/suggest_sweep.py --docs          # and rewrite the table in docs/suggest.md
    python tools/suggest_sweep.py --json out.json # and save every run (with its errors)
    python tools/suggest_sweep.py --merge a.json b.json --docs  # one sweep run in parts

Each tiny model is built from its config on every rank, then run on one device, and with
``tpfn.parallelize(model, mesh, tpfn.suggest(model, n))``: output and every gradient compared
with one device; where the model declares a plan, ``tpfn.from_hf(model.tp_plan, model)`` too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT] if ROOT not in sys.path else []
DOC = os.path.join(ROOT, "docs", "suggest.md")
BATCH = 8  # model types per call shipped to the ranks


def sweep(names: list, ranks, n: int) -> list:
    """Rank 0's outcome of each model type on ``n`` ranks, ``BATCH`` per call."""
    from tests import suggest_zoo

    found = []
    for i in range(0, len(names), BATCH):
        found += ranks.run(suggest_zoo.outcomes, names[i:i + BATCH], n, timeout=1800)[0]
        print(f"  {n} ranks: {min(i + BATCH, len(names))}/{len(names)}", file=sys.stderr, flush=True)
    return found


def _cell(found: dict | None) -> str:
    from tests import suggest_zoo

    if found is None:
        return "-"
    return "yes" if suggest_zoo.at_parity(found) else "no"


def _collectives(run: dict | None) -> str:
    if not run or "error" in run:
        return "-"
    return str(sum(run["collectives"].values()))


def row(two: dict, four: dict | None) -> tuple:
    """``(model type, plan, parity at 2, parity at 4, sharded, collectives, from_hf's, notes)``."""
    from tests import hf_zoo, suggest_zoo

    name = f"`{two['name']}`" + (f" ({two['model']})" if two.get("model") else "")
    mine, theirs = two["suggest"], two.get("hf")
    notes = []
    for found, n in ((two, 2), (four, 4)):
        if found is None:
            continue
        run = found["suggest"]
        if "error" in run:
            notes.append(f"{n} ranks: {run['error']}")
        elif not suggest_zoo.at_parity(found):
            notes.append(f"{n} ranks: off by {hf_zoo.worst(run)}")
    if theirs is not None and "error" in theirs:
        notes.append(f"from_hf: {theirs['error']}")
    if four is None:
        notes.append(f"{two['heads']} heads: not run on 4 ranks" if two.get("heads") else
                     "no head count: not run on 4 ranks")
    share = "-" if "error" in mine else f"{round(100 * mine['share'])}%"
    hf = "-" if not two["planned"] else _collectives(theirs) + (
        f" ({round(100 * theirs['share'])}%)" if "error" not in theirs else "")
    return (name, "yes" if two["planned"] else "no", _cell(two), _cell(four), share,
            _collectives(mine), hf, "; ".join(notes))


def table(found: dict) -> str:
    """The markdown table of docs/suggest.md, one row per model type that runs on token ids."""
    lines = ["| model type | own plan | 2 ranks at parity | 4 ranks at parity | parameter bytes "
             "sharded (2 ranks) | collectives per step | from_hf's (its bytes sharded) | notes |",
             "|---|---|---|---|---|---|---|---|"]
    for name, (two, four) in found.items():
        if two["skip"]:
            continue
        cells = [c.replace("|", "\\|").replace("\n", " ") for c in row(two, four)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(found: dict) -> str:
    """The headline figures: parity with and without a plan (on 2 ranks, and on 4 where the
    heads allow), the sharded share, and the collectives beside from_hf's."""
    from tests import suggest_zoo

    runs = [(two, four) for two, four in found.values() if not two["skip"]]
    skipped = len(found) - len(runs)
    plain = [(t, f) for t, f in runs if not t["planned"]]
    planned = [(t, f) for t, f in runs if t["planned"]]

    def ok(t, f, which="suggest"):
        return suggest_zoo.at_parity(t, which) and (f is None or suggest_zoo.at_parity(f, which))

    def parity(group, which="suggest"):
        wide = [f for _, f in group if f is not None]
        two = sum(suggest_zoo.at_parity(t, which) for t, _ in group)
        four = sum(suggest_zoo.at_parity(f, which) for f in wide)
        return (f"{sum(ok(t, f, which) for t, f in group)} (on 2 ranks {two} of {len(group)}, on 4 "
                f"{four} of the {len(wide)} whose heads allow)")

    shares = sorted(t["suggest"]["share"] for t, _ in plain if "error" not in t["suggest"])
    median = shares[len(shares) // 2] if shares else 0.0
    both = [t for t, f in planned if ok(t, f) and ok(t, f, "hf")]
    more = [t for t in both if sum(t["suggest"]["collectives"].values()) > sum(t["hf"]["collectives"].values())]
    wider = sum(t["suggest"]["share"] > t["hf"]["share"] for t in more)
    mine, theirs = (sorted(t[w]["share"] for t in both) for w in ("suggest", "hf"))
    total = {w: sum(sum(t[w]["collectives"].values()) for t in both) for w in ("suggest", "hf")}
    medians = (f" (a median {round(100 * mine[len(mine) // 2])}% of the parameter bytes sharded against "
               f"from_hf's {round(100 * theirs[len(theirs) // 2])}%)") if both else ""
    return (f"{len(found)} model types; {len(runs)} build tiny and run on token ids ({skipped} do not, "
            f"or take other inputs). Without a plan of their own: {len(plain)}, suggest's plan at "
            f"parity on {parity(plain)}, sharding a median {round(100 * median)}% of the parameter "
            f"bytes. With one: {len(planned)}, suggest at parity on {parity(planned)}, from_hf on "
            f"{parity(planned, 'hf')}; where both are{medians}, suggest's plan issues no more collectives per "
            f"step (on 2 ranks) on {len(both) - len(more)} of {len(both)}, and on {wider} of the other "
            f"{len(more)} it shards more of the parameter bytes than from_hf's; in all, "
            f"{total['suggest']:,} collectives per step against from_hf's {total['hf']:,}.")


def write_docs(found: dict, command: str, seconds: float) -> None:
    from tests import hf_zoo

    hf_zoo.rewrite(DOC, "suggest", f"{summary(found)} Measured with `{command}` ({seconds / 60:.0f} "
                                   f"minutes on 2 cores shared with other work).\n\n{table(found)}")


def main() -> None:
    from tests import suggest_zoo
    from tests.ranks import Ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="model types (default: every one)")
    parser.add_argument("--docs", action="store_true", help="rewrite the table of docs/suggest.md")
    parser.add_argument("--json", metavar="PATH", help="save every run (with its errors)")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="take the runs of earlier --json files (one sweep in parts) instead of running")
    args = parser.parse_args()
    if args.merge:
        found, seconds = {}, 0.0
        for path in args.merge:
            with open(path) as f:
                saved = json.load(f)
            found.update({n: tuple(runs) for n, runs in saved["runs"].items()})  # the last part's run
            seconds += saved["seconds"]
        command = (f"python tools/suggest_sweep.py NAMES... --json PART.json` in {len(args.merge)} parts "
                   f"by model type (a type in several, as the last ran it), then `python "
                   f"tools/suggest_sweep.py --merge PART.json... --docs")
    else:
        names = args.names or suggest_zoo.types()
        start = time.perf_counter()
        with Ranks(2, timeout=1800) as ranks:
            two = {f["name"]: f for f in sweep(names, ranks, 2)}
        wide = [n for n, f in two.items() if not f["skip"] and f["heads"] and f["heads"] % 4 == 0]
        with Ranks(4, timeout=1800) as ranks:
            four = {f["name"]: f for f in sweep(wide, ranks, 4)}
        found = {n: (two[n], four.get(n)) for n in names}
        seconds, command = time.perf_counter() - start, "python tools/suggest_sweep.py --docs"
    print(table(found), end="\n\n")
    print(summary(found))
    print(f"{seconds:.0f} s for {len(found)} model types")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds": seconds, "runs": found}, f, indent=1)
    if args.docs:
        write_docs(found, command, seconds)
        print(f"rewrote {DOC}")


if __name__ == "__main__":
    main()
