"""A replica handed on as terms of a sum, its gradient handed back as terms: a local move.

``prepare_in(Replicate(), desired=Partial(), grads=Partial(), local=True)`` makes each
rank's replica one of ``n`` equal terms, ``x / n`` (the algebra's ``Split``), and hands the
whole gradient that reaches those terms back as ``n`` equal terms too, ``g / n``
(``pullback(..., to=Partial())``): for a module called inside a computation on shards whose
input gradient is a partial sum (the identity experts of a mixture whose experts' outputs are
summed over the ranks). Both directions are local; nothing is communicated.

>>> import torch
>>> from torch.distributed.device_mesh import init_device_mesh
>>> from tpfn.layout import Partial, Replicate
>>> mesh = init_device_mesh("cpu", (1,))
>>> x = torch.ones(2, requires_grad=True)
>>> terms(x, Replicate(), Partial(), Replicate(), Partial(), mesh, "input 0").sum().backward()
>>> x.grad.tolist()                               # one rank: the whole value, both ways
[1.0, 1.0]
"""

from __future__ import annotations

import functools

import torch

from tpfn.algebra import Split, pullback, transition
from tpfn.errors import LayoutError

__all__ = ["terms", "scaled"]


class _Terms(torch.autograd.Function):
    """``x / forward`` forward, ``g / backward`` backward (1: left as it is)."""

    @staticmethod
    def forward(ctx, x, forward, backward):
        ctx.backward = backward
        return x.view_as(x) if forward == 1 else x / forward

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.backward == 1 else grad / ctx.backward), None, None


def scaled(x: torch.Tensor, forward: int, backward: int) -> torch.Tensor:
    """``x / forward``, its gradient divided by ``backward`` (1: that direction left alone)."""
    return _Terms.apply(x, forward, backward)


def _divisor(steps, n: int, what: str, side: str) -> int:
    """The mesh size where ``steps`` split a sum into terms (1 where they leave it alone)."""
    if any(not isinstance(s, Split) for s in steps):
        raise LayoutError(f"{what}: its {side} would run {steps}, but a gradient handed back as "
                          "terms (grads=Partial()) is moved only by local splits, from a replica "
                          "to terms (Replicate() -> Partial()); ask for Replicate() or Partial().")
    return n if any(s.op == "sum" for s in steps) else 1


@functools.lru_cache(maxsize=256)  # values alone: the same for every model and mesh
def _divisors(src, dst, grad, to, n: int, what: str) -> tuple:
    """(forward, backward) divisors of ``terms``, the algebra's moves worked out once per slot."""
    return (_divisor(transition(src, dst), n, what, "move"),
            _divisor(pullback(src, dst, grad, to=to), n, what, "gradient's move"))


def terms(x: torch.Tensor, src, dst, grad, to, mesh, what: str) -> torch.Tensor:
    """Local ``x`` laid out ``src`` -> ``dst``, its gradient arriving in ``grad`` handed back
    in ``to``; each direction may only split a replica into terms (``Split``)."""
    forward, backward = _divisors(src, dst, grad, to, mesh.size(), what)
    if not (x.requires_grad and torch.is_grad_enabled()):
        return x if forward == 1 else x / forward
    return _Terms.apply(x, forward, backward)
