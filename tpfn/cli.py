"""The command line: ``tpfn explain MODEL PLAN --world-size N --input SHAPE``, and
``tpfn verify MODEL PLAN --world-size N --input SHAPE`` (the plan run on N real ranks and
compared with one device; exit status 0 when every number agrees, else 1, the report printed).

``MODEL`` and ``PLAN`` are import paths, ``package.module:name`` (or ``package.module.name``):
a module or a plan, or a function that returns one when called without arguments. Shapes
are comma-separated sizes; a name is a symbol (``--input b,s``), whose stand-in value
``--size s=16`` may set. The table goes to standard output (``--json``: the report's
``to_dict()``), ``--html FILE`` writes the picture. A plan that cannot work prints its
problems to standard error and exits with 1.

>>> main(["explain", "torch.nn:Identity", "tpfn:identity", "--world-size", "2"])
tpfn.explain on 2 ranks: no inputs given, nothing ran
<BLANKLINE>
module             style | layout  global -> local | steps  forward  backward
<root> (Identity)  identity()                               -        -
<BLANKLINE>
collectives per step: forward none; backward none; total none
bytes per rank per step: forward 0 B; backward 0 B; total 0 B
parameter bytes per rank: 0 B
0
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys

import sympy
import torch
import torch.nn as nn

from tpfn.dryrun import explain
from tpfn.dryrun.verify import verify
from tpfn.errors import PlanError

__all__ = ["main"]


def _load(path: str, what: str):
    """The object at ``package.module:name`` or ``package.module.name``, called if a factory."""
    module, sep, name = path.partition(":")
    if not sep:
        module, _, name = path.rpartition(".")
    try:
        value = importlib.import_module(module)
        for part in name.split("."):
            value = getattr(value, part)
    except (ImportError, AttributeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"cannot load the {what} {path!r}: {e}") from None
    if callable(value) and not isinstance(value, nn.Module):
        try:
            inspect.signature(value).bind()
        except TypeError as e:
            raise argparse.ArgumentTypeError(
                f"the {what} {path!r} is a function that needs arguments ({e}); point to one that "
                "takes none, or to the value itself") from None
        value = value()
    return value


def _size(text: str):
    text = text.strip()
    if text.isdigit():
        return int(text)
    if text.isidentifier():
        return sympy.Symbol(text, positive=True, integer=True)
    raise argparse.ArgumentTypeError(f"{text!r} is neither a size nor a name")


def _shape(text: str) -> tuple:
    return tuple(_size(d) for d in text.split(",") if d.strip())


def _stand_in(text: str) -> tuple:
    name, sep, value = text.partition("=")
    if not sep or not value.strip().isdigit():
        raise argparse.ArgumentTypeError(f"--size takes NAME=VALUE, e.g. s=16 (got {text!r})")
    return sympy.Symbol(name.strip(), positive=True, integer=True), int(value)


def _dtype(text: str) -> torch.dtype:
    dtype = getattr(torch, text, None)
    if not isinstance(dtype, torch.dtype):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a torch dtype (e.g. int64, float32, bfloat16)")
    return dtype


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tpfn", description="Tensor parallelism for PyTorch as a small functional language.")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("explain", help="dry-run a plan on fake ranks and print what it does",
                            description=__doc__.split("\n\n")[1])
    p.add_argument("model", help="import path of a module or a function returning one")
    p.add_argument("plan",
                   help="import path of a plan (dict, plan(), style) or a function returning one")
    p.add_argument("--world-size", required=True, type=_size, help="ranks, or a name for a formula")
    p.add_argument("--input", action="append", type=_shape, default=[], metavar="SHAPE",
                   help="an input's shape, e.g. 8,1024 or b,s (repeat for more inputs)")
    p.add_argument("--dtype", type=_dtype, default=torch.int64, help="dtype of the inputs (int64)")
    p.add_argument("--size", action="append", type=_stand_in, default=[], metavar="NAME=VALUE",
                   help="stand-in value of a named size")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--html", metavar="FILE", help="write the report as a self-contained HTML page")
    v = commands.add_parser("verify", help="run a plan on N real ranks and compare every number "
                            "with one device", description="Run the plan on N gloo ranks (forked "
                            "processes) and compare each module's output and every gradient with "
                            "one device. Exit status 0 when they agree, 1 when not.")
    v.add_argument("model", help="import path of a module or a function returning one")
    v.add_argument("plan",
                   help="import path of a plan (dict, plan(), style) or a function returning one")
    v.add_argument("--world-size", type=int, default=2, help="ranks (2)")
    v.add_argument("--input", action="append", type=_shape, default=[], metavar="SHAPE",
                   help="an input's shape, e.g. 8,1024 (repeat for more inputs)")
    v.add_argument("--dtype", type=_dtype, default=torch.int64, help="dtype of the inputs (int64)")
    v.add_argument("--tolerance", type=float, default=1e-4, help="largest relative error (1e-4)")
    v.add_argument("--seed", type=int, default=0, help="seed of the random inputs (0)")
    return parser


def _verify(parser, args, model, plan) -> int:
    if not args.input:
        parser.error("verify needs the example inputs' shapes: --input 2,128 (repeat for more)")
    if any(not isinstance(d, int) for shape in args.input for d in shape):
        parser.error("verify runs real ranks: give --input sizes as numbers, not names")
    try:
        report = verify(model, plan, tuple(args.input), world_size=args.world_size,
                        dtype=args.dtype, tolerance=args.tolerance, seed=args.seed)
    except (PlanError, ValueError, TypeError) as e:
        print(f"tpfn verify: {e}", file=sys.stderr)
        return 1
    print(report)
    return 0 if report.ok else 1


def main(argv=None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); the exit status.

    >>> main(["explain", "torch.nn:Identity", "tpfn:identity", "--world-size", "2", "--json"]) == 0
    {
      "world_size": 2,
    ...
    True
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if os.getcwd() not in sys.path and "" not in sys.path:  # the `tpfn` script: as `python -m`
        sys.path.insert(0, os.getcwd())
    try:
        model, plan = _load(args.model, "model"), _load(args.plan, "plan")
    except argparse.ArgumentTypeError as e:
        parser.error(str(e))
    if not isinstance(model, nn.Module):
        parser.error(f"the model {args.model!r} is a {type(model).__name__}, not an nn.Module")
    if args.command == "verify":
        return _verify(parser, args, model, plan)
    try:
        report = explain(model, plan, world_size=args.world_size,
                         example_inputs=tuple(args.input) or None, dtype=args.dtype,
                         sizes=dict(args.size))
    except (PlanError, ValueError, TypeError) as e:
        print(f"tpfn explain: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report.to_dict(), indent=2) if args.json else report)
    if args.html:
        with open(args.html, "w", encoding="utf-8") as f:
            f.write(report.to_html())
    return 0
