"""Autograd-aware moves of local tensors between layouts, and the local views a kernel uses.

DTensor runs every op inside a parallelized module through its sharding propagation. Where
tpfn knows a module's layouts (a ``Kernel``), that work is known in advance: the module is
handed its parameters' local shards (their gradients flow back to the DTensor parameters),
and each input and output is moved to the wanted layout with one autograd-aware transition
whose backward is the dual transition (Megatron's f and g). The numbers are the ones DTensor
computes. Spec caches belong to their caller (one module on one mesh), never to the process.

>>> from tpfn.layout import Replicate, Shard
>>> placements(Shard(-1), 3)
(Shard(dim=2),)
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import tensor as _dt
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tpfn._torch import (DTensorSpec, HookIdentity, TensorMeta, assert_async, local_tensor, per_rank, pre_hooked,
                         redistribute_local_tensor, spec_of, will_run)
from tpfn.algebra import chunk_bounds, contiguous_strides, cotangent, transition
from tpfn.errors import CollectiveError
from tpfn.interpret.collectives import step as plain_step
from tpfn.interpret.terms import scaled
from tpfn.layout import Partial, Replicate, from_torch, to_torch

__all__ = ["move", "replicate_shared", "placements", "failed", "collective", "param_slots", "local_params",
           "direct", "linear", "Later", "Siblings", "writable", "shared", "reads_shared", "overlapping",
           "unhooked", "vocab_mask", "dropout_slice", "Rows"]

_placements = functools.lru_cache(maxsize=1024)(to_torch)


def placements(layout, ndim: int) -> tuple:
    """The torch placements of a 1-D layout for a tensor of ``ndim`` dims (shard dims
    normalized); remembered, except in compiled code (which traces the conversion once)."""
    if torch.compiler.is_compiling():
        return to_torch(layout, ndim)
    return _placements(layout, ndim)


def failed(what: str, src, dst, error: Exception, mesh) -> CollectiveError:
    """The error for a collective that failed while moving ``what`` from layout src to dst."""
    kinds = " and ".join(s.collective.replace("_", "-") for s in transition(src, dst) if s.collective)
    return _failed(f"the {kinds} that moves {what} ({src[0]!r} -> {dst[0]!r})", error, mesh)


def _failed(what: str, error: Exception, mesh) -> CollectiveError:
    return CollectiveError(
        f"rank {dist.get_rank() if dist.is_initialized() else mesh.get_local_rank()}: {what} "
        f"failed: {error}. Another rank has most likely failed (its own error says why) or runs "
        "another plan; the wait is bounded by the process group's timeout (init_process_group(timeout=...)).")


@contextlib.contextmanager
def collective(what: str, mesh):
    """Inside, a collective that fails raises a ``CollectiveError`` naming ``what`` it served
    (``"the all-reduce of cross_entropy's per-token maxima"``)."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as error:
        raise _failed(what, error, mesh) from error


def _first_order(what: str) -> None:
    """Refuse a backward that builds a graph for a second one (``create_graph=True``): the
    moves' backward collectives are not differentiated again, so its numbers would be wrong."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"a second-order gradient (backward with create_graph=True) runs through {what}, "
            "whose backward tpfn does not differentiate again; compute such a term (a gradient "
            "penalty) on a model that is not parallelized, or leave the module out of the plan.")


class _Step:
    """One move of a local tensor between torch placements: a plain collective where one
    does it (``tpfn.interpret.collectives``), else DTensor's ``redistribute_local_tensor``;
    a failed collective is named after the slot it served."""

    __slots__ = ("plain", "specs", "gather")

    def __init__(self, mesh, src, dst, shape: tuple, dtype):
        self.plain = plain_step(src, dst, mesh, shape)
        self.specs = (_spec(mesh, src, shape, dtype), _spec(mesh, dst, shape, dtype))
        # (dim, rank) of a plain all-gather along a dim other than the last: a linear's rows
        self.gather = (src.dim, mesh.get_coordinate()[0]) if self.plain is not None and \
            isinstance(src, _dt.Shard) and isinstance(dst, _dt.Replicate) and src.dim < len(shape) - 1 else None

    def __call__(self, x: torch.Tensor, what: str, owned: bool = False) -> torch.Tensor:
        """``x`` moved (``owned``: the caller's own tensor, which a sum may reuse)."""
        try:
            if self.plain is not None and type(x) is torch.Tensor and x.device.type != "meta":
                return self.plain(x, owned=owned)
            return redistribute_local_tensor(x.contiguous(), *self.specs)
        except RuntimeError as error:
            raise self._failed(what, error) from error

    def start(self, x: torch.Tensor, what: str, owned: bool = False):
        """The move started, its collective left running: a function that waits for it and
        returns the result (a move that DTensor's path makes is done before this returns)."""
        if self.plain is None or type(x) is not torch.Tensor or x.device.type == "meta":
            done = self(x, what)
            return lambda: done
        try:
            finish = self.plain(x, wait=False, owned=owned)
        except RuntimeError as error:
            raise self._failed(what, error) from error

        def wait():
            try:
                return finish()
            except RuntimeError as error:
                raise self._failed(what, error) from error
        return wait

    def ahead(self, x: torch.Tensor, what: str, during):
        """``(x moved, during(x, dim, rank))``: where the move is a plain all-gather along
        ``dim``, ``during`` computes ``{module: Rows}`` from this rank's slice while the other
        ranks' arrive (else the result is None, and nothing runs beside the move)."""
        if self.gather is None or type(x) is not torch.Tensor or during is None:
            return self(x, what), None
        if x.is_meta:  # (a dry run: the same work, nothing in flight)
            out = self(x, what)
            found = during(x, *self.gather)
        else:
            wait = self.start(x, what)
            try:
                found = during(x, *self.gather)
            finally:
                out = wait()
        for rows in found.values():
            rows.version = out._version  # (the gathered tensor changed in place: not the rows' input)
        return out, found

    def _failed(self, what: str, error: Exception) -> CollectiveError:
        src, dst = (from_torch(spec.placements) for spec in self.specs)
        return failed(what, src, dst, error, self.specs[0].mesh)


class _Inbox:
    """Gradients handed to a move's backward apart from autograd's own, per backward (graph task): a
    shared replica's column-wise readers' partial gradients (``_Contribute``), or the input gradient of
    a ``linear`` that reads the move. Once all ``readers`` of this forward are in, ``linear`` starts the
    move back (``start``) before its weight gradient; the move's backward ``take``-s the result.
    ``seq``: the move's autograd sequence number (a collective started early still belongs to it);
    ``node``: the move's node, weakly; ``rows``: its readers' ``Rows`` by module, computed while
    the move's all-gather ran."""

    __slots__ = ("back", "what", "seq", "node", "readers", "entries", "rows")

    def __init__(self, back, what: str, node):
        self.back, self.what, self.seq, self.node = back, what, node._sequence_nr(), weakref.ref(node)
        self.readers, self.entries, self.rows = 0, {}, None

    def wanted(self) -> bool:
        """Whether the running backward runs the move's node (else no reader need hand in)."""
        node = self.node()
        return node is not None and will_run(node)

    def add(self, grad: torch.Tensor, owned: bool = False) -> bool:
        """Add one reader's ``grad`` (``owned``: made by the reader, held by no one else);
        True once every reader's is in."""
        task = torch._C._current_graph_task_id()
        entry = self.entries.get(task)
        if entry is None:
            entry = self.entries[task] = [grad, 0, None, owned]
        else:
            entry[0], entry[3] = entry[0] + grad, True
        entry[1] += 1
        return entry[1] == self.readers

    def start(self) -> None:
        """Start the move back of this backward's summed gradient."""
        entry = self.entries[torch._C._current_graph_task_id()]
        if self.back is not None:
            entry[2] = self.back.start(entry[0], f"the gradient of {self.what}", entry[3])

    def take(self):
        """This backward's summed gradient moved back (None: no reader handed one in)."""
        entry = self.entries.pop(torch._C._current_graph_task_id(), None)
        if entry is None:
            return None
        summed, _, pending, owned = entry
        if pending is not None:
            return pending()
        return summed if self.back is None else self.back(summed, f"the gradient of {self.what}", owned)


def _plus(a, b):
    return b if a is None else a if b is None else a + b


class _Move(torch.autograd.Function):
    """One transition forward, its dual backward, on local tensors."""

    @staticmethod
    def forward(ctx, x, forward, backward, what, owned=False, during=None):
        ctx.set_materialize_grads(False)
        ctx.backward, ctx.what, ctx.inbox, ctx.rows = backward, what, None, None
        if forward is None:
            return x.view_as(x)
        if during is not None:
            out, ctx.rows = forward.ahead(x, what, during)
            return out
        out = forward(x, what, owned)
        if out is x:  # summed in place: the caller's own tensor
            ctx.mark_dirty(x)
        return out

    @staticmethod
    def backward(ctx, grad):
        _first_order(ctx.what)
        if grad is not None and ctx.backward is not None:
            grad = ctx.backward(grad, f"the gradient of {ctx.what}")
        return _plus(grad, None if ctx.inbox is None else ctx.inbox.take()), None, None, None, None, None


def _spec(mesh, placement, shape: tuple, dtype) -> DTensorSpec:
    """The spec of a tensor of global ``shape`` laid out by a torch ``placement``."""
    meta = TensorMeta(torch.Size(shape), contiguous_strides(shape), dtype)
    return DTensorSpec(mesh, (placement,), tensor_meta=meta)


def _steps(mesh, src, dst, grad, global_shape: tuple, dtype) -> tuple:
    """(forward step, backward step) of a move, each None where nothing moves."""
    if mesh.size() == 1:  # one rank: every layout is the whole tensor
        return None, None
    ndim = len(global_shape)
    src, dst = placements(src, ndim)[0], placements(dst, ndim)[0]
    back = None if grad is None else placements(grad, ndim)[0]
    target = _dt.Replicate() if src.is_partial() else src
    forward = None if src == dst else _Step(mesh, src, dst, global_shape, dtype)
    backward = None if back is None or back == target else _Step(mesh, back, target, global_shape, dtype)
    return forward, backward


class _Share(torch.autograd.Function):
    """A local input that several modules of one parent read (Megatron's f, shared by q, k
    and v): forward, the parent slot's move; backward, the partial gradients its column-wise
    readers handed in (``_Contribute``) summed, moved once, plus the whole gradient of every
    other reader. Entries of another backward (a graph backwarded twice) are never mixed in."""

    @staticmethod
    def forward(ctx, x, forward, partial_back, whole_back, what, mesh, during):
        ctx.set_materialize_grads(False)
        ctx.whole_back, ctx.what = whole_back, what
        ctx.mesh, ctx.inbox = mesh, _Inbox(partial_back, what, ctx)
        if forward is None:
            return x.view_as(x)
        out, ctx.inbox.rows = forward.ahead(x, what, during)
        return out

    @staticmethod
    def backward(ctx, grad):
        _first_order(ctx.what)
        if grad is not None and ctx.whole_back is not None:
            grad = ctx.whole_back(grad, f"the gradient of {ctx.what}")
        return _plus(ctx.inbox.take(), grad), None, None, None, None, None, None


class _Contribute(torch.autograd.Function):
    """A column-wise reader of a shared input: its partial gradient goes to the input's
    inbox, to be reduced once with the other readers' (see ``_Share``)."""

    @staticmethod
    def forward(ctx, x, inbox):
        ctx.set_materialize_grads(False)
        ctx.inbox = inbox
        inbox.readers += 1
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if grad is not None:
            ctx.inbox.add(grad)
        return None, None


_REPLICA, _PARTIAL = Replicate(), Partial()  # made once: compiled code cannot build them


def unhooked(node, nr: int) -> tuple:
    """``(node, output number)`` past module hooks' identity wrappers (output i is input i)."""
    while isinstance(node, HookIdentity):
        node, nr = node.next_functions[nr]
    return node, nr


def replicate_shared(x: torch.Tensor, src, mesh, global_shape: tuple, what: str, cache: dict,
                     during=None) -> torch.Tensor:
    """Local ``x`` (laid out ``src``) replicated, for several modules to read: the partial
    gradients of the column-wise ones are summed before one move back to ``src`` (one
    all-reduce for q, k and v, where each would otherwise send its own). ``during``: see
    ``_Step.ahead``; its result (the readers' ``Rows``) goes to the replica's inbox."""
    shape = tuple(global_shape)
    if torch.compiler.is_compiling() or mesh.size() == 1:
        return move(x, src, _REPLICA, _REPLICA, mesh, shape, what, cache)
    key = ("share", src, shape, x.dtype)
    steps = cache.get(key)
    if steps is None:
        target = cotangent(src)
        forward, _ = _steps(mesh, src, _REPLICA, None, shape, x.dtype)
        partial_back, _ = _steps(mesh, _PARTIAL, target, None, shape, x.dtype)
        whole_back, _ = _steps(mesh, _REPLICA, target, None, shape, x.dtype)
        steps = cache[key] = (forward, partial_back, whole_back)
    forward, partial_back, whole_back = steps
    if not (x.requires_grad and torch.is_grad_enabled()):
        return forward(x, what) if forward else x
    return _Share.apply(x, forward, partial_back, whole_back, what, mesh, during)


def shared(x: torch.Tensor, mesh) -> _Inbox | None:
    """The inbox of the shared replica on ``mesh`` (``replicate_shared``) that ``x`` is, seen
    past module hooks' identity wrappers; else None."""
    node, index = unhooked(x.grad_fn, x.output_nr)
    if isinstance(node, _Share._backward_cls) and index == 0 and node.mesh is mesh:
        return node.inbox
    return None


def reads_shared(src, dst, grad, mesh) -> bool:
    """Whether a slot from ``src`` to ``dst``, its gradient arriving in ``grad``, may read a
    shared replica as it is: a replica left so, whose gradient comes back partial."""
    return isinstance(src, Replicate) and isinstance(dst, Replicate) and isinstance(grad, Partial) \
        and grad.op == "sum" and mesh.size() > 1


def move(x: torch.Tensor, src, dst, grad, mesh, global_shape: tuple, what: str, cache: dict,
         owned: bool = False, during=None):
    """Local tensor ``x`` in layout ``src`` -> ``dst``; its gradient arrives in ``grad``
    (None: it needs none) and leaves in ``src``'s cotangent layout. ``what`` names it in
    errors; ``cache`` keeps the specs of moves on ``mesh`` seen before; ``owned``: ``x`` is
    the caller's own, held by no one else, so a sum may write it (Megatron's g, in place). A
    replica shared by several readers (``replicate_shared``) takes a partial gradient and
    reduces it once. ``during``: see ``_Step.ahead`` (its result, ``Rows`` by module, stays on
    the move's node for the linear that reads the move: ``linear``)."""
    shape = tuple(global_shape)
    if torch.compiler.is_compiling():
        return _traced_move(x, src, dst, grad, mesh, shape)
    key = (src, dst, grad, shape, x.dtype)
    steps = cache.get(key)
    if steps is None:
        forward, backward = _steps(mesh, src, dst, grad, shape, x.dtype)
        steps = cache[key] = (forward, backward, reads_shared(src, dst, grad, mesh))
    forward, backward, reader = steps
    if not (x.requires_grad and torch.is_grad_enabled()):
        return forward(x, what, owned) if forward else x
    if reader:
        inbox = shared(x, mesh)
        if inbox is not None:
            return _Contribute.apply(x, inbox)
    if forward is None and backward is None:
        return x
    # Always through _Move: functional collectives differentiate themselves otherwise
    # (an all-reduce's gradient would be all-reduced again).
    return _Move.apply(x, forward, backward, what, owned, during)


def _traced_move(x, src, dst, grad, mesh, shape: tuple):
    """``move`` as DTensor operations, which torch.compile traces whole (``_Move`` calls
    into DTensor internals that it skips)."""
    if mesh.size() == 1 or (src == dst and grad is None):
        return x
    ndim = len(shape)
    dt = DTensor.from_local(x, mesh, placements(src, ndim), run_check=False, shape=shape,
                            stride=contiguous_strides(shape))
    if src != dst:
        dt = dt.redistribute(mesh, placements(dst, ndim))
    return dt.to_local(grad_placements=None if grad is None else placements(grad, ndim))


class _Linear(torch.autograd.Function):
    """``F.linear`` on the local shards of DTensor parameters ``weight`` and ``bias``, in one
    node: no parameter views. ``share``: the bias's share of a sum over that many ranks (it
    is added once). Backward hands the weight and bias gradients back as DTensors laid out
    ``specs``; the input gradient either to autograd or, where a move takes it, to its
    ``inbox``: with ``overlap``, once every reader's is in, it starts the move's collective,
    then computes the weight and bias gradients while it runs (Megatron's overlap); the
    move's backward waits for it. ``later``: the ``Later`` weight gradients of the module's
    siblings, the parameters ``extra``; a linear whose ``later`` is not its own hands its
    gradient's operands in (``window`` False). ``own``: this rank's rows of the output,
    computed while ``x``'s all-gather ran (``Rows``). The same numbers either way (the rows of
    a product in pieces: bit for bit where the kernel computes each row alone, as the CPU's do)."""

    @staticmethod
    def forward(ctx, x, weight, bias, specs, share, inbox, overlap, later, window, own, *extra):
        ctx.save_for_backward(x, _local(weight))
        ctx.specs, ctx.inbox, ctx.overlap = specs, inbox, overlap
        ctx.later, ctx.window, ctx.params = later, window, (weight, bias)
        if window:
            later.node = weakref.ref(ctx)
        return _local_linear(x, weight, bias, share) if own is None else own.whole(x)

    @staticmethod
    def backward(ctx, grad):
        _first_order("an nn.Linear's local shards")
        x, weight = ctx.saved_tensors
        g, inbox, gx = _rows(grad), ctx.inbox, None
        if ctx.needs_input_grad[0] and (inbox is None or inbox.wanted()):  # (else no one takes it)
            gx = g.mm(weight).view(x.shape)
            if inbox is not None:
                if inbox.add(gx, owned=True) and ctx.overlap:
                    inbox.start()
                gx = None
        need, later = ctx.needs_input_grad[1:3], ctx.later
        if later is not None and not ctx.window and later.defer(ctx, need):
            ctx.operands = (g, x)  # until the window takes them
            return gx, None, None, *_NONE
        gw, gb = _param_grads(g, x, ctx.specs, need)
        if not ctx.window:
            return gx, gw, gb, *_NONE
        return gx, gw, gb, *_NONE, *later.grads()


_NONE = (None,) * 7  # specs, share, inbox, overlap, later, window, own


def _param_grads(g, x, specs, need) -> tuple:
    """A linear's weight and bias gradients from its output gradient ``g`` (a matrix) and its
    input ``x`` (None where ``need`` says so)."""
    wspec, bspec = specs
    gw = _as(g.t().mm(_rows(x)), wspec) if need[0] else None
    gb = _as(g.sum(0), bspec) if need[1] else None
    return gw, gb


class Later:
    """The weight gradients that one ``linear`` (the window: its backward starts a move's
    collective) computes while the collective runs, for the other linears of its module's
    parent, whose parameters (``params``) its forward takes as inputs (the gradients flow
    through its node). A sibling hands itself in (``defer``) only where the window's node is
    still to run in this backward (else it computes them itself), so each gradient is
    computed once, by the one node or the other. Per backward (graph task). Siblings are
    held weakly and keep their own operands (``operands``), so nothing here holds a tensor:
    a backward that fails in between leaves no cycle through the graph."""

    __slots__ = ("params", "node", "entries", "ran")

    def __init__(self, params: tuple):
        self.params = {id(p): i for i, p in enumerate(params)}
        self.node, self.entries, self.ran = None, {}, None

    def defer(self, sibling, need: tuple) -> bool:
        """Hand in a running ``linear`` node ``sibling``, for the gradients of its parameters
        that it ``need``-s; False: it computes them itself."""
        if not all(id(p) in self.params for p, n in zip(sibling.params, need) if n):
            return False
        task, node = torch._C._current_graph_task_id(), None if self.node is None else self.node()
        if node is None or self.ran == task or not will_run(node):
            return False
        self.entries.setdefault(task, []).append((weakref.ref(sibling), need))
        return True

    def grads(self) -> list:
        """The gradients of ``params`` that the siblings handed in in this backward (None:
        none), computed now; later hand-ins in this backward are refused."""
        task = self.ran = torch._C._current_graph_task_id()
        out = [None] * len(self.params)
        for ref, need in self.entries.pop(task, ()):
            sibling = ref()  # alive: the graph that is running holds it
            (g, x), sibling.operands = sibling.operands, None
            for p, grad in zip(sibling.params, _param_grads(g, x, sibling.specs, need)):
                if grad is not None:
                    i = self.params[id(p)]
                    out[i] = _plus(out[i], grad)
        return out


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a matrix of its last dim (not ``reshape(-1, d)``: a rank's shard may be empty)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _local(t):
    return t._local_tensor if isinstance(t, DTensor) else t


def _local_linear(x, weight, bias, share: int):
    """``F.linear`` on the parameters' local tensors, the bias divided by ``share``. Where
    nothing differentiates it, a 3-D output is a tensor of its own (``F.linear``'s is a view
    of its matrix product there: the same ``addmm``, into a tensor a move may then sum in place)."""
    w, b = _local(weight), _local(bias)
    b = b if share == 1 or b is None else b / share
    if x.dim() != 3 or b is None or torch.is_grad_enabled() or not x.is_contiguous() \
            or any(type(t) is not torch.Tensor or t.dtype != x.dtype or t.is_meta for t in (x, w, b)):
        return F.linear(x, w, b)  # (simulated ranks' tensors, meta and mixed dtypes: as they were)
    out = x.new_empty((x.shape[0], x.shape[1], w.shape[0]))
    torch.addmm(b, _rows(x), w.t(), out=_rows(out))
    return out


def writable(out: torch.Tensor) -> bool:
    """Whether ``linear``'s output ``out`` is its own (no view autograd tracks), which the
    caller's move may sum in place."""
    return not (torch.is_grad_enabled() and out._is_view())


def _as(grad: torch.Tensor, spec):
    """A parameter's gradient: a DTensor laid out ``spec``, or plain (``spec`` None)."""
    return grad if spec is None else DTensor(grad, spec, requires_grad=False)


def direct(x) -> bool:
    """Whether ``linear`` takes ``x``: a plain tensor in eager code, no autocast (else the
    module computes on parameter views: ``local_params``)."""
    return type(x) is torch.Tensor and not torch.compiler.is_compiling() and not _autocast(x.device.type)


def linear(x: torch.Tensor, module: nn.Linear, kernel, mesh, overlap: bool, cache: dict,
           inbox: _Inbox | None = None, siblings=None) -> torch.Tensor:
    """``nn.Linear``'s forward on the local shards of its parameters (``kernel``'s layouts;
    ``cache`` keeps their gradients' specs), for an ``x`` it takes (``direct``). Where ``x``
    comes from a move whose backward reduces its gradient (Megatron's f: a replica's partial
    sums, ``inbox`` where the caller found it, or a sequence shard's gather), that reduction
    starts before the weight gradient and ends after it (``overlap``: else it waits; the
    numbers are the same), and so do the weight gradients of the other linears of
    ``siblings`` (a ``Siblings``, its parent's) that run after it. Without gradients, or
    frozen parameters with nothing handed in: plain ``F.linear`` on their local tensors
    (which a second-order gradient differentiates again)."""
    weight, bias = module.weight, module.bias
    grad, rows = torch.is_grad_enabled(), None
    if inbox is not None:  # a shared replica's reader, found by the caller
        rows = inbox.rows
    elif grad:
        node = x.grad_fn
        if isinstance(node, _Contribute._backward_cls):  # a shared replica's reader
            inbox = node.inbox
            rows = inbox.rows
        elif isinstance(node, _Move._backward_cls):  # its own slot's move
            rows, node.rows = node.rows, None
            if node.backward is not None and node.inbox is None:
                inbox = node.inbox = _Inbox(node.backward, node.what, node)
                inbox.readers = 1
    own = rows.pop(module, None) if rows else None  # (taken once)
    key = ("linear", spec_of(weight) if isinstance(weight, DTensor) else None,
           spec_of(bias) if isinstance(bias, DTensor) else None)
    found = cache.get(key)
    if found is None:
        grads = dict(kernel.grads)
        specs = tuple(_grad_spec(p, grads.get(name), cache) if isinstance(p, DTensor) else None
                      for name, p in (("weight", weight), ("bias", bias)))
        share = mesh.size() if kernel.once == "bias" and specs[1] is not None and mesh.size() > 1 else 1
        found = cache[key] = (specs, share)
    specs, share = found
    if not grad or inbox is None and not weight.requires_grad and not (bias is not None and bias.requires_grad):
        return _local_linear(x, weight, bias, share)  # (frozen with grad on: differentiable twice)
    if own is not None and not (share == 1 and own.fits(module, x)):
        own = None
    later, extra = None, ()
    if siblings is not None and overlap and not isinstance(module, FSDPModule):
        if inbox is not None and inbox.readers == 1:  # the window: its reduction starts first
            extra = siblings.params(module)
            later = siblings.later = Later(extra) if extra else None
        else:
            later = siblings.later
    window = bool(extra)
    return _Linear.apply(x, weight, bias, specs, share, inbox, overlap, later, window, own, *extra)


class Rows:
    """A column-wise linear's output for this rank's slice of its gathered input, computed
    while the all-gather brings the other ranks' slices (``_Step.ahead``: the forward's
    overlap under sequence parallelism), with the local parameters it was computed from. The
    linear computes the other rows once the input is whole (``whole``), where they still ``fit``:
    the same parameters and gathered tensor, unchanged; else it computes all of them as usual."""

    __slots__ = ("rows", "dim", "rank", "weight", "bias", "versions", "version")

    def __init__(self, x: torch.Tensor, module: nn.Linear, dim: int, rank: int):
        w, b = _local(module.weight), _local(module.bias)
        with torch.no_grad():
            self.rows = F.linear(x, w, b)
        self.dim, self.rank, self.weight, self.bias = dim, rank, w, b
        self.versions, self.version = _versions(module), None  # (the gathered tensor's: ``_Step.ahead``)

    @staticmethod
    def ahead(modules: tuple, x: torch.Tensor, dim: int, rank: int) -> dict:
        """``{module: Rows}`` for each of ``modules`` (nn.Linear readers of the gathered ``x``)
        that computes on its local shards here."""
        return {m: Rows(x, m, dim, rank) for m in modules if _ahead(m, x)}

    def fits(self, module: nn.Linear, x: torch.Tensor) -> bool:
        """Whether these rows are ``module``'s for the gathered ``x`` (unchanged since)."""
        return _local(module.weight) is self.weight and _local(module.bias) is self.bias \
            and _versions(module) == self.versions and x._version == self.version and x.dtype == self.rows.dtype \
            and 0 < self.rows.shape[self.dim] and x.shape[self.dim] % self.rows.shape[self.dim] == 0

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        """The linear of the whole gathered ``x``: these rows, and the other ranks' computed now."""
        dim, size = self.dim, self.rows.shape[self.dim]
        out = x.new_empty((*x.shape[:-1], self.rows.shape[-1]))
        for k in range(x.shape[dim] // size):
            part = self.rows if k == self.rank else F.linear(  # (on a matrix of rows, as this rank's)
                x.narrow(dim, k * size, size).contiguous(), self.weight, self.bias)
            out.narrow(dim, k * size, size).copy_(part)
        return out


def _versions(module: nn.Linear) -> tuple:
    """The version counters of a linear's parameters and their local tensors (an in-place op
    on a DTensor counts on the DTensor alone; one on its local tensor, on that alone)."""
    return tuple(None if p is None else (p._version, _local(p)._version) for p in (module.weight, module.bias))


def _ahead(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``module``'s rows can be computed from ``x`` before its forward: a plain
    nn.Linear (not an FSDP unit, whose parameters are gathered in its own forward) on DTensor
    parameters of a matching width and dtype, with no forward pre-hook (which may change its
    weight in ways no version counter sees: ``weight.data``), no autocast."""
    return type(module) is nn.Linear and not pre_hooked(module) \
        and direct(x) and isinstance(module.weight, DTensor) and _local(module.weight).shape[-1] == x.shape[-1] \
        and _local(module.weight).dtype == x.dtype and (module.bias is None or isinstance(module.bias, DTensor))


class Siblings:
    """The linears that ``linear`` computes for one parent module (``modules``), and the
    ``Later`` of the window its last forward ran (None: none yet). A linear that is an FSDP
    unit of its own neither hands its gradients to another nor takes theirs (FSDP reduces a
    unit's gradients once its input gradient is in)."""

    __slots__ = ("modules", "later")

    def __init__(self, modules: tuple):
        self.modules, self.later = modules, None

    def params(self, window: nn.Module) -> tuple:
        """The parameters of the other modules that their gradients need (for ``window``)."""
        found = {id(p): p for m in self.modules if m is not window and not isinstance(m, FSDPModule)
                 for p in (m.weight, m.bias) if p is not None and p.requires_grad}  # (a tied one once)
        return tuple(found.values())


def _autocast(device: str) -> bool:
    return torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)


def overlapping(node) -> tuple | None:
    """Where the running backward ``node`` is a ``linear``'s that starts a move's collective
    early: ``(the move's sequence number, how many linears' weight gradients it computes
    while the collective runs)``; else None."""
    if not (isinstance(node, _Linear._backward_cls) and node.inbox is not None):
        return None
    later = node.later.entries.get(torch._C._current_graph_task_id(), ()) if node.window else ()
    return node.inbox.seq, int(any(node.needs_input_grad[1:3])) + len(later)


class _View(torch.autograd.Function):
    """A DTensor parameter's local shard; its gradient flows back as a DTensor laid out
    ``spec`` (DTensor's own ``to_local``, without re-deriving the spec every backward)."""

    @staticmethod
    def forward(ctx, param, spec):
        ctx.spec = spec
        return local_tensor(param).view_as(local_tensor(param))

    @staticmethod
    def backward(ctx, grad):
        _first_order("a parameter's local shard")
        return DTensor(grad.contiguous(), ctx.spec, requires_grad=False), None


def param_slots(module: nn.Module, owned: tuple) -> tuple:
    """``(table, name, full name)`` of every slot holding one of the ``owned`` parameters (or
    placed buffers) of the module and its submodules, ``table`` the owner's ``_parameters``
    or ``_buffers``; a tied parameter's slots under its first name."""
    names = {id(p): n for n, p in (*module.named_parameters(), *module.named_buffers())}
    owned = set(owned)
    return tuple((table, name, names[id(p)])
                 for _, owner in module.named_modules(remove_duplicate=False)
                 for table in (owner._parameters, owner._buffers)
                 for name, p in table.items()
                 if p is not None and id(p) in names and names[id(p)] in owned)


def local_params(slots: tuple, kernel, mesh, cache: dict) -> list:
    """The local views the module computes with: ``(table, name, view)`` for every DTensor
    parameter (or buffer) in ``slots`` (``param_slots``); a tied parameter gets one view.
    ``cache`` keeps the gradient specs seen before."""
    grads = dict(kernel.grads)
    made, views = {}, []
    for owner, name, full in slots:
        param = owner[name]
        if not isinstance(param, DTensor):
            continue
        view = made.get(id(param))
        if view is None:
            view = _view(param, grads.get(full), cache)
            if full == kernel.once and mesh.size() > 1:
                # one term of a sum over the ranks, its gradient whole (DTensor's
                # Replicate -> Partial, so the numbers match)
                view = scaled(view, mesh.size(), 1)
            made[id(param)] = view
        views.append((owner, name, view))
    return views


def _grads(param: DTensor, grad):
    """The torch placements of a local gradient laid out ``grad``; ``Partial()`` is partial
    where the parameter is replicated (a head replicated over a group: within the group)."""
    if isinstance(grad, Partial):
        return tuple(_dt.Partial(grad.op) if p.is_replicate() else p for p in param.placements)
    return to_torch(grad)


def _grad_spec(param: DTensor, grad, cache: dict) -> DTensorSpec:
    """The spec of ``param``'s gradient laid out ``grad`` (None: as the parameter)."""
    grads = None if grad is None else _grads(param, grad)
    key = (spec_of(param), grads)
    spec = cache.get(key)
    if spec is None:
        spec = cache[key] = spec_of(param) if grads is None or grads == param.placements else \
            DTensorSpec(param.device_mesh, grads, tensor_meta=spec_of(param).tensor_meta)
    return spec


def _view(param: DTensor, grad, cache: dict):
    if torch.compiler.is_compiling():
        return param.to_local(grad_placements=None if grad is None else _grads(param, grad))
    if param.requires_grad and torch.is_grad_enabled():
        return _View.apply(param, _grad_spec(param, grad, cache))
    return local_tensor(param)


def vocab_mask(ids: torch.Tensor, module: nn.Embedding, mesh, what: str):
    """(local ids, mask of ids outside this rank's vocabulary slice), as DTensor computes them;
    an id outside the whole vocabulary raises on every rank, as on one device."""
    n = module.num_embeddings
    assert_async(((ids >= 0) & (ids < n)).all(),
                 f"{what}: an id lies outside the vocabulary [0, {n}) (index out of range in self)")
    return _vocab_slice(ids, n, mesh.size(), mesh.get_coordinate()[0])


@per_rank  # LocalTensorMode: each simulated rank its own slice
def _vocab_slice(ids: torch.Tensor, n: int, k: int, rank: int):
    offset, size = chunk_bounds(n, k, rank)
    mask = (ids < offset) | (ids >= offset + size)
    return (ids - offset).masked_fill(mask, 0), mask


def dropout_slice(module: nn.Dropout, local: torch.Tensor, global_shape: tuple, dim: int, mesh):
    """This rank's slice of the dropout noise (mask / (1 - p)) one device draws for the
    whole tensor: the same draws from the default generator, so the ranks stay in step."""
    whole = torch.ones(global_shape, dtype=local.dtype, device=local.device)
    noise = nn.functional.dropout(whole, module.p, training=True)
    return _noise_slice(noise, dim, local.shape[dim], mesh.size(), mesh.get_coordinate()[0])


@per_rank  # LocalTensorMode: each simulated rank its own slice
def _noise_slice(noise: torch.Tensor, dim: int, size: int, k: int, rank: int) -> torch.Tensor:
    start, _ = chunk_bounds(noise.shape[dim], k, rank)
    return noise.narrow(dim, start, size).clone()  # frees the rest of the noise
