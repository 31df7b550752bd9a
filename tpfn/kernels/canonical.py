"""The linear kernel in invariant mode: every product of an ``nn.Linear`` chunk by chunk, in the canonical order.

Protocol. In invariant mode (``parallelize(..., invariant=True)``) the runtime gives every call of
a bound ``nn.Linear`` whose row names the linear kernel to ``call``, which computes it and hands
its output through its output slots; it never steps aside (the reference route has no canonical
order), and a call it cannot take raises an error naming the module. ``linear(x, weight, bias,
move, geometry, ...)`` is the kernel on explicit values.

The sharded dim of the weight (a column-wise linear's output features, a row-wise one's input
features) is cut into ``chunks`` equal chunks (``tpfn.tree``), the same whatever the degree; each
product is one matrix product per chunk, its operands contiguous and of the same shape on
whichever rank holds the chunk, so each chunk's numbers do not depend on the degree:

- column-wise: forward, ``X @ W_c.T + b_c`` per chunk ``c`` of the output, side by side; backward,
  the weight's and bias's gradients per chunk, and the input's gradient as one *leaf* per chunk,
  ``G_c @ W_c``, for the leaves this rank holds (``tpfn.tree.leaves``): added by the tree (its
  subtree's root), then by the move of its slot across the ranks (``Move.tree``), or handed to the
  replica its parent made (``tpfn.interpret.moves.Moved``), which adds every reader's leaf ``c``
  first, then the leaves by the tree;
- row-wise: forward, one leaf per chunk of the input features, ``X_c @ W_c.T`` (the bias added to
  leaf 0, on the rank that holds it), added by the tree, then across the ranks by the output
  slot's move; backward, the input's and weight's gradients per chunk, side by side, and the
  bias's, ``g.sum(0)``, whole on every rank.

Key and value heads replicated over two ranks (``colwise(heads=h)`` on ``2h`` ranks): each of the
two holds the gradient of its query head's share; their sum (two terms: one order) is taken
before the products, so the heads' gradients are whole on both, and each adds only the leaves
of its own range. Nothing else changes: the moves are the slots', the observers see what the
linear kernel shows (``tpfn.kernels.linear``), the node saves the DTensor weight where the input
needs a gradient and the input where the weight does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tpfn._torch import hooked, local_tensor, spec_of, tensor_observed, will_run
from tpfn.algebra import shard_ranges
from tpfn.bounded import Bound, all_reduce
from tpfn.errors import ModuleError
from tpfn.interpret.moves import Moved, first_order
from tpfn.kernels.linear import shaped
from tpfn.layout import Shard
from tpfn.tree import leaves, pieces, total

__all__ = ["Geometry", "linear", "call"]


class Geometry:
    """Where a rank's chunks of ``chunks`` lie: ``row`` (the weight's input features are cut; else
    its output features), this rank's ``leaves`` (a range), the chunks it holds (``held``, from its
    first, ``first``), a bias added to leaf 0 here (``bias_here``), and the ``Bound`` of the two
    ranks that replicate its heads (``pair``; None: none)."""

    __slots__ = ("row", "leaves", "held", "first", "bias_here", "pair")

    def __init__(self, layout: Shard, size: int, chunks: int, n: int, rank: int, pair=None):
        self.row, self.leaves = layout.dim % 2 == 1, leaves(chunks, n, rank)
        (start, length), = shard_ranges(size, layout, n, rank)
        width = size // chunks
        self.first, self.held = start // width, length // width
        self.bias_here, self.pair = self.leaves.start == 0, pair


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous matrix of its last dim."""
    return t.reshape(t.shape[:-1].numel(), t.shape[-1]).contiguous()


def _forward(x: torch.Tensor, w: torch.Tensor, b, geo: Geometry) -> torch.Tensor:
    """The product of the rows ``x`` and the local weight ``w`` (and bias ``b``), chunk by chunk:
    a column-wise linear's output, or a row-wise one's partial sum (this rank's subtree's root)."""
    if geo.row:
        leaves_ = [xc.mm(wc.t()) for xc, wc in zip(pieces(x, 1, geo.held), pieces(w, 1, geo.held))]
        if b is not None and geo.bias_here:
            leaves_[0].add_(b)
        return total(leaves_)
    width = w.shape[0] // geo.held
    outs = [F.linear(x, w[i * width:(i + 1) * width], None if b is None else b[i * width:(i + 1) * width])
            for i in range(geo.held)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, -1)


class _Canonical(torch.autograd.Function):
    """See the module docstring; the output is the rows of the product (2-D)."""

    @staticmethod
    def forward(ctx, x, weight, bias, move, geo, specs, overlap, hand, what, keep):
        moved = move.run(x, what) if move.steps else x
        need = ctx.needs_input_grad
        # what one device's linear saves: the weight for the input's gradient, the input for the weight's
        ctx.save_for_backward(moved if need[1] else None, weight if need[0] else None, x if hand else None)
        ctx.shape, ctx.move, ctx.geo, ctx.specs, ctx.overlap, ctx.what = moved.shape, move, geo, specs, overlap, what
        if keep is not None:
            keep.append(moved)
        return _forward(_rows(moved), local_tensor(weight), None if bias is None else local_tensor(bias), geo)

    @staticmethod
    def backward(ctx, grad):
        first_order(ctx.what, grad)
        moved, weight, x = ctx.saved_tensors
        need, geo, wait = ctx.needs_input_grad, ctx.geo, None
        g = grad.contiguous()
        if geo.pair is not None:  # the two ranks of a head: its gradient whole on both (two terms)
            g = all_reduce(g, "sum", geo.pair, own=g is not grad)
        rows = _rows(moved) if moved is not None else None
        wspec, bspec = ctx.specs
        if geo.row:
            w = pieces(local_tensor(weight), 1, geo.held) if weight is not None else None
            gx = torch.cat([g.mm(wc) for wc in w], -1).view(ctx.shape) if need[0] else None
            gw = DTensor(torch.cat([g.t().mm(xc) for xc in pieces(rows, 1, geo.held)], -1), wspec,
                         requires_grad=False) if need[1] else None
            gb = DTensor(g.sum(0), bspec, requires_grad=False) if need[2] else None
            if gx is not None and ctx.move.back:
                gx = ctx.move.pulled(gx, ctx.what)
            return gx, gw, gb, None, None, None, None, None, None, None
        parts = pieces(g, 1, geo.held)  # the gradient of each output chunk
        gx = None
        if need[0] and will_run(ctx.next_functions[0][0]):  # (else no one takes it)
            w, width = local_tensor(weight), g.shape[1] // geo.held
            mine = [parts[c - geo.first].mm(w[(c - geo.first) * width:(c - geo.first + 1) * width]).view(ctx.shape)
                    for c in geo.leaves]
            node = None if x is None or tensor_observed(x) else Moved.of(x, ctx.move.mesh)
            if node is not None and will_run(node):
                Moved.hand(node, mine)  # each leaf added to the other readers', then the tree, by the replica
            else:
                gx = total(mine)
                if ctx.move.back:
                    ctx.metadata["overlaps"] = int(ctx.overlap and any(need[1:3]))  # (tpfn.explain reads it)
                    wait = ctx.move.pulled(gx, ctx.what, wait=not ctx.overlap)
                    if not ctx.overlap:
                        gx, wait = wait, None
        gw = DTensor(torch.cat([p.t().mm(rows) for p in parts]), wspec, requires_grad=False) if need[1] else None
        gb = DTensor(torch.cat([p.sum(0) for p in parts]), bspec, requires_grad=False) if need[2] else None
        if wait is not None:
            gx = wait()
        return gx, gw, gb, None, None, None, None, None, None, None


def linear(x, weight, bias, move, geo: Geometry, specs: tuple, *, overlap: bool = True, hand: bool = False,
           what: str = "input 0", keep: list | None = None) -> torch.Tensor:
    """``x`` (local, as it arrives) moved by ``move`` (a ``tpfn.interpret.moves.Move`` to the layout the
    linear computes with), times the local shards of DTensor ``weight`` and ``bias`` chunk by chunk
    as ``geo`` places them (the module docstring); the gradients of the weight and the bias handed
    back as DTensors laid out ``specs``. ``hand``: the input's leaves may be handed to the node of the
    replica ``x``. ``keep`` gets the moved input."""
    lead = (move.shape if move.steps else x.shape)[:-1]
    trains = weight.requires_grad or bias is not None and bias.requires_grad
    if torch.is_grad_enabled() and (trains or x.requires_grad):  # (its backward's sums are the tree's too)
        out = _Canonical.apply(x, weight, bias, move, geo, specs, overlap, hand, what, keep)
    else:  # no gradient to compute: the same products
        moved = move.run(x, what) if move.steps else x
        if keep is not None:
            keep.append(moved)
        out = _forward(_rows(moved), local_tensor(weight), None if bias is None else local_tensor(bias), geo)
    return shaped(out, lead, bias is not None and (bool(move.steps) or x.is_contiguous()))


def _refused(rt, x) -> str | None:
    """What keeps the kernel from computing a call with input ``x`` (None: nothing)."""
    weight, bias = rt.module.weight, rt.module.bias
    if type(x) is not torch.Tensor:
        if isinstance(x, DTensor):
            return ("a local tensor, and got a DTensor, whose gradient DTensor would sum; hand it a local "
                    "tensor (local=True on the style that makes it: prepare_in(..., local=True))")
        got = "simulated ranks' tensors" if isinstance(x, torch.Tensor) else "no single positional tensor"
        return f"one positional local tensor, and got {got}; pass the input by position as a plain tensor"
    if torch.compiler.is_compiling():
        return "eager mode, and torch.compile traces DTensor's operations instead, whose sums it orders; run eagerly"
    if torch.amp.is_autocast_available(x.device.type) and torch.is_autocast_enabled(x.device.type):
        return "no autocast, which casts each product on its own; cast the model (model.to(dtype)) instead"
    if not isinstance(weight, DTensor) or not (bias is None or isinstance(bias, DTensor)):
        return "its parameters as parallelize placed them (DTensors)"
    if local_tensor(weight).dtype != x.dtype:
        return f"an input of its weight's dtype ({local_tensor(weight).dtype}), not {x.dtype}"
    return None


def call(c):
    """The call ``c`` (``tpfn.interpret.reference.Call``) of a bound ``nn.Linear``, computed by
    ``linear`` and handed through its output slots."""
    rt = c.rt
    mount, module = rt.mount, rt.module
    x = c.args[0] if len(c.args) == 1 and not c.kwargs else None
    why = _refused(rt, x)
    if why is not None:
        raise ModuleError(f"{mount.where}: invariant mode computes this linear by its kernel, in the canonical "
                          f"order, which takes {why}.")
    weight, bias = module.weight, module.bias
    slot = mount.inputs.slots[0]
    shape = c.shape()
    grad = mount.shards.grads[0] if torch.is_grad_enabled() else None
    move = rt.move(slot.source, slot.out, grad, shape, x.dtype, to=slot.grad)
    geo, specs, what = _geometry(rt, weight, bias)
    hand = rt.reads and grad is not None and not hooked(module)
    observer = rt.state.observer
    keep = [] if observer is not None else None
    out = linear(x, weight, bias, move, geo, specs, overlap=rt.overlap, hand=hand, what=what, keep=keep)
    if observer is not None:
        node = out.grad_fn.next_functions[0][0] if out.grad_fn is not None else None
        observer.computes(rt, (keep[0],), {}, (node,))
    return c.finish(out, shape)


def _geometry(rt, weight, bias) -> tuple:
    """``(Geometry, (the weight's gradient spec, the bias's), input 0's name)``, made once per
    parameters' specs. Gradients are laid out as their parameters: a head replicated over two
    ranks gets its whole gradient on both."""
    key = ("canonical", spec_of(weight), None if bias is None else spec_of(bias))
    found = rt.cache.get(key)
    if found is None:
        mount, n = rt.mount, rt.mesh.size()
        layout = dict(mount.params)["weight"]
        size = weight.shape[layout.dim % 2]
        pair = None
        if layout.copies(n) > 1:  # the ranks of a head: dim 1 of the weight's 2-D view of the mesh
            pair = Bound(weight.device_mesh.get_group(1), rt.mesh.device_type, rt.state.bound.seconds)
        geo = Geometry(layout, size, rt.tree, n, rt.mesh.get_coordinate()[0], pair)
        specs = (spec_of(weight), None if bias is None else spec_of(bias))
        found = rt.cache[key] = (geo, specs, f"input 0 of {mount.where}")
    return found
