"""The canonical tree: one order of summing, the same on one rank and on eight.

A sum over a dim that ranks split (a row-wise linear's features, a column-wise linear's input
gradient, the tokens of a sequence-parallel norm's gradient, a vocabulary's exponentials) comes
out in another order, so with other bits, at each degree. In invariant mode
(``parallelize(..., invariant=True)``) tpfn splits such a dim into ``chunks`` equal chunks, a
number that does not depend on the degree (``CHUNKS``, 8): each chunk's partial sum is computed
by the same call on operands of the same shape on whichever rank holds it, and the partial sums
(the *leaves*) are added in one binary tree, adjacent pairs level by level::

    ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))

On ``n`` ranks (a power of two, at most ``chunks``) rank ``r`` holds the leaves
``leaves(chunks, n, r)``, a whole subtree: it adds them alone (``total``), and the ranks' roots
are added by the same tree after an all-gather (``tpfn.bounded``). One rank holding every leaf,
or eight ranks holding one each, make the same additions in the same order.

>>> import torch
>>> parts = [torch.tensor([float(2 ** i)]) for i in range(8)]
>>> total(parts).item() == total([total(parts[:4]), total(parts[4:])]).item()
True
>>> list(leaves(8, 4, 1)), fits(3, 8)
([2, 3], 'invariant mode needs a power of two of ranks, at most its 8 chunks, not 3')
"""

from __future__ import annotations

import torch

__all__ = ["CHUNKS", "chunks_of", "fits", "leaves", "total", "pieces"]

CHUNKS = 8
"""How many chunks invariant mode splits a contracted dim into: at least the largest degree
that gives the same bits (8 ranks)."""


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def chunks_of(invariant) -> int | None:
    """The number of chunks ``parallelize(..., invariant=...)`` asks for: None for False,
    ``CHUNKS`` for True, else the power of two given.

    >>> chunks_of(False), chunks_of(True), chunks_of(16)
    (None, 8, 16)
    """
    if invariant is False or invariant is None:
        return None
    if invariant is True:
        return CHUNKS
    if isinstance(invariant, int) and not isinstance(invariant, bool) and _power_of_two(invariant):
        return invariant
    raise ValueError(f"'invariant' must be True, False or a number of chunks, a power of two at least the "
                     f"mesh size (got {invariant!r}); e.g. invariant=True ({CHUNKS} chunks), or 16 for 16 ranks.")


def fits(n: int, chunks: int) -> str | None:
    """Why ``n`` ranks cannot share ``chunks`` leaves as whole subtrees (None: they can)."""
    if _power_of_two(n) and n <= chunks:
        return None
    return f"invariant mode needs a power of two of ranks, at most its {chunks} chunks, not {n}"


def leaves(chunks: int, n: int, rank: int) -> range:
    """The leaves that rank ``rank`` of ``n`` holds: its contiguous ``chunks // n``."""
    k = chunks // n
    return range(rank * k, (rank + 1) * k)


def total(parts) -> torch.Tensor:
    """The sum of ``parts`` (a power of two of tensors, leaves left to right) by the canonical
    tree: adjacent pairs, level by level. The parts are never written (a new tensor, unless
    there is one part: that one)."""
    parts = list(parts)
    if not _power_of_two(len(parts)):
        raise ValueError(f"the canonical tree adds a power of two of parts, not {len(parts)}")
    first = True
    while len(parts) > 1:  # the first level makes new tensors, the next ones add into them
        parts = [a + b if first else a.add_(b) for a, b in zip(parts[::2], parts[1::2])]
        first = False
    return parts[0]


def pieces(x: torch.Tensor, dim: int, k: int) -> tuple:
    """``x`` cut along ``dim`` into ``k`` equal chunks, each contiguous (one copy of ``x``, the
    chunks in its leading dim): the operands of one call per chunk, laid out alike at every
    degree."""
    dim %= x.ndim
    return x.unflatten(dim, (k, x.shape[dim] // k)).movedim(dim, 0).contiguous().unbind(0)
