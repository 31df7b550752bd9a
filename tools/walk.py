"""What a reader follows through tpfn for one column-wise ``nn.Linear``: the functions that run.

    python tools/walk.py                # kernels on: parallelize, then one forward and backward
    python tools/walk.py --kernels off  # the reference route alone
    python tools/walk.py --list         # and every function, file by file

On 2 gloo ranks, rank 0 parallelizes ``nn.Sequential(nn.Linear(16, 32))`` with ``{"0": colwise()}``
(setup; the plan's resolution and checks, pure functions of values, are counted apart), then runs one forward and backward of a (4, 6, 16) input that needs a gradient (call).
Every function of ``tpfn/`` that runs is counted once, whole (the lines of its definition), as a
reader who opens it reads it; a file counts once however many of its functions run. Also printed:
the lines of the trusted core (layouts, the algebra, styles, plans, the interpreter, the kernels,
bounded collectives, random streams, private torch, errors, names) and of ``tpfn/`` as a whole.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import inspect
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT] if ROOT not in sys.path else []
PACKAGE = os.path.join(ROOT, "tpfn")
PLANS = os.path.join(PACKAGE, "plans")
PURE = ("resolve", "refusals", "tied_outside")  # the plan layer's work at parallelize: pure
CORE = ("layout.py", "algebra.py", "style", "plans", "interpret", "kernels", "bounded.py", "_torch.py",
        "errors.py", "_fqn.py", "rng.py")


def _lines(path: str) -> int:
    with open(path) as f:
        return sum(1 for _ in f)


def sizes() -> tuple:
    """(lines of the trusted core, lines of tpfn/)."""
    core = whole = 0
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                n = _lines(path)
                whole += n
                top = os.path.relpath(path, PACKAGE).split(os.sep)[0]
                core += n if top in CORE else 0
    return core, whole


def _rank(rank: int, port: int, kernels: bool, out) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh

    import tpfn

    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    x = torch.randn(4, 6, 16, requires_grad=True)
    for warm in (True, False):  # the first run imports and caches; the second is what a call runs
        seen = {"setup": collections.Counter(), "call": collections.Counter(), "plan": collections.Counter()}
        ran = {"setup": set(), "call": set(), "plan": set()}
        phase = "setup"

        pure = []  # the plan's resolution and checks running (values in, values out)

        def tracer(frame, event, arg):
            code = frame.f_code
            if not code.co_filename.startswith(PACKAGE):
                return None
            if event == "call":
                if code.co_filename.startswith(PLANS) and code.co_name in PURE:
                    pure.append(frame)
                (seen["plan"] if pure else seen[phase])[code] += 1
                return tracer
            if event == "line" and not pure:
                ran[phase].add((code.co_filename, frame.f_lineno))
            if event == "return" and pure and pure[-1] is frame:
                pure.pop()
            return tracer

        model, plan = nn.Sequential(nn.Linear(16, 32)), {"0": tpfn.colwise()}
        sys.settrace(None if warm else tracer)
        one = tpfn.parallelize(model, mesh, plan, kernels=kernels)
        phase = "call"
        one(x).sum().backward()
        sys.settrace(None)
    if rank == 0:
        out.put(({phase: [(c.co_filename, c.co_firstlineno, c.co_name) for c in codes if not c.co_name.startswith("<")]
                  for phase, codes in seen.items()}, ran))
    dist.barrier()
    dist.destroy_process_group()


def _length(path: str, first: int) -> int:
    """The lines of the definition that starts at line ``first`` of ``path``."""
    with open(path) as f:
        source = f.readlines()
    return len(inspect.getblock(source[first - 1:]))


def main() -> None:
    import multiprocessing as mp
    import socket

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", choices=("on", "off"), default="on")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, args.kernels == "on", out)) for r in range(2)]
    for p in procs:
        p.start()
    found, ran = out.get(timeout=300)
    for p in procs:
        p.join()
    total, files = 0, collections.defaultdict(list)
    seen = set()
    for phase in ("setup", "call"):
        for path, first, name in found[phase]:
            if (path, first) not in seen:
                seen.add((path, first))
                files[os.path.relpath(path, ROOT)].append((first, name, _length(path, first)))
    for path in sorted(files):
        lines = sum(n for *_, n in files[path])
        total += lines
        print(f"{path:40s} {len(files[path]):3d} functions {lines:5d} lines")
        if args.list:
            for first, name, n in sorted(files[path]):
                print(f"    {first:5d} {name:40s} {n:4d}")
    for phase in ("plan", "setup", "call"):
        defs = {(path, first) for path, first, _ in found[phase]}
        lines = sum(_length(path, first) for path, first in defs)
        print(f"{phase}: functions of {lines} lines in {len({p for p, _ in defs})} files; "
              f"{len(ran[phase])} lines run")
    core, whole = sizes()
    print(f"kernels {args.kernels}: {total} lines in {len(files)} files (setup and call); "
          f"trusted core {core} lines; tpfn/ {whole} lines")


if __name__ == "__main__":
    main()
