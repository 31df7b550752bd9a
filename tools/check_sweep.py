"""Every plan the sweeps found at one device's parity, proven by ``tpfn.check`` on 2 fake ranks:
``from_hf``'s plans of tools/hf_sweep.py and ``suggest``'s of tools/suggest_sweep.py, read from
the tables of docs/huggingface.md and docs/suggest.md (2 ranks). A right plan must check ok, or
name the op it cannot prove; a finding that says its numbers are wrong is a false alarm.

    python tools/check_sweep.py                  # every plan at parity, both sweeps
    python tools/check_sweep.py --hf             # from_hf's plans only (--suggest: suggest's only)
    python tools/check_sweep.py llama gpt2       # some model types
    python tools/check_sweep.py --json out.json  # and save each outcome

No ranks are started: the check runs on fake ranks in this process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT] if ROOT not in sys.path else []


def at_parity() -> dict:
    """``{"hf": [model types], "suggest": [model types]}`` whose plan is at parity on 2 ranks in
    the sweeps' tables."""
    from tests import hf_zoo

    hf = hf_zoo.rows(os.path.join(ROOT, "docs", "huggingface.md"), "architectures")
    suggested = hf_zoo.rows(os.path.join(ROOT, "docs", "suggest.md"), "suggest")
    return {"hf": sorted(n for n, cells in hf.items() if cells[1] == "yes"),
            "suggest": sorted(n for n, cells in suggested.items() if cells[1] == "yes")}


def one(name: str, which: str) -> dict:
    """``{"name", "plan", "outcome", "seconds", "findings"}`` of one model type's plan:
    ``outcome`` is ``"ok"``, ``"unproven"`` (only ops no rule proves), ``"wrong"`` (a false alarm,
    the plan being at parity) or ``"error"``."""
    import tpfn
    from tests import hf_zoo, suggest_zoo
    from tpfn.analysis.inputs import defaults

    found = {"name": name, "plan": which, "findings": []}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, inputs = (hf_zoo.build(name) if which == "hf" else suggest_zoo.build(name))
            plan = (tpfn.from_hf(model.tp_plan, model) if which == "hf" else
                    tpfn.suggest(model, 2, example_inputs=None if defaults(model) is not None else inputs))
            start = time.perf_counter()
            report = tpfn.check(model, plan, 2, inputs)
        found["seconds"] = round(time.perf_counter() - start, 2)
    except Exception as e:  # noqa: BLE001 - reported
        found.update(outcome="error", why=f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}")
        return found
    found["findings"] = [str(f) for f in report.findings]
    found["outcome"] = "ok" if report.ok else "wrong" if report.wrong else "unproven"
    return found


def summary(found: list) -> str:
    lines = []
    for which in ("hf", "suggest"):
        mine = [f for f in found if f["plan"] == which]
        if not mine:
            continue
        by = {k: [f["name"] for f in mine if f["outcome"] == k] for k in ("ok", "unproven", "wrong", "error")}
        share = 100 * len(by["unproven"]) / len(mine)
        lines.append(f"{which}: {len(mine)} plans at parity; ok {len(by['ok'])}, unproven {len(by['unproven'])} "
                     f"({share:.1f}%), wrong {len(by['wrong'])} (false alarms), error {len(by['error'])}")
        for k in ("unproven", "wrong", "error"):
            if by[k]:
                lines.append(f"  {k}: {', '.join(by[k])}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="model types (default: every one at parity)")
    parser.add_argument("--hf", action="store_true", help="from_hf's plans only")
    parser.add_argument("--suggest", action="store_true", help="suggest's plans only")
    parser.add_argument("--json", metavar="PATH", help="save each outcome")
    args = parser.parse_args()
    import transformers

    transformers.logging.set_verbosity_error()
    parity = at_parity()
    kinds = [k for k, on in (("hf", args.hf), ("suggest", args.suggest)) if on] or ["hf", "suggest"]
    start, found = time.perf_counter(), []
    for which in kinds:
        names = [n for n in parity[which] if not args.names or n in args.names]
        for i, name in enumerate(names):
            found.append(one(name, which))
            f = found[-1]
            said = [*(x[:300] for x in f["findings"][:3]), *([f["why"]] if "why" in f else [])]
            print(f"[{which} {i + 1}/{len(names)}] {name}: {f['outcome']} {f.get('seconds', '')}"
                  + "".join(f"\n    {x}" for x in said), file=sys.stderr, flush=True)
    print(summary(found))
    print(f"({time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(found, out, indent=1)


if __name__ == "__main__":
    main()
