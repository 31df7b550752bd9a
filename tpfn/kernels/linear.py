"""The linear kernel: an ``nn.Linear`` on its local shards in one autograd node, its input's move inside.

Protocol. For a bound module whose row names this kernel (``Kernel.fast == "linear"``), the
interpreter calls ``linear(runtime, x, shape)`` with input 0 as it arrives (laid out as its slot's
source, of global ``shape``) before the reference route. The kernel returns None where it cannot
give what that route gives, and the interpreter takes the route for this call; else it returns
``(local output, the moved input or None)``, the output then handed to the module's output slot as on the
reference route. It takes a call with one plain tensor in eager mode, without autocast, on DTensor
parameters of that tensor's dtype (a slot whose gradient is handed back as terms makes its local
move first, ``tpfn.interpret.terms``).

Forward: the slot's move (an all-gather of a sequence shard; nothing for a replica), then
``x @ W.T + b`` on the parameters' local shards (a replicated bias divided among the ranks where the
output is a partial sum, as the reference route divides its view). Backward: the input gradient
``g @ W``; its move back started (Megatron's f: the all-reduce of a replica's partial sums, the
reduce-scatter of a sequence), the weight and bias gradients computed while it runs (``overlap``;
else after it), then the wait. The reference route's products on the same operands.

What observers see is the reference route's: the moved input is the node's own (hooks,
``retain_grad`` and ``autograd.grad`` see the input as it arrives, and its whole gradient); the node
saves the DTensor weight itself where one device's linear saves the weight (for the input's
gradient), so an in-place step on it between forward and backward raises autograd's error where
one device's does; a frozen parameter gets no gradient and no hook call.

Column group (``Group``). Column-wise linears of one parent that read the parent's local replica
of an input (q, k and v; gate and up) can sum their partial input gradients before one reduction
instead of each reducing its own: one all-reduce for q, k and v, not three. Within autograd's
contract: the parent's slot makes the replica (``Group.replicate``: a node whose backward reduces
what reaches it), each reader's node hands its partial gradient to autograd, which sums them into
the replica's gradient. That is right only while nothing else reads or observes the replica, so the
readers leave their gradients partial only where, as the parent's forward ended, every path back
from its outputs to the replica passed through a reader's node, no tensor hook or ``retain_grad``
was on the replica, and no reader had a user's module hook (which could keep the replica or read
its partial gradient; torch's module trackers, which wrap every module's inputs, only observe).
Otherwise every
reader reduces its own gradient and the replica's node passes whole gradients on, as on the
reference route. A replica the parent's own code keeps past its forward and reads later is not seen.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tpfn._torch import hooked, local_tensor, sequence_nr, spec_of, tensor_observed, will_run
from tpfn.algebra import cotangent
from tpfn.interpret.moves import first_order, grad_spec, move, steps, unhooked
from tpfn.interpret.terms import terms
from tpfn.layout import Partial, Replicate

__all__ = ["kernel", "Group"]

_REPLICA, _PARTIAL = Replicate(), Partial()  # made once


def _local(t):
    return t if t is None else local_tensor(t)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a matrix of its last dim (not ``reshape(-1, d)``: a rank's shard may be empty)."""
    return t.reshape(t.shape[:-1].numel(), t.shape[-1])


def _autocast(device: str) -> bool:
    return torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)


def _product(x, weight, bias, share: int):
    """``F.linear`` on the parameters' local tensors, the bias divided by ``share``."""
    b = _local(bias)
    return F.linear(x, _local(weight), b if share == 1 or b is None else b / share)


class _Linear(torch.autograd.Function):
    """``x`` moved by ``forward`` (a ``_Step``, None: as it is), then ``F.linear`` on the local
    shards of DTensor ``weight`` and ``bias``; backward hands the weight and bias gradients back
    as DTensors laid out ``specs``, and the input gradient moved by ``backward`` (started before
    the weight gradient where ``overlap``), or left partial where the group's ``token`` says so."""

    @staticmethod
    def forward(ctx, x, weight, bias, forward, backward, specs, share, overlap, token, what, keep):
        moved = x if forward is None else forward(x, what)
        # what one device's linear saves: the weight for the input's gradient, the input for the weight's
        need = ctx.needs_input_grad
        ctx.save_for_backward(moved if need[1] else None, weight if need[0] else None)
        ctx.shape = moved.shape
        ctx.backward, ctx.specs, ctx.overlap, ctx.token, ctx.what = backward, specs, overlap, token, what
        ctx.overlaps = 0  # (``tpfn.explain``: 1 where the weight gradients run while its move back does)
        if keep is not None:
            keep.append(moved)
        return _product(moved, weight, bias, share)

    @staticmethod
    def backward(ctx, grad):
        first_order("an nn.Linear's local shards")
        x, weight = ctx.saved_tensors
        g, gx, wait = _rows(grad), None, None
        if ctx.needs_input_grad[0] and will_run(ctx.next_functions[0][0]):  # (else no one takes it)
            gx = g.mm(local_tensor(weight)).view(ctx.shape)
            if ctx.backward is not None and not (ctx.token is not None and ctx.token.partial):
                ctx.overlaps = int(ctx.overlap and any(ctx.needs_input_grad[1:3]))
                wait = ctx.backward.start(gx, f"the gradient of {ctx.what}")
                if not ctx.overlap:
                    gx, wait = wait(), None
        wspec, bspec = ctx.specs
        gw = _as(g.t().mm(_rows(x)), wspec) if ctx.needs_input_grad[1] else None
        gb = _as(g.sum(0), bspec) if ctx.needs_input_grad[2] else None
        if wait is not None:
            gx = wait()
        return gx, gw, gb, None, None, None, None, None, None, None, None


def _as(grad: torch.Tensor, spec):
    return DTensor(grad, spec, requires_grad=False)


def kernel(runtime, x, shape):
    """``runtime``'s ``nn.Linear`` on ``x`` (input 0 as it arrives, of global ``shape``) as this
    kernel computes it: ``(local output, moved input)`` (the moved input where ``runtime.starts``
    observes it, else None), or None (the reference route)."""
    module, mount, mesh = runtime.module, runtime.mount, runtime.mesh
    weight, bias = module.weight, module.bias
    slot = mount.inputs.slots[0]
    if type(x) is not torch.Tensor or torch.compiler.is_compiling() or _autocast(x.device.type) \
            or not isinstance(weight, DTensor) \
            or not (bias is None or isinstance(bias, DTensor)) or local_tensor(weight).dtype != x.dtype:
        return None
    specs, share = _specs(runtime, weight, bias)
    what, grad = f"input 0 of {mount.where}", runtime.grads[0] if torch.is_grad_enabled() else None
    if slot.grad is not None:  # its gradient handed back as terms: that local move first
        x, forward, backward = terms(x, slot.source, slot.out, grad, slot.grad, mesh, what), None, None
    else:
        forward, backward = steps(slot.source, slot.out, grad, mesh, tuple(shape), x.dtype, runtime.cache)
    frozen = mesh.size() == 1 and not (weight.requires_grad or bias is not None and bias.requires_grad)
    if grad is None or frozen:  # (one rank, frozen: plain ops, as the reference's, differentiable twice)
        moved = x if forward is None else forward(x, what)
        return _product(moved, weight, bias, share), moved
    group = runtime.group
    token = None if group is None or hooked(module) else group.token(x)
    keep = None if runtime.starts is None else []
    out = _Linear.apply(x, weight, bias, forward, backward, specs, share, runtime.overlap, token, what, keep)
    if token is not None:
        token.readers.append(out.grad_fn)
    return out, (keep or (None,))[0]


def _specs(runtime, weight, bias) -> tuple:
    """``((the weight's gradient spec, the bias's), the bias's share)`` for these parameters."""
    key = ("linear", spec_of(weight), None if bias is None else spec_of(bias))
    found = runtime.cache.get(key)
    if found is None:
        kernel, n = runtime.mount.kernel, runtime.mesh.size()
        grads = dict(kernel.grads)
        specs = tuple(None if p is None else grad_spec(p, grads.get(name), runtime.cache)
                      for name, p in (("weight", weight), ("bias", bias)))
        share = n if kernel.once == "bias" and bias is not None and n > 1 else 1
        found = runtime.cache[key] = (specs, share)
    return found


class _Token:
    """One replica of one forward of a group's parent: its node, its readers' nodes, and whether
    the readers leave their gradients partial (decided as the parent's forward ends)."""

    __slots__ = ("replica", "node", "readers", "partial")

    def __init__(self):
        self.replica = self.node = None
        self.readers, self.partial = [], False

    def decide(self, outputs) -> None:
        replica, self.replica = self.replica, None
        readers, self.readers = self.readers, []
        node, self.node = self.node, None
        self.partial = outputs is not None and bool(readers) and not tensor_observed(replica) \
            and _only_through(outputs, node, readers)


class _Replica(torch.autograd.Function):
    """A parent's local replica of an input for its group's readers: forward, the slot's move;
    backward, the move back of a partial sum (the readers' gradients) or of a whole gradient."""

    @staticmethod
    def forward(ctx, x, forward, partial_back, whole_back, token, what):
        ctx.set_materialize_grads(False)
        ctx.partial_back, ctx.whole_back, ctx.token, ctx.what = partial_back, whole_back, token, what
        return x.detach() if forward is None else forward(x, what)  # (see _Move)

    @staticmethod
    def backward(ctx, grad):
        first_order(ctx.what)
        back = ctx.partial_back if ctx.token.partial else ctx.whole_back
        if grad is not None and back is not None:
            grad = back(grad, f"the gradient of {ctx.what}")
        return grad, None, None, None, None, None


class Group:
    """The column-wise linears of one parent that may read its local replicas as they are
    (``parallelize`` makes one per parent and hands it to the parent's runtime and theirs).
    ``open()`` and ``close(outputs)`` bracket each forward of the parent."""

    __slots__ = ("calls",)

    def __init__(self):
        self.calls: list = []  # per running forward of the parent: {id(replica): _Token}

    def open(self) -> None:
        self.calls.append({})

    def close(self, outputs=None) -> None:
        """End the parent's innermost forward; ``outputs``: what it returned (None: it raised,
        and every reader reduces its own gradient)."""
        for token in self.calls.pop().values():
            token.decide(outputs)

    def replicate(self, x, src, mesh, shape: tuple, what: str, cache: dict):
        """Local ``x`` laid out ``src`` made the replica the readers read (see the module docstring)."""
        if torch.compiler.is_compiling() or not self.calls:  # (traced: the slot's own move)
            return move(x, src, _REPLICA, cotangent(_REPLICA)[0], mesh, shape, what, cache)
        forward, _ = steps(src, _REPLICA, None, mesh, shape, x.dtype, cache)
        if not (x.requires_grad and torch.is_grad_enabled()):
            return x if forward is None else forward(x, what)
        target = cotangent(src)
        partial_back, _ = steps(_PARTIAL, target, None, mesh, shape, x.dtype, cache)
        whole_back, _ = steps(_REPLICA, target, None, mesh, shape, x.dtype, cache)
        token = _Token()
        out = _Replica.apply(x, forward, partial_back, whole_back, token, what)
        token.replica, token.node = out, out.grad_fn
        self.calls[-1][id(out)] = token
        return out

    def token(self, x) -> _Token | None:
        """The token of ``x`` where it is a replica of the parent's running forward, or that
        replica seen through module hooks' identity wrappers (else None)."""
        tokens = self.calls[-1] if self.calls else {}
        token = tokens.get(id(x))
        if token is not None and token.replica is x:
            return token
        node, nr = unhooked(x.grad_fn, x.output_nr)
        return next((t for t in tokens.values() if t.node is node), None) if nr == 0 else None


def _only_through(outputs, node, readers: list) -> bool:
    """Whether every autograd path back from ``outputs`` to ``node`` passes through ``readers``
    (only nodes made since ``node`` can read it; False for outputs that are not tensors,
    containers of them or plain values)."""
    first, stack, seen = sequence_nr(node), [], {id(r): r for r in readers}
    if not _roots(outputs, stack):
        return False
    while stack:
        n = stack.pop()
        if n is None or id(n) in seen:
            continue
        if n is node:
            return False
        seen[id(n)] = n  # (held: a node's Python object may be made anew at each look)
        if sequence_nr(n) >= first:
            stack.extend(f for f, _ in n.next_functions)
    return True


def _roots(value, stack: list) -> bool:
    """Push the autograd nodes of the tensors in ``value``; False where it holds anything else."""
    if isinstance(value, torch.Tensor):
        stack.append(value.grad_fn)
    elif isinstance(value, (tuple, list)):
        return all(_roots(v, stack) for v in value)
    elif isinstance(value, dict):
        return all(_roots(v, stack) for v in value.values())
    elif not (value is None or isinstance(value, (bool, int, float, str))):
        return False
    return True

