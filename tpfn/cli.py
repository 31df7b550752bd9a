"""The command line: ``tpfn explain MODEL PLAN --world-size N --input SHAPE``, and
``tpfn verify MODEL PLAN --world-size N --input SHAPE`` (the plan run on N real ranks and
compared with one device; exit status 0 when every number agrees, else 1, the report printed);
``tpfn suggest MODEL --world-size N`` prints the plan ``tpfn.suggest`` derives, as code;
``tpfn check MODEL PLAN --world-size N`` proves the plan on N fake ranks, op by op
(``tpfn.check``; exit status 0 when every op is proven, 1 on a finding, ``--json`` for JSON).

MODEL and PLAN are import paths, package.module:name (or package.module.name), or a file and
a name in it, path/to/model.py:GPT: a module or a plan, or a function that returns one when
called without arguments. MODEL may also be a Hugging Face checkpoint folder or a config
(a .json file): the model is built from its config (explain, suggest, check: on meta, no weights;
verify: with the checkpoint's weights, or seeded random ones from a config), and PLAN, when
left out, is the model's own plan (``tpfn.from_hf``), else ``tpfn.suggest``'s. Each --input is [NAME=]SHAPE[:DTYPE][:grad]: comma-separated sizes
(a name is a symbol, --input b,s, whose stand-in value --size s=16 may set), a keyword
input's name (--input input_ids=1,256), the input's own dtype (8,16:float32; --dtype for the
others) and grad for an input that needs a gradient (8,16:float32:grad), whose gradient's
collectives the backward then shows. The table fits the terminal (--width N; --wide: every
parameter and slot, as wide as it takes), --json prints the report's to_dict(), --html FILE
writes the page (--baseline PLAN: beside another plan, loaded as PLAN is). A lint that warns
the numbers would be wrong makes the exit status 1 (notes of a cost do not). A plan that
cannot work prints its problems to standard error and exits with 1 (--traceback: the Python
traceback, down to the line that failed).

>>> main(["explain", "torch.nn:Identity", "tpfn:identity", "--world-size", "2", "--width", "80"])
tpfn.explain on 2 ranks: no inputs given, nothing ran
<BLANKLINE>
module             style       forward  backward
<root> (Identity)  identity()  -        -
<BLANKLINE>
collectives per step: forward none; backward none; total none
bytes per rank per step: forward 0 B; backward 0 B; total 0 B
parameter bytes per rank: 0 B
0
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import os
import re
import shutil
import sys
import textwrap

import sympy
import torch
import torch.nn as nn

from tpfn.dryrun import explain
from tpfn.analysis.check import check
from tpfn.analysis.inputs import ExampleInput
from tpfn.dryrun.table import MIN_WIDTH, prose
from tpfn.dryrun.verify import verify
from tpfn.errors import PlanError
from tpfn.training.pretrained import auto_plan

__all__ = ["main"]

_FILES: dict = {}  # a model or plan file loaded once: its absolute path -> the module
_WHERE = "rerun with --traceback to see where"


def _file(file: str, what: str, path: str, traceback: bool):
    """The module a Python file defines, run once (its folder importable, as ``python`` runs
    a script), under its own name where that name is free."""
    full = os.path.abspath(file)
    if full in _FILES:
        return _FILES[full]
    if not os.path.isfile(full):
        raise argparse.ArgumentTypeError(
            f"cannot load the {what} {path!r}: there is no file {file!r} (in {os.getcwd()})")
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(full))[0])
    name = stem if stem.isidentifier() and stem not in sys.modules else f"_tpfn_file_{stem}_{len(_FILES)}"
    spec = importlib.util.spec_from_file_location(name, full)
    module = importlib.util.module_from_spec(spec)
    if os.path.dirname(full) not in sys.path:
        sys.path.insert(0, os.path.dirname(full))
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[name]
        if traceback or not isinstance(e, Exception):
            raise
        raise argparse.ArgumentTypeError(
            f"cannot load the {what} {path!r}: {type(e).__name__}: {e} ({_WHERE})") from None
    _FILES[full] = module
    return module


def _load(path: str, what: str, traceback: bool = False):
    """The object at ``package.module:name``, ``package.module.name`` or ``file.py:name``,
    called if a factory."""
    module, sep, name = path.partition(":")
    is_file = module.endswith(".py") or "/" in module or os.sep in module
    if is_file and not name:
        raise argparse.ArgumentTypeError(
            f"cannot load the {what} {path!r}: name the object in the file, {module}:NAME")
    if not sep:
        module, _, name = path.rpartition(".")
    try:
        value = _file(module, what, path, traceback) if is_file else importlib.import_module(module)
        for part in name.split("."):
            value = getattr(value, part)
    except argparse.ArgumentTypeError:
        raise
    except Exception as e:
        if traceback:
            raise
        detail = e if isinstance(e, (ImportError, AttributeError, ValueError)) else \
            f"{type(e).__name__}: {e} ({_WHERE})"
        raise argparse.ArgumentTypeError(f"cannot load the {what} {path!r}: {detail}") from None
    if callable(value) and not isinstance(value, nn.Module):
        try:
            inspect.signature(value).bind()
        except TypeError as e:
            raise argparse.ArgumentTypeError(
                f"the {what} {path!r} is a function that needs arguments ({e}); point to one that "
                "takes none, or to the value itself") from None
        except ValueError:  # no signature to read (a builtin): call it and see
            pass
        try:
            value = value()
        except Exception as e:
            if traceback:
                raise
            raise argparse.ArgumentTypeError(
                f"calling the {what} {path!r} raised {type(e).__name__}: {e} ({_WHERE})") from None
    return value


def _transformers_model(path: str, weights: bool):
    """The model of a Hugging Face checkpoint folder or config file (None: ``path`` is neither):
    on meta without ``weights``; else the checkpoint's weights, or seeded random ones."""
    folder = os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))
    if not (folder or path.endswith(".json") and os.path.isfile(path)):
        return None
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from tpfn.training.pretrained import build, empty_weights

    if folder:
        config = AutoConfig.from_pretrained(path)
    else:
        with open(path) as f:
            found = json.load(f)
        if "model_type" not in found:
            raise argparse.ArgumentTypeError(f"the config {path!r} names no model_type")
        config = AutoConfig.for_model(**found)
    if weights and folder and any(name.endswith(".safetensors") or name.endswith(".bin")
                                  for name in os.listdir(path)):
        for auto in (AutoModelForCausalLM, AutoModel):
            try:
                return auto.from_pretrained(path).eval()
            except ValueError:
                continue
    if weights:
        torch.manual_seed(0)
        return build(config).eval()
    with empty_weights():
        return build(config).eval()


def _size(text: str):
    text = text.strip()
    if text.isdigit():
        return int(text)
    if text.isidentifier():
        return sympy.Symbol(text, positive=True, integer=True)
    raise argparse.ArgumentTypeError(f"{text!r} is neither a size nor a name")


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


def _input(text: str) -> tuple:
    """``(name or None, shape, dtype or None, grad)`` of ``[NAME=]SHAPE[:DTYPE][:grad]``."""
    name, sep, rest = text.partition("=")
    if not sep:
        name, rest = None, text
    elif not name.strip().isidentifier():
        raise argparse.ArgumentTypeError(
            f"{name.strip()!r} is not an input's name (NAME=SHAPE, e.g. input_ids=1,256)")
    else:
        name = name.strip()
    shape, *options = rest.split(":")
    dtype, grad = None, False
    for option in options:
        if option.strip() == "grad" and not grad:
            grad = True
        elif dtype is None and not grad:
            dtype = _dtype(option.strip())
        else:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not [NAME=]SHAPE[:DTYPE][:grad] (e.g. 8,16:float32:grad)")
    return name, tuple(_size(d) for d in shape.split(",") if d.strip()), dtype, grad


def _width(text: str):
    if not text.isdigit() or 0 < int(text) < MIN_WIDTH:
        raise argparse.ArgumentTypeError(f"--width takes a number of columns, at least {MIN_WIDTH}, "
                                         f"or 0 for no limit (got {text!r})")
    return int(text)


INPUTS = """\
inputs:
  --input SHAPE              a positional input: 8,1024, or b,s for a formula
  --input NAME=SHAPE         a keyword input: input_ids=1,256
  --input SHAPE:DTYPE        its own dtype: 8,16:int64, 8,16,64:bfloat16
  --input SHAPE:DTYPE:grad   an input that needs a gradient: 8,16,64:float32:grad
Repeat --input for more inputs. Positional and keyword inputs mix where the model's forward
names its positional parameters."""


def _model_plan_inputs(parser, shapes: str, world_size: dict, plan: bool = True) -> None:
    """The arguments the commands share: MODEL, PLAN (where ``plan``), --world-size (its
    ``add_argument`` options ``world_size``), --input (examples: ``shapes``), --dtype."""
    parser.add_argument("model", help="import path (package.module:name) or file (path/model.py:name) "
                        "of a module, or of a function returning one; or a Hugging Face checkpoint "
                        "folder or config (.json)")
    if plan:
        parser.add_argument("plan", nargs="?", help="import path or file of a plan (dict, plan(), style) "
                            "or a function returning one (default: the model's own plan, else "
                            "tpfn.suggest's)")
    parser.add_argument("--world-size", **world_size)
    parser.add_argument("--input", action="append", type=_input, default=[],
                        metavar="[NAME=]SHAPE[:DTYPE][:grad]", help=f"an input: {shapes}; "
                        "input_ids=1,256; 8,16,64:float32:grad (repeat for more inputs)")
    parser.add_argument("--dtype", type=_dtype, default=torch.int64,
                        help="dtype of the inputs that give none (int64)")


def _parser() -> argparse.ArgumentParser:
    from tpfn import __version__

    parser = argparse.ArgumentParser(
        prog="tpfn", description="Tensor parallelism for PyTorch as a small functional language.")
    parser.add_argument("--version", action="version", version=f"tpfn {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    form = argparse.RawDescriptionHelpFormatter
    p = commands.add_parser("explain", help="dry-run a plan on fake ranks and print what it does",
                            description=textwrap.fill(__doc__.split("\n\n")[1].replace("``", ""), 79),
                            epilog=INPUTS, formatter_class=form)
    _model_plan_inputs(p, "8,1024 or b,s", dict(required=True, type=_size,
                                                help="ranks, or a name for a formula"))
    p.add_argument("--size", action="append", type=_stand_in, default=[], metavar="NAME=VALUE",
                   help="stand-in value of a named size")
    p.add_argument("--wide", action="store_true", help="also a line per parameter and per input and "
                   "output slot, as wide as it takes (unless --width)")
    p.add_argument("--width", type=_width, metavar="N",
                   help=f"columns of the table (the terminal's; at least {MIN_WIDTH}; 0: no limit)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--html", metavar="FILE", help="write the report as a self-contained HTML page")
    p.add_argument("--baseline", metavar="PLAN", help="with --html: set the plan beside this one (given "
                   "as PLAN is; builtins:dict, an empty plan: no tensor parallelism)")
    v = commands.add_parser("verify", help="run a plan on N real ranks and compare every number with "
                            "one device", description=textwrap.fill(
                                "Run the plan on N gloo ranks (forked processes) and compare each module's "
                                "output and every gradient with one device. Exit status 0 when they agree, "
                                "1 when not.", 79),
                            epilog=INPUTS.replace(", or b,s for a formula", ""), formatter_class=form)
    _model_plan_inputs(v, "8,1024", dict(type=int, default=2, help="ranks (2)"))
    v.add_argument("--tolerance", type=float, default=1e-4, help="largest relative error (1e-4)")
    v.add_argument("--seed", type=int, default=0, help="seed of the random inputs (0)")
    v.add_argument("--width", type=_width, metavar="N",
                   help=f"columns of the report (the terminal's; at least {MIN_WIDTH}; 0: no limit)")
    g = commands.add_parser("suggest", help="print the plan tpfn.suggest derives for a model",
                            description=textwrap.fill(
                                "Derive a tensor-parallel plan for MODEL from its structure and one dry run "
                                "on fake ranks (tpfn.suggest), and print it as the code that builds it, each "
                                "rule with a comment that says why.", 79),
                            epilog=INPUTS.replace(", or b,s for a formula", ""), formatter_class=form)
    _model_plan_inputs(g, "8,1024 (a transformers model's default: one sequence of token ids)",
                       dict(type=int, default=2, help="ranks (2)"), plan=False)
    g.add_argument("--loss-parallel", action="store_true", help="leave the head's logits sharded, for "
                   "tpfn.cross_entropy")
    c = commands.add_parser("check", help="prove on fake ranks that a plan computes one device's numbers",
                            description=textwrap.fill(
                                "Prove on N fake ranks, op by op, forward and backward, that the plan "
                                "makes the model compute one device's numbers (tpfn.check): each finding "
                                "names the module, the op and the line of the model's source. Exit status "
                                "0 when every op is proven, 1 on a finding.", 79),
                            epilog=INPUTS.replace(", or b,s for a formula", ""), formatter_class=form)
    _model_plan_inputs(c, "8,1024 (a transformers model's default: one sequence of token ids)",
                       dict(type=int, default=2, help="ranks (2)"))
    c.add_argument("--width", type=_width, metavar="N",
                   help=f"columns of the report (the terminal's; at least {MIN_WIDTH}; 0: no limit)")
    c.add_argument("--json", action="store_true", help="print the outcome and every finding as JSON")
    for command in (p, v, g, c):
        command.add_argument("--traceback", action="store_true",
                             help="on an error, the Python traceback down to the line that failed")
        command.set_defaults(command_parser=command)
    return parser


def _arrange(usage, model: nn.Module, values: list):
    """The inputs as explain and verify take them: a tuple of positional ones, a dict of keyword
    ones, or, mixed, a dict with the positional ones named by the model's forward."""
    positional = [v for n, v in values if n is None]
    keyword: dict = {}
    for n, v in values:
        if n is not None and keyword.setdefault(n, v) is not v:
            usage(f"--input {n}= is given twice")
    if not keyword:
        return tuple(positional) or None
    if not positional:
        return keyword
    forward = type(model).forward
    try:
        signature = inspect.signature(model.forward)
        bound = signature.bind_partial(*positional, **keyword)
    except (TypeError, ValueError) as e:
        usage(f"the positional and keyword inputs do not fit {type(model).__name__}.forward{_sig(forward)} "
              f"({e}); name every input (--input NAME=SHAPE) or none")
    kinds = {n: signature.parameters[n].kind for n in bound.arguments}
    unnamed = [n for n, k in kinds.items() if k in (inspect.Parameter.VAR_POSITIONAL,
                                                   inspect.Parameter.POSITIONAL_ONLY)]
    if unnamed:
        usage(f"{type(model).__name__}.forward{_sig(forward)} gives its positional inputs no names "
              f"({', '.join(unnamed)}), and explain takes positional inputs (a tuple) or keyword "
              "inputs (a dict), not both: name every input (--input NAME=SHAPE) or none")
    out: dict = {}
    for n, v in bound.arguments.items():
        out.update(v if kinds[n] is inspect.Parameter.VAR_KEYWORD else {n: v})
    return out


def _sig(fn) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def _inputs(args) -> list:
    """``(name, value)`` for explain: a shape, or an input with its own dtype or gradient."""
    out = []
    for name, shape, dtype, grad in args.input:
        dtype = dtype or args.dtype
        if grad and not (dtype.is_floating_point or dtype.is_complex):
            args.command_parser.error(
                f"--input {'' if name is None else name + '='}{','.join(map(str, shape))}:grad "
                f"needs a floating dtype, not {str(dtype).removeprefix('torch.')}: give one, "
                f"e.g. {','.join(map(str, shape))}:float32:grad")
        out.append((name, ExampleInput(shape, dtype, grad) if grad or dtype is not args.dtype else shape))
    return out


def _tensors(args, model) -> list:
    """``(name, tensor)`` for verify: random values from the seed, as ``verify`` makes them
    (token ids below the smallest embedding's vocabulary for integer dtypes)."""
    gen = torch.Generator().manual_seed(args.seed)
    vocab = min((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), default=2)
    out = []
    for name, x in _inputs(args):
        shape, dtype, grad = (x.shape, x.dtype, x.requires_grad) if isinstance(x, ExampleInput) else (
            x, args.dtype, False)
        t = (torch.randn(shape, generator=gen).to(dtype) if dtype.is_floating_point
             else torch.randint(0, vocab, shape, generator=gen, dtype=dtype))
        out.append((name, t.requires_grad_(grad)))
    return out


def _verify(args, model, plan) -> int:
    usage = args.command_parser.error
    if not args.input:
        usage("verify needs the example inputs' shapes: --input 2,128 (repeat for more)")
    if any(not isinstance(d, int) for _, shape, _, _ in args.input for d in shape):
        usage("verify runs real ranks: give --input sizes as numbers, not names")
    inputs = _arrange(usage, model, _tensors(args, model))
    try:
        report = verify(model, plan, inputs, world_size=args.world_size,
                        dtype=args.dtype, tolerance=args.tolerance, seed=args.seed)
    except (PlanError, ValueError, TypeError) as e:
        return _failed(args, "tpfn verify: ", e)
    print(report.text(_columns(args)))
    return 0 if report.ok else 1


def _columns(args) -> int | None:
    """The width to print at: --width (0: no limit), else the terminal's (--wide: no limit)."""
    if getattr(args, "width", None) is not None:
        return args.width or None
    return None if getattr(args, "wide", False) else max(MIN_WIDTH, shutil.get_terminal_size().columns)


def _failed(args, prefix: str, error: Exception) -> int:
    """Exit status 1, ``error`` printed on standard error after ``prefix``, its list of problems
    (a ``PlanError``'s) wrapped to the width; with --traceback, ``error`` raised."""
    if args.traceback:
        raise error
    width = _columns(args)
    head, *rest = str(error).split("\n")
    problems = getattr(error, "problems", None)
    lines = prose(prefix + head, width)
    if problems is not None and len(rest) == len(problems):
        lines += [line for p in problems for line in prose(p, width, "  - ", "    ")]
    else:
        lines += rest
    print("\n".join(lines), file=sys.stderr)
    return 1


def _check(args, model, plan) -> int:
    if any(not isinstance(d, int) for _, shape, _, _ in args.input for d in shape):
        args.command_parser.error("check runs the model on its inputs: give --input sizes as numbers, not names")
    inputs = _arrange(args.command_parser.error, model, _inputs(args))
    try:
        found = check(model, plan, args.world_size, example_inputs=inputs)
    except (PlanError, ValueError, TypeError, RuntimeError) as e:
        return _failed(args, "tpfn check: ", e)
    print(found.to_json() if args.json else found.text(_columns(args)))
    return 0 if found.ok else 1


def _suggest(args, model) -> int:
    import tpfn

    inputs = _arrange(args.command_parser.error, model, _inputs(args))
    try:
        found = tpfn.suggest(model, args.world_size, example_inputs=inputs, loss_parallel=args.loss_parallel)
    except (PlanError, ValueError, TypeError, RuntimeError) as e:
        return _failed(args, "tpfn suggest: ", e)
    print(found)
    return 0


def main(argv=None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); the exit status.

    >>> main(["explain", "torch.nn:Identity", "tpfn:identity", "--world-size", "2", "--json"]) == 0
    {
      "world_size": 2,
    ...
    True
    """
    args = _parser().parse_args(argv)
    usage = args.command_parser.error  # the subcommand's own usage, not the top level's
    if os.getcwd() not in sys.path and "" not in sys.path:  # the `tpfn` script: as `python -m`
        sys.path.insert(0, os.getcwd())
    if getattr(args, "baseline", None) is not None and not args.html:
        usage("--baseline sets two plans side by side in the HTML page: give --html FILE too")
    try:
        model = _transformers_model(args.model, args.command == "verify")
        model = _load(args.model, "model", args.traceback) if model is None else model
        plan = None if getattr(args, "plan", None) is None else _load(args.plan, "plan", args.traceback)
        baseline = None if getattr(args, "baseline", None) is None else _load(
            args.baseline, "baseline plan", args.traceback)
    except argparse.ArgumentTypeError as e:
        usage(str(e))
    if not isinstance(model, nn.Module):
        usage(f"the model {args.model!r} is a {type(model).__name__}, not an nn.Module")
    if args.command == "suggest":
        return _suggest(args, model)
    inputs = _arrange(usage, model, _inputs(args)) if plan is None or args.command != "verify" else None
    if plan is None:
        try:
            plan = auto_plan(model, args.world_size, inputs)
        except (PlanError, ValueError, TypeError, RuntimeError) as e:
            return _failed(args, f"tpfn {args.command}: ", e)
    if args.command == "verify":
        return _verify(args, model, plan)
    if args.command == "check":
        return _check(args, model, plan)
    reports = []
    for which, value in (("", plan), ("the baseline plan: ", baseline)):
        if value is None and which:
            continue
        try:
            reports.append(explain(model, value, world_size=args.world_size, example_inputs=inputs,
                                   dtype=args.dtype, sizes=dict(args.size)))
        except (PlanError, ValueError, TypeError) as e:
            return _failed(args, f"tpfn explain: {which}", e)
    report = reports[0]
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.text(_columns(args), wide=args.wide))
    if args.html:
        page = report.to_html() if baseline is None else report.to_html(
            reports[1], name=args.plan, baseline_name=args.baseline)
        with open(args.html, "w", encoding="utf-8") as f:
            f.write(page)
    return 1 if report.warnings else 0
