"""Every transformers architecture that declares a tensor-parallel plan, on 2 gloo ranks:
builds, tpfn at parity, transformers' own TP at parity, notes (``tests/hf_zoo.py``).

    python tools/hf_sweep.py                 # all of them (under a minute on 2 quiet cores)
    python tools/hf_sweep.py llama qwen3     # some of them
    python tools/hf_sweep.py --docs          # and rewrite the table in docs/huggingface.md
    python tools/hf_sweep.py --json out.json # and save every run's errors

Each architecture's tiny model is built from its config on both ranks, then run on one
device, with ``tpfn.parallelize(model, mesh, tpfn.from_hf(model.tp_plan, model))`` and with
transformers' own tensor parallelism, output and every gradient compared with one device.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT] if ROOT not in sys.path else []
DOC = os.path.join(ROOT, "docs", "huggingface.md")
BATCH = 8  # architectures per call shipped to the ranks


def sweep(names: list, ranks) -> list:
    """Rank 0's outcome of each architecture, ``BATCH`` per call to the ranks."""
    from tests import hf_zoo

    found = []
    for i in range(0, len(names), BATCH):
        found += ranks.run(hf_zoo.outcomes, names[i:i + BATCH], timeout=900)[0]
    return found


def summary(found: list) -> str:
    """How many architectures build, and where each TP is at parity."""
    from tests import hf_zoo

    rows = [(f["name"], *hf_zoo.row(f)[1:4]) for f in found]
    built = [r for r in rows if r[1] == "yes"]
    by = collections.defaultdict(list)
    for name, _, mine, theirs in built:
        by[mine, theirs].append(f"`{name}`")

    def alone(key):
        return f"{len(by[key])}" + (f" ({', '.join(by[key])})" if 0 < len(by[key]) <= 3 else "")

    return (f"{len(rows)} architectures declare a plan; {len(built)} build and run on token ids "
            f"({len(rows) - len(built)} skipped or not building, each with its reason). tpfn at "
            f"parity on {sum(r[2] == 'yes' for r in built)}, transformers' own TP on "
            f"{sum(r[3] == 'yes' for r in built)}; both on {len(by['yes', 'yes'])}, tpfn alone on "
            f"{alone(('yes', 'no'))}, transformers alone on {alone(('no', 'yes'))}, neither on "
            f"{len(by['no', 'no'])}.")


def write_docs(found: list, command: str) -> None:
    from tests import hf_zoo

    hf_zoo.rewrite(DOC, "architectures", f"{summary(found)} Measured with `{command}`.\n\n{hf_zoo.table(found)}")


def main() -> None:
    from tests import hf_zoo
    from tests.ranks import Ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="model types (default: every one with a plan)")
    parser.add_argument("--docs", action="store_true", help="rewrite the table of docs/huggingface.md")
    parser.add_argument("--json", metavar="PATH", help="save every run's errors")
    args = parser.parse_args()
    names = args.names or hf_zoo.architectures()
    start = time.perf_counter()
    with Ranks(2, timeout=900) as ranks:
        found = sweep(names, ranks)
    print(hf_zoo.table(found), end="\n\n")
    print(summary(found))
    print(f"{time.perf_counter() - start:.0f} s for {len(names)} architectures")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1)
    if args.docs:
        write_docs(found, "python tools/hf_sweep.py --docs")
        print(f"rewrote {DOC}")


if __name__ == "__main__":
    main()
