"""Moves of local tensors between layouts, each one autograd node running the algebra's steps.

A local tensor handed from one layout to another (an input gathered from sequence shards, a
row-wise output's partial sums reduced) moves by the steps ``tpfn.algebra.transition`` derives,
each run by its collective (``tpfn.bounded.run``), in one autograd node whose backward runs the
dual steps (``tpfn.algebra.pullback``) on the gradient: Megatron's f and g. The node of a local
replica also takes partial sums of its gradient that a fast kernel hands it unreduced
(``Moved.hand``) and reduces them in one collective with the whole gradient autograd brings:
q, k and v reading one replica cost one all-reduce, not three. Nothing is written in place
that a move did not make.

A DTensor parameter's local shard reaches its module as a view (``view``): one node that saves
the parameter, so that autograd's version check sees a step taken on it between forward and
backward, and hands its gradient back as a DTensor.

>>> from tpfn.layout import Partial, Replicate, Shard
>>> program(Shard(1), Replicate(), Partial(), 3)
((AllGather(dim=1),), (ReduceScatter(dim=1),))
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch.distributed import tensor as _dt
from torch.distributed.tensor import DTensor

from tpfn._torch import (DTensorSpec, HookIdentity, batched, graph_task_id, local_tensor, node_type, spec_of,
                         tensor_observed)
from tpfn.algebra import contiguous_strides, pullback, transition
from tpfn.bounded import failed, run
from tpfn.layout import Partial, Replicate, to_torch
from tpfn.tree import total

__all__ = ["program", "Move", "Moved", "move", "first_order", "view", "grad_spec", "placements", "unhooked"]

_WHOLE, _PARTIAL = Replicate(), Partial()


@functools.lru_cache(maxsize=1024)  # values alone: the same for every model and mesh
def program(src, dst, grad, ndim: int, to=None) -> tuple:
    """``(forward steps, backward steps)`` of a tensor of ``ndim`` dims moved from layout ``src``
    to ``dst``, its gradient arriving in ``grad`` (backward None: it needs none) and handed back
    in ``to`` (None: ``src``'s cotangent; ``Partial()``: a replica's gradient as terms)."""
    forward = transition(src, dst, ndim=ndim)
    return forward, None if grad is None else pullback(src, dst, grad, to=to, ndim=ndim)


_placements = functools.lru_cache(maxsize=1024)(to_torch)


def placements(layout, ndim: int) -> tuple:
    """The torch placements of a layout for a tensor of ``ndim`` dims, remembered (but in
    compiled code, which traces the conversion once)."""
    return to_torch(layout, ndim) if torch.compiler.is_compiling() else _placements(layout, ndim)


def first_order(what: str, grad=None) -> None:
    """Refuse a backward tpfn cannot follow through ``what`` (its gradient ``grad``): one that builds
    a graph for a second one (its collectives are not differentiated again), or batched gradients
    (a batch of collectives would be one per row)."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"a second-order gradient (backward with create_graph=True) runs through {what}, "
            "whose backward tpfn does not differentiate again; compute such a term (a gradient "
            "penalty) on a model that is not parallelized, or leave the module out of the plan.")
    if batched(grad):
        raise RuntimeError(
            f"batched gradients (autograd.grad(..., is_grads_batched=True), jacobian(vectorize=True)) "
            f"run through {what}, whose backward collectives take one gradient at a time; take them "
            "one by one (vectorize=False, or a loop over the grad_outputs).")


class Move:
    """One slot's move of a local tensor of global ``shape`` on the 1-D ``mesh`` from layout
    ``src`` to ``dst``, its gradient arriving in ``grad`` (None: it needs none) and handed back in
    ``to`` (``program``); every collective waits with ``bound``, and one that fails is named after
    ``what`` it moves. ``tree``: partial sums are summed by the canonical tree (invariant mode,
    ``tpfn.tree``), each rank's local tensor the root of its subtree."""

    __slots__ = ("src", "dst", "grad", "mesh", "shape", "bound", "steps", "back", "tree", "ranks")

    def __init__(self, src, dst, grad, mesh, shape: tuple, bound, to=None, tree: bool = False):
        self.src, self.dst, self.grad, self.mesh, self.shape, self.bound = src, dst, grad, mesh, shape, bound
        self.ranks, self.tree = mesh.size(), tree
        self.steps, self.back = program(src, dst, grad, len(shape), to) if self.ranks > 1 else ((), ())

    def run(self, x: torch.Tensor, what: str, steps=None, wait: bool = True):
        """``x`` moved by ``steps`` (by default the forward's), a new tensor; ``wait=False``: a
        function that waits for the last collective and returns it."""
        steps = self.steps if steps is None else steps
        try:
            for step in steps[:-1]:
                x = run(step, x, self.mesh, self.shape, self.bound, tree=self.tree)
            done = run(steps[-1], x, self.mesh, self.shape, self.bound, wait, self.tree)
        except RuntimeError as error:
            raise self._failed(what, steps, error) from error
        if wait:
            return done

        def finish():
            try:
                return done()
            except RuntimeError as error:
                raise self._failed(what, steps, error) from error
        return finish

    def pulled(self, g: torch.Tensor, what: str, wait: bool = True):
        """The gradient ``g`` moved back (``back``), or a function that waits for it."""
        if not self.back:
            return g if wait else lambda: g
        return self.run(g, f"the gradient of {what}", self.back, wait)

    def _failed(self, what: str, steps, error):
        kinds = " and ".join(s.collective.replace("_", "-") for s in steps if s.collective) or "move"
        return failed(f"the {kinds} that moves {what} ({steps[0].src!r} -> {steps[-1].dst!r})", error, self.bound)


class _Move(torch.autograd.Function):
    """``x`` moved forward, its gradient moved back. Where nothing moves forward, the output is
    ``x``'s own memory as a tensor autograd takes for a new one (``x.detach()``, not a view: an
    in-place op on it writes ``x``, as on one device)."""

    @staticmethod
    def forward(ctx, x, move: Move, what: str, takes: bool):
        ctx.set_materialize_grads(False)
        ctx.move, ctx.what, ctx.takes, ctx.handed = move, what, takes, {}
        return move.run(x, what) if move.steps else x.detach()

    @staticmethod
    def backward(ctx, grad):
        first_order(ctx.what, grad)
        move, task = ctx.move, graph_task_id()
        handed = ctx.handed.pop(task, None)
        ctx.handed.clear()  # (a failed backward's)
        if grad is not None:
            grad = move.pulled(grad, ctx.what)
        if handed is not None:  # partial sums a fast kernel handed over: reduced once, with the rest
            if isinstance(handed, list):  # invariant mode: this rank's leaves, one sum per leaf
                handed = total(handed)
            back = program(move.src, move.dst, _PARTIAL, len(move.shape))[1] if move.ranks > 1 else ()
            part = move.run(handed, f"the gradient of {ctx.what}", back) if back else handed
            grad = part if grad is None else grad + part
        return grad, None, None, None


class Moved:
    """What a fast kernel may ask of the node that moved its input (``Moved.of(x)``)."""

    node = node_type(_Move)

    @staticmethod
    def of(x: torch.Tensor, mesh):
        """The node of the local replica ``x`` on ``mesh`` (seen through module hooks' identities,
        which torch's module trackers put on a module's inputs) whose whole gradient autograd
        brings, and which may take partial sums of it (else None)."""
        node, nr = unhooked(x.grad_fn, x.output_nr)
        if type(node) is not Moved.node or nr != 0 or not node.takes:
            return None
        move, replica = node.move, node.out()
        if move.dst != _WHOLE or move.grad != _WHOLE or move.mesh is not mesh or \
                replica is not None and tensor_observed(replica):
            return None
        return node

    @staticmethod
    def hand(node, partial) -> None:
        """Hand ``node`` a partial sum of its output's gradient, summed with the others it gets; in
        invariant mode a list, this rank's leaves of the canonical tree (``tpfn.tree``), each
        summed with the same leaf of the others (the kernels made them: summed where they lie)."""
        task = graph_task_id()
        held = node.handed.get(task)
        if held is None:
            node.handed[task] = partial
        elif isinstance(held, list):
            for mine, theirs in zip(held, partial):
                mine.add_(theirs)
        else:
            node.handed[task] = held + partial


def move(x: torch.Tensor, src, dst, grad, shape: tuple, what: str, rt, *, to=None, node: bool = False):
    """Local ``x`` of global ``shape`` moved from layout ``src`` to ``dst`` on ``rt``'s mesh, its
    gradient arriving in ``grad`` (None: it needs none) and handed back in ``to`` (a new tensor
    where something moves: ``x`` is never written); ``what`` names it in errors. ``node``: a
    replica that fast kernels may hand their partial sums to (``Moved``), its node made even
    where nothing moves. ``rt`` keeps the ``Move`` (``rt.move``)."""
    if torch.compiler.is_compiling():  # as DTensor operations, which torch.compile traces whole
        return _traced(x, src, dst, grad, rt.mesh, shape) if to is None else _terms(x, src, dst, grad, rt.mesh, to)
    m = rt.move(src, dst, grad, tuple(shape), x.dtype, to)
    if not (x.requires_grad and torch.is_grad_enabled()):
        return m.run(x, what) if m.steps else x
    if not (m.steps or m.back or node and m.grad is not None and (m.ranks > 1 or m.tree)):
        return x  # (in invariant mode one rank too sums its readers' leaves on the replica's node)
    # Always through _Move: functional collectives differentiate themselves otherwise
    # (an all-reduce's gradient would be all-reduced again).
    out = _Move.apply(x, m, what, node)
    out.grad_fn.out = weakref.ref(out)  # (whether a hook or retain_grad observes it: Moved.of)
    return out


class _Scaled(torch.autograd.Function):
    """``x / forward``, its gradient divided by ``backward`` (1: left as it is)."""

    @staticmethod
    def forward(ctx, x, forward: int, backward: int):
        ctx.backward = backward
        return x.view_as(x) if forward == 1 else x / forward

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.backward == 1 else grad / ctx.backward), None, None


def _terms(x, src, dst, grad, mesh, to):
    """A replica moved to terms of a sum or its gradient handed back as terms, in compiled code:
    the algebra's local split (``Split``: a replica becomes terms, the value divided by the
    mesh size) each way, where one is made."""
    n = mesh.size()
    return _Scaled.apply(x, *(n if a == _WHOLE and b == _PARTIAL else 1 for a, b in ((src, dst), (grad, to))))


def _traced(x, src, dst, grad, mesh, shape: tuple):
    if mesh.size() == 1 or (src == dst and grad is None):
        return x
    ndim = len(shape)
    dt = DTensor.from_local(x, mesh, placements(src, ndim), run_check=False, shape=shape,
                            stride=contiguous_strides(shape))
    if src != dst:
        dt = dt.redistribute(mesh, placements(dst, ndim))
    return dt.to_local(grad_placements=None if grad is None else placements(grad, ndim))


def unhooked(node, nr: int) -> tuple:
    """``(node, output number)`` past module hooks' identity wrappers (output i is input i)."""
    while isinstance(node, HookIdentity):
        node, nr = node.next_functions[nr]
    return node, nr


class _View(torch.autograd.Function):
    """A DTensor parameter's local shard; its gradient flows back as a DTensor laid out ``spec``.
    It saves the parameter: an in-place op on a DTensor counts on the DTensor's version alone,
    and autograd checks it here, as one device checks the parameter itself."""

    @staticmethod
    def forward(ctx, param, spec):
        ctx.spec = spec
        ctx.save_for_backward(param)
        return local_tensor(param).view_as(local_tensor(param))

    @staticmethod
    def backward(ctx, grad):
        first_order("a parameter's local shard", grad)
        ctx.saved_tensors  # (autograd's version check: the parameter unchanged since the forward)
        return DTensor(grad.contiguous(), ctx.spec, requires_grad=False), None


def _grads(param: DTensor, grad):
    """The torch placements of a local gradient laid out ``grad``; ``Partial()`` is partial
    where the parameter is replicated (a head replicated over a group: within the group)."""
    if isinstance(grad, Partial):
        return tuple(_dt.Partial(grad.op) if p.is_replicate() else p for p in param.placements)
    return to_torch(grad)


def grad_spec(param: DTensor, grad, cache: dict) -> DTensorSpec:
    """The spec of ``param``'s gradient laid out ``grad`` (None: as the parameter), kept in ``cache``."""
    key = (spec_of(param), grad)
    spec = cache.get(key)
    if spec is None:
        grads = None if grad is None else _grads(param, grad)
        spec = cache[key] = spec_of(param) if grads is None or grads == param.placements else \
            DTensorSpec(param.device_mesh, grads, tensor_meta=spec_of(param).tensor_meta)
    return spec


def view(param: DTensor, grad, cache: dict):
    """The local shard of DTensor ``param`` a module computes with, its gradient laid out ``grad``."""
    if torch.compiler.is_compiling():
        return param.to_local(grad_placements=None if grad is None else _grads(param, grad))
    if param.requires_grad and torch.is_grad_enabled():
        return _View.apply(param, grad_spec(param, grad, cache))
    return local_tensor(param)
