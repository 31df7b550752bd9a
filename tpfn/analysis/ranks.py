"""The plan on fake ranks, op by op against the typed forward of one device.

``on_ranks(model, plan, n, args, kwargs, trace)`` parallelizes a ``hybrid_copy`` of ``model``
over ``n`` fake ranks (``tpfn.analysis.fake``) and runs one forward and backward as rank 0
runs it. Each op of the model's own code (outside the modules the runtime computes by a
built-in row, and outside tpfn's own moves) must be the op one device ran there
(``tpfn.analysis.typed.Trace``), in the same order, with the same arguments, and must give
each output its share of one device's: the whole of every dim the plan does not shard, ``1/n``
of each sharded one. Where it is not, a ``Finding`` says how:

- an output of another shape: a view of a shard by a count that is the global one (an
  attribute, a config, or ``-1`` beside one) makes heads of the wrong size, silently;
- an argument that differs (a scale ``x.shape[-1] ** -0.5``, positions ``arange(x.shape[1])``):
  a value read from a local shape, where one device reads the whole one;
- another op: the rank's code takes another path (a branch on a local shape or the rank);
- a forward or backward that fails on the rank's shards.

Views and copies that are identities at the rank's sizes (a repeat of KV heads by one) may be
skipped by the rank's code.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from tpfn._fqn import describe, within
from tpfn._torch import TorchDispatchMode
from tpfn.analysis.fake import new_fake_mesh, release
from tpfn.analysis.findings import Finding
from tpfn.analysis.hybrid import Hybrid, hybrid_copy
from tpfn.analysis.inputs import floats
from tpfn.analysis.rules import step, tensors
from tpfn.analysis.typed import arguments, expected
from tpfn.analysis.where import caller, failing_module, innermost
from tpfn.interpret.parallelize import mounted, parallelize
from tpfn.layout import Partial, Shard

__all__ = ["on_ranks", "watch", "failed", "rank_inputs"]

LOOKAHEAD = 8  # ops of one device's a rank's code may skip as identities at its sizes
SKIPPABLE = {"view", "aten.expand.default", "aten.unsqueeze.default", "aten.squeeze.dim",
             "aten.squeeze.dims", "aten.slice.Tensor", "aten.alias.default", "aten.repeat.default"}
# Ops whose size arguments a shard changes with its shape (the output's shape is then compared).
SIZES = {"view", "aten.expand.default", "aten.repeat.default", "aten.new_zeros.default",
         "aten.new_ones.default", "aten.new_empty.default", "aten.new_full.default", "aten.zeros.default",
         "aten.ones.default", "aten.empty.memory_format", "aten.full.default", "aten.split.Tensor",
         "aten.split_with_sizes.default", "aten.unflatten.int", "aten.empty_strided.default",
         "aten.new_empty_strided.default", "aten.expand_as.default", "aten.zeros_like.default"}
_SIZE_ARGS = {"size", "sizes", "split_size", "split_sizes", "shape", "stride"}


# (op, argument) that a shard of channels takes as its share of one device's: a depthwise or grouped
# convolution on each rank's channels has 1/n of the groups (its output's shape is then compared).
_SHARES = {("aten.convolution.default", "groups")}


def _share(op: str, name: str, got, want, n: int) -> bool:
    """Whether the rank's argument ``name`` of ``op`` is its share of one device's ``want``."""
    return (op, name) in _SHARES and type(got) is int and type(want) is int and want == got * n


class _Ranks(TorchDispatchMode):
    """The forward on rank 0, op by op against one device's (see the module docstring)."""

    def __init__(self, trace, modules: dict, n: int):
        super().__init__()
        self.trace, self.n, self.modules = trace, n, modules
        self.ops, self.next = trace.ops, 0
        self.stack: list = []
        self.calls: list = []  # per module call: whether it counts in inside
        self.inside = 0        # depth inside modules the runtime computes by a built-in row
        self.findings: list = []
        self.off: dict = {}    # id -> a tensor computed from one found wrong: not compared again
        self.done = False

    @property
    def where(self) -> str:
        return self.stack[-1] if self.stack else ""

    def find(self, func, seen, why: str) -> None:
        self.findings.append(Finding(self.where, str(func), seen.line, why))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except RuntimeError:
            if not self.inside and not self.done and step(func) == "view" and caller()[0] == "model":
                self._failed_view(func, args)
            raise
        if self.inside or self.done:
            return out
        ins, outs = tensors(args) + tensors(list(kwargs.values())), tensors(out)
        if any(self._off(t) for t in ins):  # computed from a value found wrong before: not compared
            self.off.update((id(t), t) for t in outs)
        name = step(func)
        if name is None or caller()[0] != "model":
            return out
        seen = self._resync(name, self.where)
        if seen is None:
            now = self.ops[self.next] if self.next < len(self.ops) else None
            there = f"{now.op} ({now.line})" if now is not None else "nothing more"
            self.findings.append(Finding(self.where, str(func), caller()[1], (
                f"on a rank's shards {self.where or '<root>'!r} runs {func} where one device runs "
                f"{there}: its code takes another path on a rank (a branch on a local shape, or on the "
                "rank), so what follows is not one device's computation")))
            self.done = True
            return out
        given = arguments(func, args, kwargs)
        if not any(self._off(t) for t in outs) and not self._compare(func, seen, given, outs, args):
            self.off.update((id(t), t) for t in outs)
        return out

    def rest(self) -> None:
        """A finding where the forward ended before one device's ops did (a rank's code that
        skipped some)."""
        left = [op for op in self.ops[self.next:] if op.op not in SKIPPABLE]
        if left and not self.done:
            op = left[0]
            self.findings.append(Finding(op.where, op.op, op.line, (
                f"one device runs {op.op} here, and a rank's code does not: it takes another path on "
                "a rank (a branch on a local shape, or on the rank), so what follows is not one device's "
                "computation")))

    def _failed_view(self, func, args) -> None:
        """A view the rank cannot make (a count that is the global one, no -1 beside it)."""
        seen = self._resync("view", self.where)
        if seen is None or not seen.outputs:
            return
        shape, value, _ = seen.outputs[0]
        want = expected(value, shape, self.trace.spaces, self.n)
        sizes = tuple(args[1]) if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
        if want is None or len(sizes) != len(want):
            return
        self._view(func, seen, sizes, shape, tuple(w if w is not None else g for g, w in zip(sizes, want)), args,
                   " (and cannot: the rank's features do not fill it)")

    def _view(self, func, seen, got, shape, want, given, fails: str = "") -> None:
        named = self._counts(got, want, given)
        by = f" by {named}" if named else " by a count"
        hold = f"per_rank({named.split(' = ')[0].removeprefix('self.')!r})" if named and "config" not in named \
            else "per_rank('<its attribute>')"
        self.find(func, seen, (
            f"views its shard as {got}{by} that is the global one{fails}, where its share of one device's "
            f"{shape} is {want}: the rank's features are cut into the wrong pieces (heads of the wrong "
            f"size), silently; hold the count per rank with {hold} in the module's style, view with -1 "
            "for the count and the head size given, or hand the module DTensors (colwise(local=False))"))

    def _off(self, t) -> bool:
        found = self.off.get(id(t))
        return found is not None and found is t

    def _resync(self, name: str, where: str):
        """One device's op that the rank's ``name`` is: the next, or one a few ops on where the
        rank's code skips views that are identities at its sizes (None: none)."""
        for k in range(self.next, min(self.next + LOOKAHEAD, len(self.ops))):
            found = self.ops[k]
            if found.op == name and found.where == where:
                skipped = self.ops[self.next:k]
                if all(e.where == where and e.op in SKIPPABLE for e in skipped):
                    self.next = k + 1
                    return found
                return None
        return None

    def _compare(self, func, seen, args: tuple, outs: list, given: tuple) -> bool:
        """A finding where the rank's op gives another shape than its share, or takes other
        arguments than one device's op; whether it gives its share."""
        shapes = []
        for t, (shape, value, uniform) in zip(outs, seen.outputs):
            want = expected(value, shape, self.trace.spaces, self.n)
            if want is None or uniform:
                continue
            got = tuple(t.shape)  # a DTensor's is global, as want is for one
            if isinstance(t, DTensor) != value.dtensor and not uniform:
                continue  # laid out otherwise than the trace follows: its shape says nothing
            if len(got) != len(want) or any(w is not None and g != w for g, w in zip(got, want)):
                shapes.append((got, shape, tuple(g if w is None else w for g, w in zip(got, want))))
        differ = [(k, v, w) for (k, v), (_, w) in zip(args, seen.args) if v != w and not (
            isinstance(v, float) and isinstance(w, float) and abs(v - w) <= 1e-12 * max(1.0, abs(w)))
            and not _share(seen.op, k, v, w, self.n)]
        sizes_only = seen.op in SIZES and all(k in _SIZE_ARGS for k, _, _ in differ)
        if differ and not sizes_only:
            k, v, w = differ[0]
            self.find(func, seen, (
                f"takes {k}={v!r} on a rank where one device takes {w!r}: a value read from a "
                f"local shape (a shard's size, x.shape[-1] on the rank's features) or from the rank, "
                "where one device reads the whole one; read it from the module's configuration (or "
                "hold it per rank with per_rank(...) where it is a size the shard has)"))
            return False
        if not shapes:
            return True
        got, shape, want = shapes[0]
        if seen.op == "view":
            self._view(func, seen, got, shape, want, given)
        elif "split" in seen.op:
            size = dict(args).get("split_size", dict(args).get("split_sizes"))
            self.find(func, seen, (
                f"splits its shard into a piece of {got} by {size}, a size that is the global one, where "
                f"its share of one device's {shape} is {want}: each rank holds 1/{self.n} of the features "
                "it splits; split by the local size (held with per_rank(...) in the module's style), or "
                "with chunk(...)"))
        else:
            named = self._counts(got, want, given)
            by = (f" by {named}, a count that is the global one" if named else
                  ": it reads a local size where one device reads the whole")
            self.find(func, seen, f"computes {func} of shape {got} on a rank where its share of one device's "
                                  f"{shape} is {want}{by}")
        return False

    def _counts(self, got: tuple, want: tuple, given: tuple) -> str:
        """``'self.n_head = 4'`` (or ``'config.num_heads = 4'``): an int attribute of the module
        (or of its config) that a view's wrong size is, where one is."""
        sizes = [a for x in given[1:] for a in (x if isinstance(x, (list, tuple)) else [x])
                 if type(a) is int]
        wrong = {g for g, w in zip(got, want) if g != w} & set(sizes)
        module = self.modules.get(self.where)
        for holder, prefix in ((module, "self."), (getattr(module, "config", None), "config.")):
            for name, value in vars(holder).items() if holder is not None else ():
                if type(value) is int and value in wrong and not name.startswith("_"):
                    return f"{prefix}{name} = {value}"
        return ""

    def pre(self, fqn: str, module: nn.Module):
        counted = bool(self.inside) or fqn in self.trace.trusted
        self.stack.append(fqn)
        self.calls.append(counted)
        self.inside += counted

    def post(self, fqn: str, module: nn.Module):
        self.stack.pop()
        self.inside -= self.calls.pop()


def rank_inputs(model: nn.Module, args: tuple, n: int) -> tuple:
    """The inputs rank 0 passes: its shard where the root's style declares an input sharded."""
    mount = mounted(model)
    slots = mount.inputs.slots if mount is not None else ()

    def mine(x, i):
        given = slots[i].given if i < len(slots) else None
        if isinstance(x, torch.Tensor) and isinstance(given, Shard):
            d, k = given.dim % x.ndim, given.parts
            return torch.cat([p.chunk(n, d)[0] for p in x.chunk(k, d)], d)
        if isinstance(x, torch.Tensor) and isinstance(given, Partial):
            return x  # rank 0's term: the whole (the others hand zeros)
        return x

    return tuple(mine(x, i) for i, x in enumerate(args))


def watch(model: nn.Module, trace, n: int) -> _Ranks:
    """The mode that follows ``model`` (parallelized on ``n`` fake ranks, a ``hybrid_copy``)
    against one device's ``trace``: enter it around the forward (under ``Hybrid``), then call
    its ``rest()`` and set ``done``; its ``findings`` fill as it goes. Its module hooks only
    observe (``observes_only``: the runtime takes the route it takes unobserved)."""
    mode = _Ranks(trace, dict(model.named_modules()), n)
    for fqn, module in model.named_modules():
        pre = functools.partial(_pre, mode, fqn)
        post = functools.partial(_post, mode, fqn)
        pre.observes_only = post.observes_only = True
        module.register_forward_pre_hook(pre, prepend=True)  # (before a hook that refuses the call)
        module.register_forward_hook(post, always_call=True)
    return mode


def _pre(mode, fqn, module, args):
    mode.pre(fqn, module)


def _post(mode, fqn, module, args, out):
    mode.post(fqn, module)


def failed(mode: _Ranks, model: nn.Module, exc: BaseException, phase: str) -> None:
    """A finding for a run that failed on the rank's shards (unless one found before explains it)."""
    where = failing_module(exc, model) or ""
    if not any(within(f.fqn, where) or within(where, f.fqn) for f in mode.findings):
        said = getattr(exc, "problems", None) or str(exc).splitlines() or [""]
        mode.findings.append(Finding(where, "", innermost(exc), (
            f"the {phase} fails on a rank's shards in {describe(model.get_submodule(where), where)}: "
            f"{type(exc).__name__}: {said[0]}")))


def on_ranks(model: nn.Module, plan, n: int, args: tuple, kwargs: dict, trace) -> list:
    """The findings of ``plan`` on ``n`` fake ranks against one device's ``trace``; a plan that
    ``parallelize`` refuses raises its ``PlanError``."""
    copy, mesh = hybrid_copy(model, who="check"), new_fake_mesh(n)
    phase = "forward"
    try:
        parallelize(copy, mesh, plan, src_rank=None)
        mode = watch(copy, trace, n)
        try:
            hybrid = Hybrid()
            with hybrid, mode:
                out = copy(*rank_inputs(copy, args, n), **kwargs)
                mode.rest()
                mode.done, hybrid.values, phase = True, False, "backward"
                grads = [t.sum() for t in floats(out)]
                try:
                    if grads:
                        torch.autograd.backward(grads)
                except RuntimeError as e:
                    if "expected device" not in str(e):
                        raise
        except Exception as e:  # noqa: BLE001 - a run that fails: the module it fails in, and why
            failed(mode, copy, e, phase)
    finally:
        release(mesh)
    return mode.findings
