"""Invariant mode: what it refuses, and a sequence-parallel module's tokens in canonical chunks.

``parallelize(..., invariant=True)`` makes every sum tpfn performs or causes over a dim the
ranks split follow the canonical tree (``tpfn.tree``), so that a step gives the same bits at
every degree, one rank included. Where the sums are:

- a linear's products (``colwise()``, ``rowwise()``): its kernel in invariant mode
  (``tpfn.kernels.canonical``) computes one product per chunk of the contracted dim;
- the moves of partial sums (a row-wise output, a column-wise input's gradient, a replica's
  readers' gradients): by the tree (``tpfn.interpret.moves.Move.tree``, ``tpfn.bounded.TREE``);
- the gradients of a module's replicated parameters summed over the positions of a sequence
  (sequence-parallel norms): ``by_tokens`` runs its forward once per chunk of the sequence, each
  with its own alias of the parameters, and adds their gradients by the tree; the ranks' roots
  are added by the tree at the end of the backward (``tpfn.interpret.state``);
- an embedding's partial sums have one term per element that is not zero (its vocabulary's
  rows, or its columns): any order adds them exactly.

What computes sums tpfn cannot order (a module's own forward on partial sums, DTensor's ops) is
refused by name before anything changes (``problems``). Key and value heads replicated over two
ranks give one rank's bits only where the model repeats them right after projecting them: the
model sums its query heads' gradients of a head where it repeats it, tpfn at the projection's
output (``caveats`` names them).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tpfn._fqn import generalize
from tpfn.errors import LayoutError
from tpfn.layout import Partial, Shard
from tpfn.tree import fits, total

__all__ = ["problems", "caveats", "sums_positions", "by_tokens"]


def problems(modules: dict, mounts: tuple, n: int, chunks: int) -> list:
    """What keeps the plan (``mounts``, ``{fqn: module}``) from giving the same bits at every
    degree on ``n`` ranks with ``chunks`` chunks, one line each (empty: nothing)."""
    why = fits(n, chunks)
    if why is not None:
        return [f"{why}: parallelize over 1, 2, 4, ... {chunks} ranks, or give invariant= a power of two "
                f"at least {n} (the number of chunks)."]
    found = []
    for m in mounts:
        problem = _problem(m, modules[m.fqn], n, chunks)
        if problem is not None:
            found.append(f"{m.style!r} at {m.where}: invariant mode {problem}")
    return found


def caveats(mounts: tuple, n: int) -> list:
    """What invariant mode gives one rank's bits for only where the model does its part: the
    projections whose key and value heads ``n`` ranks replicate (one line; empty: none)."""
    replicated = [m for m in mounts if any(isinstance(p, Shard) and p.copies(n) > 1 for _, p in m.params)]
    if not replicated:
        return []
    names = list(dict.fromkeys(repr(generalize(m.fqn)) for m in replicated))
    heads = min(p.heads for m in replicated for _, p in m.params if isinstance(p, Shard) and p.heads)
    return [f"invariant mode: {', '.join(names)} replicate key and value heads over {n // heads} ranks each, and tpfn "
            "sums a head's gradient over them at the projection's output, which gives one rank's bits only where the "
            "model repeats the heads right after projecting them (values; keys with no rotary embedding between); "
            f"use at most {heads} ranks for one rank's bits in every model (docs/invariance.md)."]


def sums_positions(mount) -> bool:
    """Whether the module computes each position of a sequence alone (input and output sharded
    alike) with replicated parameters whose gradients are partial sums over positions."""
    shards = mount.shards
    if shards is None or not any(isinstance(g, Partial) for _, g in shards.param_grads):
        return False
    seq = shards.output
    return isinstance(seq, Shard) and all(d is None or d == seq for d in shards.desired)


def _problem(m, module: nn.Module, n: int, chunks: int) -> str | None:
    shards = m.shards
    if shards is None:  # (a style of slots alone hands on what arrives; its children are checked)
        if m.style.core is not None and not isinstance(module, nn.Embedding):
            return ("orders the sums of modules that compute on local shards, and this one computes on "
                    "DTensors (its forward is not its kind's own), whose sums DTensor orders; leave it out "
                    "of the plan, or give it its kind's forward.")
        return None
    if m.row is not None and m.row.fast == "linear":
        return _linear(m, module, n, chunks)
    if isinstance(module, nn.Embedding):  # one term per element is not zero: exact in any order
        return None
    if isinstance(shards.output, Partial) or any(isinstance(g, Partial) for g in shards.grads):
        what = "output" if isinstance(shards.output, Partial) else "input's gradient"
        return (f"cannot order the sums of its own forward (its {what} is a partial sum); it orders "
                "those of nn.Linear (colwise(), rowwise()), nn.Embedding and sequence-parallel modules: "
                "leave this one out of the plan (whole on every rank), or run without invariant=.")
    if any(isinstance(g, Partial) for _, g in shards.param_grads) and not sums_positions(m):
        return ("cannot order the sums of its parameters' partial gradients: it orders those summed over "
                "the positions of a sequence (on_shards(Shard(d), output=Shard(d), param_grads=...)).")
    return None


def _linear(m, module: nn.Linear, n: int, chunks: int) -> str | None:
    """Why the linear kernel in invariant mode cannot take ``module`` (None: it can)."""
    layout = dict(m.params).get("weight")
    if not isinstance(layout, Shard):
        return None if layout is None else "takes a linear whose weight is sharded."
    dim = layout.dim % 2
    size = module.weight.shape[dim]
    if layout.parts != 1:
        return (f"cuts a linear's sharded dim into {chunks} chunks, one product each, and a packed one "
                f"(parts={layout.parts!r}) is not cut so; split the projection into one per part, each "
                "colwise().")
    if size % chunks:
        return (f"cuts the {'output' if dim == 0 else 'input'} features of a linear into {chunks} equal "
                f"chunks, one product each, and {size} do not split so; choose invariant= a power of two "
                f"that divides {size}, or leave it out of the plan.")
    copies = layout.copies(n)
    if copies > 2:
        return (f"sums the gradient of a key or value head over the {copies} ranks that replicate it before its "
                "products, and the attention sums its query heads' in an order of its own, which two "
                f"terms alone do not depend on; use at most {2 * layout.heads} ranks for {layout.heads} KV heads.")
    if copies > 1 and chunks % layout.heads:
        return (f"cuts the {layout.heads} heads of a linear into {chunks} chunks, whole heads on whole "
                f"chunks; give invariant= a power of two that {layout.heads} divides.")
    return None


class _Fan(torch.autograd.Function):
    """``k`` aliases of ``x`` (a parameter's local shard), one per chunk of the sequence; their
    gradients are added by the canonical tree (this rank's subtree)."""

    @staticmethod
    def forward(ctx, x, k: int):
        return tuple(x.detach() for _ in range(k))

    @staticmethod
    def backward(ctx, *grads):
        return total(grads), None


class _Split(torch.autograd.Function):
    """``x`` cut along ``dim`` into ``k`` equal chunks, each a contiguous tensor of its own; the
    gradient is their gradients put back together."""

    @staticmethod
    def forward(ctx, x, dim: int, k: int):
        ctx.dim, size = dim, x.shape[dim] // k
        return tuple(x.narrow(dim, i * size, size).contiguous() for i in range(k))

    @staticmethod
    def backward(ctx, *grads):
        return torch.cat(grads, ctx.dim), None, None


class _Join(torch.autograd.Function):
    """The chunks put back together along ``dim``; each chunk's gradient a contiguous tensor of
    its own (laid out alike at every degree)."""

    @staticmethod
    def forward(ctx, dim: int, *parts):
        ctx.dim, ctx.sizes = dim, [p.shape[dim] for p in parts]
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad):
        starts = [sum(ctx.sizes[:i]) for i in range(len(ctx.sizes))]
        return (None, *(grad.narrow(ctx.dim, s, size).contiguous() for s, size in zip(starts, ctx.sizes)))


def by_tokens(call, args: tuple, kwargs: dict, saved: list, forward, chunks: int):
    """A sequence-parallel module's output for ``call`` in invariant mode: its forward (``forward``,
    else its own) once per chunk of the sequence (``chunks`` chunks of the whole; this rank's are
    its slice), each on its own aliases of the parameters' local views now in ``saved``'s slots
    (``(table, name, parameter)``), the chunks' outputs put back together."""
    rt = call.rt
    shards, where = rt.mount.shards, rt.mount.where
    dim, n = shards.output.dim, rt.mesh.size()
    shape, k = call.shape(exact=True), chunks // n
    d = dim % len(shape)
    if shape[d] % chunks:
        raise LayoutError(f"input 0 of {where}: invariant mode cuts the sequence into {chunks} equal chunks and "
                          f"adds its parameters' gradients over them in one tree, and its {shape[d]} positions "
                          f"in dim {d} do not split so; pad the sequence to a multiple of {chunks}.")
    aliases = {}
    for table, name, _ in saved:
        view = table[name]
        if id(view) not in aliases:
            grads = view.requires_grad and torch.is_grad_enabled()
            aliases[id(view)] = _Fan.apply(view, k) if grads else (view,) * k
    slots = [(table, name, aliases[id(table[name])]) for table, name, _ in saved]
    cut = {i: _Split.apply(x, d, k) for i, x in enumerate(args)
           if isinstance(x, torch.Tensor) and i < len(shards.desired) and shards.desired[i] == shards.output}
    outs = []
    for j in range(k):
        for table, name, mine in slots:
            table[name] = mine[j]
        inputs = tuple(cut[i][j] if i in cut else x for i, x in enumerate(args))
        out = call.own(*inputs, **kwargs) if forward is None else forward(call, *inputs, **kwargs)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"the output of {where} is {type(out).__name__}, not a tensor; invariant mode runs "
                            "a sequence-parallel module once per chunk of the sequence and joins its tensor outputs.")
        outs.append(out)
    return _Join.apply(d, *outs)
