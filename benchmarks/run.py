"""Run every benchmark, print its table, save its JSON, and (``--docs``) rewrite the tables of
docs/performance.md.

    python -m benchmarks.run            # all of them (several minutes on 2 cores)
    python -m benchmarks.run --quick    # fewer repeats
    python -m benchmarks.run --docs     # and regenerate docs/performance.md
    python -m benchmarks.run step_time memory   # some of them
    python -m benchmarks.run step_time --results /tmp/bench   # the JSON elsewhere

The GPU benchmarks are apart: python -m benchmarks.gpu.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import re

from benchmarks.common import ROOT, machine

ALL = ("hook_overhead", "step_time", "invariance", "overlap_probe", "communication", "parallelize_time", "llama70b", "memory",
       "pretrained_memory")
DOC = os.path.join(ROOT, "docs", "performance.md")


def write_docs(tables: list, command: str) -> None:
    """Put each table between its markers in docs/performance.md, and the machine on top."""
    with open(DOC) as f:
        text = f.read()
    m = machine()
    stamp = (f"<!-- machine -->\nMeasured {datetime.date.today()} with `{command}` on {m['cpus']} "
             f"CPUs ({m['processor']}), Python {m['python']}, torch {m['torch']}.\n<!-- /machine -->")
    text = re.sub(r"<!-- machine -->.*?<!-- /machine -->", lambda _: stamp, text, flags=re.S)
    for table in tables:
        block = f"<!-- table:{table.name} -->\n{table.markdown()}\n<!-- /table -->"
        pattern = rf"<!-- table:{table.name} -->.*?<!-- /table -->"
        if not re.search(pattern, text, flags=re.S):
            raise SystemExit(f"docs/performance.md has no place for the table {table.name!r}")
        text = re.sub(pattern, lambda _, b=block: b, text, flags=re.S)
    with open(DOC, "w") as f:
        f.write(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", choices=(*ALL, []), metavar="NAME",
                        help=f"benchmarks to run (default: all of {', '.join(ALL)})")
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--docs", action="store_true", help="rewrite docs/performance.md")
    parser.add_argument("--results", metavar="DIR", default=None,
                        help="where to write NAME.json (default: benchmarks/results, or "
                             "$TPFN_BENCH_RESULTS)")
    args = parser.parse_args()
    tables = []
    for name in args.names or ALL:
        table = importlib.import_module(f"benchmarks.{name}").run(quick=args.quick)
        print(table.text(), end="\n\n", flush=True)
        print(f"saved {table.save(args.results)}\n", flush=True)
        tables.append(table)
    if args.docs:
        write_docs(tables, "python -m benchmarks.run" + (" --quick" if args.quick else "") + " --docs")
        print(f"rewrote {DOC}")
    missed = [(t.name, d) for t in tables for d, met in t.targets if not met]
    for name, description in missed:
        print(f"NOT met: {name}: {description}")


if __name__ == "__main__":
    main()
