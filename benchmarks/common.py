"""What every benchmark shares: interleaved timing, the machine, tables and JSON results."""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [p for p in (ROOT, os.path.join(ROOT, "examples")) if p not in sys.path]
RESULTS = os.environ.get("TPFN_BENCH_RESULTS") or os.path.join(ROOT, "benchmarks", "results")
"""Where ``Table.save`` writes NAME.json (``TPFN_BENCH_RESULTS``, or ``run.py --results DIR``)."""


def interleaved(variants: dict, repeats: int, calls: int, seed: int = 0) -> dict:
    """Median seconds per call of each variant (a function of no arguments).

    Each repeat times ``calls`` calls of every variant, in a shuffled order, so that the
    machine's noise falls on all variants alike; ratios of the medians are what to read.
    """
    order = list(variants)
    rng = random.Random(seed)
    samples: dict = {name: [] for name in order}
    for _ in range(repeats):
        rng.shuffle(order)
        for name in order:
            fn = variants[name]
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - start) / calls)
    return {name: statistics.median(s) for name, s in samples.items()}


def machine() -> dict:
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "machine": platform.machine(),
            "processor": platform.processor() or platform.machine()}


class Table:
    """A result: a title, columns, rows, a verdict per target, notes; printed and saved."""

    def __init__(self, name: str, title: str, columns: list):
        self.name, self.title, self.columns = name, title, columns
        self.rows: list = []
        self.targets: list = []  # (description, met)
        self.notes: list = []

    def add(self, *row) -> None:
        self.rows.append(list(row))

    def target(self, description: str, met: bool) -> None:
        self.targets.append((description, bool(met)))

    def markdown(self) -> str:
        cells = [[_cell(c) for c in row] for row in self.rows]
        lines = [f"| {' | '.join(self.columns)} |", f"|{'|'.join('---' for _ in self.columns)}|"]
        lines += [f"| {' | '.join(r)} |" for r in cells]
        lines += [""] + [f"- target: {d} -- {'met' if m else 'NOT met'}" for d, m in self.targets]
        lines += [f"- {n}" for n in self.notes]
        return "\n".join(lines)

    def text(self) -> str:
        cells = [self.columns] + [[_cell(c) for c in row] for row in self.rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(self.columns))]
        out = [self.title, "=" * len(self.title)]
        for j, row in enumerate(cells):
            out.append("  ".join(c.rjust(w) if j else c.ljust(w) for c, w in zip(row, widths)))
        out += [f"target: {d} -- {'met' if m else 'NOT met'}" for d, m in self.targets]
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)

    def save(self, directory: str | None = None) -> str:
        directory = directory or RESULTS
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{self.name}.json")
        with open(path, "w") as f:
            json.dump({"name": self.name, "title": self.title, "columns": self.columns,
                       "rows": self.rows, "targets": self.targets, "notes": self.notes,
                       "machine": machine()}, f, indent=1, default=str)
        return path


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)
