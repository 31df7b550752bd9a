"""The linear kernel: an ``nn.Linear`` on its local shards in one autograd node, its input's move inside.

Protocol. For a bound module whose row names this kernel (``Meaning.fast == "linear"``), the
runtime first offers each call to ``call``, which computes it and returns the module's output,
handed on through its output slots as on the reference route; or returns None, and the reference
route computes the call. It takes a call with one plain tensor in eager mode, without autocast,
on DTensor parameters of that tensor's dtype. ``linear(x, weight, bias, move, ...)`` is the
kernel itself, on explicit values, as Megatron's linear.

Forward: the input's move (an all-gather of a sequence shard; nothing for a replica), then
``x @ W.T + b`` on the parameters' local shards (a replicated bias divided among the ranks where
the output is a partial sum, as the reference route divides its view), as one 2-D product whose
rows are handed on in the input's shape as ATen's own linear hands them (a view of them for a
contiguous input of 3 or more dims with a bias, else none autograd tracks): an in-place op on
the output (``ReLU(inplace=True)``) and a hook on it behave as on one device. Backward: the
input gradient ``g @ W``; its move back started (Megatron's f: the all-reduce of a replica's
partial sums, the reduce-scatter of a sequence), the weight and bias
gradients computed while it runs (``overlap``; else after it), then the wait. The reference
route's products on the same operands.

Partial sums handed over: where the input is a local replica whose node takes partial sums of
its gradient (q, k and v reading their parent's replica; ``tpfn.interpret.moves.Moved``), the
kernel hands it its partial input gradient instead of reducing it, and that node reduces every
reader's in one collective with the whole gradient autograd brings it. It does so only where no
one can see the partial sum: no module hook of the user's on this linear, no tensor hook or
``retain_grad`` on the replica, and the replica's node runs in this backward.

What observers see is the reference route's: the moved input is the node's own (hooks,
``retain_grad`` and ``autograd.grad`` see the input as it arrives, and its whole gradient); the node
saves the DTensor weight itself where one device's linear saves the weight (for the input's
gradient), so an in-place step on it between forward and backward raises autograd's error where
one device's does; a frozen parameter gets no gradient and no hook call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tpfn._torch import hooked, local_tensor, spec_of, tensor_observed, unsafe_view, will_run
from tpfn.interpret.moves import Moved, first_order, grad_spec
from tpfn.layout import Partial, Replicate

__all__ = ["linear", "call", "shaped"]

_WHOLE, _PARTIAL = Replicate(), Partial()


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a matrix of its last dim (not ``reshape(-1, d)``: a rank's shard may be empty)."""
    return t.reshape(t.shape[:-1].numel(), t.shape[-1])


def _product(x, weight, bias, share: int):
    """``F.linear`` of the rows of ``x`` on the parameters' local tensors, the bias divided by ``share``."""
    b = None if bias is None else local_tensor(bias)
    return F.linear(_rows(x), local_tensor(weight), b if share == 1 or b is None else b / share)


class _Linear(torch.autograd.Function):
    """See the module docstring; the output is the rows of the product (2-D)."""

    @staticmethod
    def forward(ctx, x, weight, bias, move, specs, share, overlap, hand, what, keep):
        moved = move.run(x, what) if move.steps else x
        need = ctx.needs_input_grad
        # what one device's linear saves: the weight for the input's gradient, the input for the weight's
        ctx.save_for_backward(moved if need[1] else None, weight if need[0] else None, x if hand else None)
        ctx.shape, ctx.move, ctx.specs, ctx.overlap, ctx.what = moved.shape, move, specs, overlap, what
        if keep is not None:
            keep.append(moved)
        return _product(moved, weight, bias, share)

    @staticmethod
    def backward(ctx, grad):
        first_order(ctx.what, grad)
        moved, weight, x = ctx.saved_tensors
        need, gx, wait = ctx.needs_input_grad, None, None
        if need[0] and will_run(ctx.next_functions[0][0]):  # (else no one takes it)
            gx = grad.mm(local_tensor(weight)).view(ctx.shape)
            node = None if x is None or tensor_observed(x) else Moved.of(x, ctx.move.mesh)
            if node is not None and will_run(node):
                Moved.hand(node, gx)  # reduced once with the other readers' by the replica's node
                gx = None
            elif ctx.move.back:
                ctx.metadata["overlaps"] = int(ctx.overlap and any(need[1:3]))  # (tpfn.explain reads it)
                wait = ctx.move.pulled(gx, ctx.what, wait=not ctx.overlap)
                if not ctx.overlap:
                    gx, wait = wait, None
        wspec, bspec = ctx.specs
        gw = DTensor(grad.t().mm(_rows(moved)), wspec, requires_grad=False) if need[1] else None
        gb = DTensor(grad.sum(0), bspec, requires_grad=False) if need[2] else None
        if wait is not None:
            gx = wait()
        return gx, gw, gb, None, None, None, None, None, None, None


def linear(x, weight, bias, move, specs: tuple, *, share: int = 1, overlap: bool = True, hand: bool = False,
           what: str = "input 0", keep: list | None = None) -> torch.Tensor:
    """``x`` (local, as it arrives) moved by ``move`` (a ``tpfn.interpret.moves.Move`` to the
    layout the linear computes with), times the local shards of DTensor ``weight`` and ``bias``;
    the gradients of the weight and the bias handed back as DTensors laid out ``specs``, the
    bias divided by ``share``. ``hand``: the input gradient may be handed, unreduced, to the node
    of the replica ``x`` (see the module docstring). ``keep`` gets the moved input."""
    lead = (move.shape if move.steps else x.shape)[:-1]
    trains = weight.requires_grad or bias is not None and bias.requires_grad
    if torch.is_grad_enabled() and (trains or x.requires_grad and move.mesh.size() > 1):
        out = _Linear.apply(x, weight, bias, move, specs, share, overlap, hand, what, keep)
    else:  # no gradients, or frozen on one rank: plain ops, as the reference's (differentiable twice)
        moved = move.run(x, what) if move.steps else x
        if keep is not None:
            keep.append(moved)
        out = _product(moved, weight, bias, share)
    return shaped(out, lead, bias is not None and (bool(move.steps) or x.is_contiguous()))


def shaped(rows: torch.Tensor, lead: tuple, views: bool) -> torch.Tensor:
    """The product's ``rows`` in the input's shape (``lead``, then the features), as ATen's own
    linear hands them on: for an input of 3 or more dims, contiguous with a bias (``views``), a
    view; else none autograd tracks (what hooks and in-place ops see follows from it)."""
    if len(lead) == 1:
        return rows
    return rows.view(*lead, rows.shape[-1]) if views else unsafe_view(rows, (*lead, rows.shape[-1]))


def _autocast(device: str) -> bool:
    return torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)


def call(c):
    """The call ``c`` (``tpfn.interpret.reference.Call``) of a bound ``nn.Linear``, computed by
    ``linear`` and handed through its output slots; None where the reference route computes it."""
    rt = c.rt
    mount, module = rt.mount, rt.module
    x, weight, bias = (c.args[0] if len(c.args) == 1 and not c.kwargs else None), module.weight, module.bias
    slot = mount.inputs.slots[0] if mount.inputs.slots else None
    if type(x) is not torch.Tensor or slot is None or slot.untouched or torch.compiler.is_compiling() \
            or _autocast(x.device.type) or not isinstance(weight, DTensor) \
            or not (bias is None or isinstance(bias, DTensor)) or local_tensor(weight).dtype != x.dtype:
        return None
    shape = c.shape()
    grad = mount.shards.grads[0] if torch.is_grad_enabled() else None
    move = rt.move(slot.source, slot.out, grad, shape, x.dtype, to=slot.grad)
    if move.steps and move.dst != _WHOLE:
        return None
    specs, share, what = _specs(rt, weight, bias)
    hand = rt.reads and grad is not None and not hooked(module)
    observer = rt.state.observer
    keep = [] if observer is not None else None
    out = linear(x, weight, bias, move, specs, share=share, overlap=rt.overlap, hand=hand, what=what, keep=keep)
    if observer is not None:
        node = out.grad_fn.next_functions[0][0] if out.grad_fn is not None else None
        observer.computes(rt, (keep[0],), {}, (node,))
    return c.finish(out, shape)


def _specs(rt, weight, bias) -> tuple:
    """``((the weight's gradient spec, the bias's), the bias's share, input 0's name)``, made once
    per parameters' specs."""
    key = ("linear", spec_of(weight), None if bias is None else spec_of(bias))
    found = rt.cache.get(key)
    if found is None:
        mount, n = rt.mount, rt.mesh.size()
        grads = dict(mount.shards.param_grads)
        specs = tuple(None if p is None else grad_spec(p, grads.get(name), rt.cache)
                      for name, p in (("weight", weight), ("bias", bias)))
        share = n if mount.row.once == "bias" and bias is not None else 1
        found = rt.cache[key] = (specs, share, f"input 0 of {mount.where}")
    return found
