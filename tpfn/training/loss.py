"""Cross-entropy on logits sharded over the classes, without ever gathering them.

A column-wise output head leaves each rank a slice of the vocabulary for every token. The
loss needs, per token, the max logit, the sum of exponentials, the target's logit (and,
with label smoothing, the weighted sum of logits): per-token statistics, reduced over the
mesh in two all-reduces. The backward needs no communication at all: each rank computes the
gradient of its own slice from the statistics.

It is a function, not a global patch: other ``log_softmax`` calls keep their own
gradients. With ``invariant=True`` the sums over the vocabulary follow the canonical tree
(``tpfn.tree``): one sum per chunk of the classes, the chunks added in one order at every
degree, so the loss has the same bits on 1, 2, 4 or 8 ranks (the maxima are exact in any order).

>>> import torch, torch.nn.functional as F
>>> from torch.distributed.device_mesh import init_device_mesh
>>> from torch.distributed.tensor import distribute_tensor, Shard
>>> mesh = init_device_mesh("cpu", (1,))
>>> logits, target = torch.randn(6, 10), torch.tensor([1, 0, 9, 4, 4, 2])
>>> sharded = distribute_tensor(logits, mesh, [Shard(1)])
>>> torch.allclose(cross_entropy(sharded, target, label_smoothing=0.1),
...                F.cross_entropy(logits, target, label_smoothing=0.1))
True
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from tpfn._torch import assert_async
from tpfn.algebra import chunk_bounds
from tpfn.bounded import all_reduce, collective, tree_sum
from tpfn.layout import Shard, from_torch, normalize
from tpfn.interpret.agree import agreed_shape
from tpfn.interpret.state import Guess, recall
from tpfn.tree import chunks_of, fits, pieces, total

__all__ = ["cross_entropy"]


def _reduce(t: torch.Tensor, op: str, mesh, what: str, tree: bool = False) -> torch.Tensor:
    """The ranks' ``t`` reduced with ``op``; ``tree``: summed by the canonical tree (``t`` the root
    of this rank's subtree)."""
    if tree and mesh.size() == 1:
        return t
    with collective(f"cross_entropy's {'all-gather' if tree else 'all-reduce'} of {what}", mesh) as bound:
        return tree_sum(t, mesh, bound) if tree else all_reduce(t, op, bound)


def _sum(x: torch.Tensor, chunks: int | None, n: int) -> torch.Tensor:
    """``x.sum(-1)``, or in invariant mode (``chunks``) one sum per chunk of this rank's classes,
    added by the canonical tree: this rank's subtree's root."""
    if chunks is None:
        return x.sum(-1)
    return total(p.sum(-1) for p in pieces(x, -1, chunks // n))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token losses from a local slice of the classes (``x``: tokens x local classes).

    With ``s`` the logits shifted by their max, ``lse`` the log-sum-exp of ``s``, ``w`` the
    class weights (ones without), ``W`` their sum, ``y`` the target and ``eps`` the label
    smoothing over ``C`` classes, the loss of a token is
    ``(1 - eps) w_y (lse - s_y) + eps / C (W lse - sum_c w_c s_c)``, as ``F.cross_entropy``
    computes it, and its gradient is ``(1 - eps) w_y (p - onehot_y) + eps / C (W p - w)``."""

    @staticmethod
    def forward(ctx, x, target, weight, offset, n_classes, ignore_index, eps, mesh, chunks):
        local = x.shape[-1]
        ignored = target == ignore_index
        inside = (target >= offset) & (target < offset + local) & ~ignored
        picked = torch.where(inside, target - offset, 0).unsqueeze(-1)
        high = _reduce(x.amax(dim=-1), "max", mesh, "the per-token maxima")
        shifted = x - high.unsqueeze(-1)
        exp = shifted.exp()
        w = weight[offset:offset + local] if weight is not None else None
        n = mesh.size()
        stats = [_sum(exp, chunks, n), torch.where(inside, shifted.gather(-1, picked).squeeze(-1), 0)]
        if eps:
            stats.append(_sum(shifted * w if w is not None else shifted, chunks, n))
        stats = _reduce(torch.stack(stats), "sum", mesh, "the per-token sums", chunks is not None)
        lse = stats[0].log()
        w_y = weight[torch.where(ignored, 0, target)] if weight is not None else 1.0
        w_total = weight.sum() if weight is not None else n_classes
        loss = (1 - eps) * w_y * (lse - stats[1])
        if eps:
            loss = loss + eps / n_classes * (w_total * lse - stats[2])
        ctx.save_for_backward(exp / stats[0].unsqueeze(-1), picked, inside, ignored)
        ctx.constants = (w_y, w, w_total, eps, n_classes)
        return torch.where(ignored, 0, loss)

    @staticmethod
    def backward(ctx, grad):
        p, picked, inside, ignored = ctx.saved_tensors
        w_y, w, w_total, eps, n_classes = ctx.constants
        g = torch.where(ignored, 0, grad)
        a = (1 - eps) * w_y * g  # weight of (p - onehot_y)
        b = eps / n_classes * g  # weight of (W p - w)
        d = (a + b * w_total).unsqueeze(-1) * p
        d = d.scatter_add(-1, picked, -(a * inside).unsqueeze(-1).to(d.dtype))
        if eps:
            d = d - b.unsqueeze(-1) * (w if w is not None else 1.0)
        return d, None, None, None, None, None, None, None, None


def cross_entropy(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                  size_average: None = None, ignore_index: int = -100, reduce: None = None,
                  reduction: str = "mean", label_smoothing: float = 0.0, *,
                  mesh: DeviceMesh | None = None, invariant: bool | int = False) -> torch.Tensor:
    """``F.cross_entropy`` on logits sharded over the class dim, without gathering them.

    ``input`` is a DTensor sharded on its class dim (dim 1, or 0 for one sample: the output
    of a column-wise head kept as a DTensor, ``colwise(local=False)``), or a local tensor with
    ``mesh`` given. ``target`` holds class indices, replicated. The other arguments are
    ``F.cross_entropy``'s: class ``weight`` (the whole vector), ``ignore_index``, ``reduction``
    (``"mean"``, ``"sum"``, ``"none"``), ``label_smoothing``. Returns a plain tensor, the same on
    every rank. Forward: two all-reduces of per-token statistics (and, for a local tensor that
    is not the very one a slot handed on, such as ``logits.flatten(0, 1)``, one all-gather of
    the ranks' local shapes: an odd vocabulary splits unevenly); backward: none. ``invariant``:
    the sums over the classes by the canonical tree, the same bits at every degree (True: 8
    chunks of the classes; a power of two: that many; an all-gather of the per-token sums in
    place of their all-reduce), as ``parallelize(..., invariant=True)``."""
    chunks = chunks_of(invariant)
    if size_average is not None or reduce is not None:
        raise TypeError("cross_entropy: size_average and reduce are deprecated in torch; use reduction=.")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"cross_entropy: 'reduction' must be 'mean', 'sum' or 'none' (got {reduction!r}).")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"cross_entropy: 'label_smoothing' must lie in [0, 1] (got {label_smoothing!r}).")
    if isinstance(target, DTensor):
        raise TypeError("cross_entropy: 'target' must be a plain tensor of class indices, the same on every "
                        f"rank (got a DTensor laid out {from_torch(target.placements)}); pass target.full_tensor().")
    if target.is_floating_point():
        raise ValueError("cross_entropy: target must hold class indices; class probabilities would "
                         "have to be sharded like the logits, which tpfn does not do.")
    class_dim = 1 if input.dim() >= 2 else 0
    if isinstance(input, DTensor):
        layout = normalize(from_torch(input.placements), input.dim())
        if layout != (Shard(class_dim),):
            raise ValueError(
                f"cross_entropy: logits must be sharded on their class dim {class_dim}, like "
                f"F.cross_entropy's input; got {layout}. End the head with colwise(local=False), "
                "and move the classes to dim 1 (logits.flatten(0, -2) for (batch, seq, vocab)).")
        mesh, n_classes, x = input.device_mesh, input.shape[class_dim], input.to_local()
    elif mesh is None:
        raise TypeError("cross_entropy: give the sharded logits as a DTensor, or a local tensor with mesh=.")
    else:
        x, placements = input, (torch.distributed.tensor.Shard(class_dim),)
        shape = recall(x, placements, mesh)  # exact for the very tensor a slot handed on
        if isinstance(shape, Guess):  # another (logits.flatten(0, 1)): 11 classes are 6 and 5,
            shape = agreed_shape(x, placements, mesh, "cross_entropy's logits") or shape  # not 12, 10
        n_classes = shape[class_dim]
    if weight is not None and (weight.dim() != 1 or weight.numel() != n_classes):
        raise ValueError(f"cross_entropy: 'weight' must hold one weight per class, {n_classes} "
                         f"(got one of shape {tuple(weight.shape)}).")
    kept = target != ignore_index
    assert_async(((target >= 0) & (target < n_classes) | ~kept).all(),
                 f"cross_entropy: a target lies outside the {n_classes} classes (and is not "
                 f"ignore_index={ignore_index})")
    rows = tuple(x.shape[:class_dim]) + tuple(x.shape[class_dim + 1:])
    if tuple(target.shape) != rows:
        raise ValueError(f"cross_entropy: 'target' must hold one class index per row of the logits, shape "
                         f"{rows} (got {tuple(target.shape)}); flatten both alike: logits.flatten(0, -2) "
                         "and target.flatten().")
    if chunks is not None:
        why = fits(mesh.size(), chunks) or (
            f"the {n_classes} classes do not split into {chunks} equal chunks" if n_classes % chunks else None)
        if why is not None:
            raise ValueError(f"cross_entropy(invariant=...): {why}; give invariant= a power of two of chunks "
                             "that divides the classes and is at least the mesh size.")
    x = x.movedim(class_dim, -1)
    offset, _ = chunk_bounds(n_classes, mesh.size(), mesh.get_local_rank())
    losses = _VocabParallelCrossEntropy.apply(
        x.reshape(-1, x.shape[-1]), target.reshape(-1), weight, offset, n_classes,
        ignore_index, float(label_smoothing), mesh, chunks).reshape(x.shape[:-1])
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    if weight is None:
        return losses.sum() / kept.sum()
    return losses.sum() / weight[torch.where(kept, target, 0)].masked_fill(~kept, 0).sum()
