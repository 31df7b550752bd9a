"""Where in a model something happened: the module a failure is in, and the line of the
model's source that ran an op.

``failing_module(exc, model)`` is the innermost module of ``model`` in a traceback.
``caller()`` classifies the code that issued the op being dispatched now: the model's own
(``("model", "path:line")``, the innermost frame outside torch, tpfn and Python's library),
tpfn's (its runtime moving a slot, or a tpfn function the model calls: ``("tpfn", ...)``), or
none (autograd's engine running a backward: ``(None, "")``). ``rank_reads()`` records where the
model's code asks for its rank (or whether it runs distributed at all).

>>> import torch
>>> linear = nn.Sequential(nn.Linear(2, 2))
>>> try:
...     linear(torch.ones(3))
... except RuntimeError as e:
...     failing_module(e, linear)
'0'
>>> caller(0)[0]  # this docstring's code: the model's, as far as the check can tell
'model'
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
import os
import sys
import sysconfig

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["failing_module", "caller", "source", "kind", "innermost", "rank_reads", "asks_rank"]

_TORCH = os.path.dirname(torch.__file__) + os.sep
_TPFN = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LIBRARY = tuple(os.path.realpath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib"))
_PACKAGES = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)  # installed: models' code
_HYBRID = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hybrid.py")  # runs ops for their caller
_KINDS: dict = {}  # a code file -> "skip" (torch, Python's library), "tpfn" or "model"


def kind(filename: str) -> str:
    """``"skip"`` (torch, Python's library, the dry runs' modes that run an op for its caller),
    ``"tpfn"`` or ``"model"``: whose code a file is."""
    found = _KINDS.get(filename)
    if found is None:
        real = os.path.realpath(filename) if os.path.isabs(filename) else filename
        library = real.startswith(_LIBRARY) and not any(d in real for d in _PACKAGES)
        found = ("skip" if real.startswith(_TORCH) or filename.startswith(_TORCH) or library
                 or filename.startswith("<frozen") or real == _HYBRID else
                 "tpfn" if real.startswith(_TPFN) else "model")
        _KINDS[filename] = found
    return found


def source(filename: str, line: int) -> str:
    """``'transformers/models/llama/modeling_llama.py:123'``: a source line as findings name it
    (a path inside site-packages from the package, one under the working directory from there,
    else as the code object names it)."""
    here = os.getcwd() + os.sep
    path = filename[len(here):] if filename.startswith(here) else filename.rpartition("site-packages" + os.sep)[2]
    return f"{path}:{line}"


def caller(depth: int = 1) -> tuple:
    """``(kind, line)`` of the code that issued the op being dispatched (see the module
    docstring), from the frame ``depth`` levels above this call's caller. A torch module's own
    ``forward`` that tpfn's runtime calls (a module bound by a style of primitives) is the
    model's code, as where one device calls it."""
    frame, module = sys._getframe(depth + 1), None
    while frame is not None:
        code = frame.f_code
        whose = kind(code.co_filename)
        if whose != "skip":
            if whose == "tpfn" and module is not None:
                return "model", module
            return whose, source(code.co_filename, frame.f_lineno)
        if code.co_name == "forward" and module is None and isinstance(frame.f_locals.get("self"), nn.Module):
            module = source(code.co_filename, frame.f_lineno)
        frame = frame.f_back
    return None, ""


def failing_module(exc: BaseException, module: nn.Module) -> str | None:
    """The FQN of the innermost module of ``module`` in ``exc``'s traceback (None: none)."""
    names, fqn = {id(m): fqn for fqn, m in module.named_modules()}, None
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            fqn = names[id(owner)]
        tb = tb.tb_next
    return fqn


def innermost(exc: BaseException, code: bool = False) -> str:
    """The model's source line innermost in ``exc``'s traceback (``''``: none); ``code``: with
    the line's code (``path:12, `k = k.view(B, T, H, C // H)```)."""
    tb, found = exc.__traceback__, ""
    while tb is not None:
        where = tb.tb_frame.f_code.co_filename
        if kind(where) == "model":
            found = source(where, tb.tb_lineno)
            text = linecache.getline(where, tb.tb_lineno).strip() if code else ""
            found += f", `{text}`" if text else ""
        tb = tb.tb_next
    return found


# What the model's code may ask to learn which rank it runs on, or whether it runs on ranks.
_RANK = {inspect.unwrap(f).__code__: name for f, name in (
    (dist.get_rank, "torch.distributed.get_rank()"), (dist.get_group_rank, "torch.distributed.get_group_rank()"),
    (dist.is_initialized, "torch.distributed.is_initialized()"),
    (DeviceMesh.get_local_rank, "DeviceMesh.get_local_rank()"),
    (DeviceMesh.get_coordinate, "DeviceMesh.get_coordinate()"), (DeviceMesh.get_rank, "DeviceMesh.get_rank()"))}


_ASKS = {code.co_name for code in _RANK}


def asks_rank(model: nn.Module) -> bool:
    """Whether the code beside ``model``'s modules' forwards (the functions and classes defined
    in the file and namespace each forward was) names a function of ``rank_reads``'s: whether a
    run should watch for the rank's reads (a profiler slows every call, so only then)."""
    spaces = {}
    for kind_ in {type(m) for m in model.modules()}:
        f = inspect.unwrap(kind_.forward)
        code = getattr(f, "__code__", None)
        if code is not None and kind(code.co_filename) == "model":
            spaces[id(f.__globals__), code.co_filename] = f.__globals__
    return any(_ASKS & names for (_, file), space in spaces.items() for names in _names(space, file))


def _names(space: dict, file: str) -> list:
    """The names each code object of ``file`` in a namespace (its functions, its classes'
    methods, nested ones) uses."""
    found, codes = [], []
    for value in list(space.values()):
        for f in (vars(value).values() if isinstance(value, type) else (value,)):
            code = getattr(getattr(f, "__func__", f), "__code__", None)
            if code is not None and code.co_filename == file:
                codes.append(code)
    while codes:
        code = codes.pop()
        found.append(set(code.co_names))
        codes.extend(c for c in code.co_consts if hasattr(c, "co_names"))
    return found


@contextlib.contextmanager
def rank_reads(seen):
    """While entered, ``seen(what, line, module)`` where the model's code (on this thread)
    calls a function that tells its rank, or whether it runs on ranks (``module``: the
    ``self`` of the calling frame, or None)."""
    before = sys.getprofile()

    def profile(frame, event, arg):
        if before is not None:
            before(frame, event, arg)
        if event == "call" and frame.f_code in _RANK and frame.f_back is not None:
            back = frame.f_back.f_code
            if kind(back.co_filename) == "model":
                seen(_RANK[frame.f_code], source(back.co_filename, frame.f_back.f_lineno),
                     frame.f_back.f_locals.get("self"))

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(before)
