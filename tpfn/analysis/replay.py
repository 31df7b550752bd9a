"""The plan on fake ranks, forward and backward: does each rank compute its share?

``replay(model, plan, n, args, kwargs, flow)`` parallelizes a ``hybrid_copy`` of ``model``
over ``n`` fake ranks and runs one forward and backward seen from rank 0 (under
``observe(model)``, a context that records what its caller wants: suggest's, the
collectives). In the forward, every op on sharded features must be the op the traced
forward (``flow``) ran there, giving each output its local share: the whole of every dim
the plan does not shard, ``1/n`` of each sharded space (one head of a space with fewer heads
than ranks). An attention that views its local features by a global head count
(``view(b, -1, self.num_heads, d)``) fails here, though no shape error need follow: it
would be wrong silently.

Returns ``(failed, comms, skipped)``: ``failed`` maps a module to why, for a group that does
not compute its share one of the modules making its features, for a run that fails the
innermost module the plan binds around the failure (and the model's line that failed, with
its code: a view by a width read from ``x.size()``, which no attribute held per rank fixes); ``comms``, what ``observe`` gave;
``skipped``, why the backward did not run, or None. (A tensor the forward computed from its
inputs, real, that took a value of the weights in place (``tpfn.analysis.hybrid``) hands
autograd a gradient on another device: the dry run then checks the forward alone.)
"""

from __future__ import annotations

import contextlib
import math
import re
import warnings

import attrs
import torch
import torch.nn as nn

from tpfn._fqn import generalize, within
from tpfn._torch import TorchDispatchMode
from tpfn.analysis.factors import local_shape, spaces as held_spaces
from tpfn.analysis.fake import new_fake_mesh, release
from tpfn.analysis.hybrid import Hybrid, hybrid_copy
from tpfn.analysis.inputs import floats
from tpfn.analysis.rules import step, tensors
from tpfn.analysis.trace import kind_of
from tpfn.analysis.where import failing_module, innermost
from tpfn.errors import ModuleError, PlanError
from tpfn.interpret.parallelize import mounted, parallelize
from tpfn.plans.plan import resolve

__all__ = ["replay", "Failure", "named_in"]

LOOKAHEAD = 8  # traced ops a rank's code may skip as identities at its sizes
SKIPPABLE = {"view", "aten.expand.default", "aten.unsqueeze.default", "aten.squeeze.dim",
             "aten.squeeze.dims", "aten.slice.Tensor", "aten.alias.default"}


def ins_numel(args, kwargs, replay) -> int:
    """The elements of the first input of an op that holds sharded features."""
    held = [t for t in tensors(args) + tensors(list(kwargs.values())) if replay.dims(t)]
    return held[0].numel() if held else -1


@attrs.frozen
class Failure:
    """Why a module's group (or the module) does not compute its share, and the module whose
    forward went wrong."""

    why: str
    where: str
    line: str = ""  # the model's line where the rank's run failed, with its code


class _Replay(TorchDispatchMode):
    """The forward on rank 0, op by op against the traced one."""

    def __init__(self, flow, n: int):
        super().__init__()
        self.flow, self.n = flow, n
        self.held: dict = {}
        self.ops, self.next = flow.ops, 0
        self.calls: dict = {}
        for call in flow.calls:
            self.calls.setdefault(call.fqn, []).append(call)
        self.stack: list = []
        self.inside = 0
        self.failed: dict = {}
        self.done = False

    def dims(self, t):
        found = self.held.get(id(t))
        return found[1] if found is not None and found[0] is t else None

    def expected(self, dims) -> tuple:
        return local_shape(dims, self.n, self.flow.spaces.units)

    def fail(self, dims_list, why: str, where: str) -> None:
        spaces = self.flow.spaces
        for dims in dims_list:
            for s in held_spaces(dims):
                self.failed.setdefault(spaces.spaces[spaces.find(s)].producer, Failure(why, where))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.inside or self.done:
            return out
        ins = [d for d in map(self.dims, tensors(args) + tensors(list(kwargs.values()))) if d]
        if not ins:
            return out
        where = self.stack[-1] if self.stack else ""
        if step(func) is None:  # a copy for its layout: the dims of its input
            for t in tensors(out):
                self.held[id(t)] = (t, ins[0])
            return out
        seen = self._resync(step(func), where, ins_numel(args, kwargs, self))
        if seen is None:
            seen = self.ops[self.next] if self.next < len(self.ops) else None
            self.fail(ins, f"on a rank's shard {generalize(where) or '<root>'!r} runs {func} where the "
                      f"whole model runs {seen.op if seen else 'nothing'}: its code takes another path", where)
            self.done = True
            return out
        for t, (shape, dims) in zip(tensors(out), seen.outputs):
            want = self.expected(dims)
            if tuple(t.shape) != want:
                self.fail(ins + [dims], f"on a rank's shard {generalize(where) or '<root>'!r} computes "
                          f"{func} of shape {tuple(t.shape)} where its share of {shape} is {want}", where)
            self.held[id(t)] = (t, dims)
        return out

    def _resync(self, op: str, where: str, numel: int):
        """The traced op the rank's ``op`` is, where the rank's code skips views and expands
        that are identities at its share's sizes (a repeat of KV heads by one); None if none."""
        for k in range(self.next, min(self.next + LOOKAHEAD, len(self.ops))):
            found = self.ops[k]
            if found.op == op and found.where == where:
                skipped = self.ops[self.next:k]
                if all(e.where == where and e.op in SKIPPABLE and all(
                        math.prod(self.expected(d)) == numel for _, d in e.outputs) for e in skipped):
                    self.next = k + 1
                    return found
                return None
        return None

    def pre(self, fqn: str, module: nn.Module):
        self.stack.append(fqn)
        if kind_of(module) is not None:
            self.inside += 1

    def post(self, fqn: str, module: nn.Module, args, kwargs, out):
        self.stack.pop()
        if kind_of(module) is None:
            return
        self.inside -= 1
        if self.inside or self.done or not isinstance(out, torch.Tensor) or not self.calls.get(fqn):
            return
        call = self.calls[fqn].pop(0)
        x = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
        dims = self.dims(x) if isinstance(x, torch.Tensor) else None
        if call.role == "exit" and dims is not None and tuple(x.shape) != self.expected(dims):
            self.fail([dims], f"{generalize(fqn)!r} is handed {tuple(x.shape)} where its share "
                      f"of {call.in_shape} is {self.expected(dims)}", self.stack[-1] if self.stack else "")
        if call.role in ("entry", "channels"):  # (a module on channels hands them on)
            want = self.expected(call.out_dims)
            if tuple(out.shape) != want:
                self.fail([call.out_dims], f"{generalize(fqn)!r} makes {tuple(out.shape)} where its "
                          f"share of {call.out_shape} is {want}", fqn)
            self.held[id(out)] = (out, call.out_dims)


def named_in(problems: list, bound: list) -> dict:
    """``{fqn: Failure}`` of the bound modules the problems of a refused plan name: the module a
    problem is about (``'fqn' (Kind) ...``), else each bound module it quotes, whole or as a
    child of a module it quotes (``'qkv' of 'blocks.0.attn' (Attention)``)."""
    out: dict = {}
    for problem in problems:
        first = re.match(r"'([^']*)' \(", problem)
        quoted = set(re.findall(r"'([^']*)'", problem))
        for fqn in [first.group(1)] if first else [
                f for f in bound if f in quoted or f.rpartition(".")[2] in quoted and f.rpartition(".")[0] in quoted]:
            out.setdefault(fqn, Failure(problem, fqn))
    return out


def replay(model: nn.Module, plan, n: int, args: tuple, kwargs: dict, flow, backward: bool = True,
           observe=None) -> tuple:
    """``({fqn: why}, observed, skipped)`` of ``plan`` over ``n`` fake ranks against ``flow``
    (see the module docstring); ``failed`` is empty where every rank computes its share."""
    copy, mesh = hybrid_copy(model), new_fake_mesh(n)
    mode = _Replay(flow, n)
    comms: list = []
    skipped = None
    try:
        try:
            with warnings.catch_warnings():  # an empty plan: the whole model, on purpose
                warnings.filterwarnings("ignore", "the plan binds no module", UserWarning)
                parallelize(copy, mesh, plan, src_rank=None)
        except PlanError as e:  # a whole-model refusal (tpfn.plans.refusals): the modules it names
            named = named_in(e.problems, [m.fqn for m in resolve(plan, copy)])
            if not named:
                raise
            return named, [], None
        bound = {fqn for fqn, m in copy.named_modules() if mounted(m) is not None}
        for fqn, module in copy.named_modules():
            module.register_forward_pre_hook(lambda m, a, fqn=fqn: mode.pre(fqn, m))
            module.register_forward_hook(lambda m, a, k, o, fqn=fqn: mode.post(fqn, m, a, k, o),
                                         with_kwargs=True, always_call=True)
        try:
            hybrid = Hybrid()
            with (contextlib.nullcontext() if observe is None else observe(copy)) as comms, hybrid, mode:
                out = copy(*args, **kwargs)
                mode.done, hybrid.values = True, False
                grads = [t.sum() for t in floats(out)] if backward else []
                try:
                    if grads:
                        torch.autograd.backward(grads)
                except RuntimeError as e:
                    if "expected device" not in str(e):
                        raise
                    skipped = ("the dry run ran the forward only: a tensor the forward computed "
                               "from its inputs took a value of its weights in place")
        except Exception as e:  # noqa: BLE001 - a run that fails: the module it fails in
            failed = failing_module(e, copy) or ""
            around = [f for f in bound if within(failed, f)]
            inside = [f for f in bound if f.startswith(failed + ".") or not failed]
            phase = "backward" if mode.done else "forward"
            line = "" if isinstance(e, ModuleError) else innermost(e, code=True)  # (tpfn's names its module)
            why = (f"on a rank's shard the {phase} of {generalize(failed) or '<root>'!r} fails"
                   f"{f' at {line}' if line else ''}: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
            for fqn in [max(around, key=len)] if around else inside or [failed]:
                mode.failed.setdefault(fqn, Failure(why, failed, line))
    finally:
        release(mesh)
    return mode.failed, list(comms or ()), skipped
